"""OpenAI's Responses API on the gateway (``POST /v1/responses``), in process: the official
``openai`` client (``client.responses.create``, streamed and not) over Starlette's TestClient, the
tiny engine whose chat template renders tools, a ``ScriptedBackend`` that forces what the model
"writes".

A Responses request is the chat request it is: instructions as the system message, input items
as messages (function calls and their outputs as an agent loop's turns, the outputs prunable
passages), function tools, ``text.format`` under the grammar; its errors name the Responses
field; ``previous_response_id`` continues a stored conversation within its tenant only.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")

from fastapi.testclient import TestClient  # noqa: E402

from specprefill_rag import SpecPrefillEngine  # noqa: E402
from specprefill_rag.gateway import create_app  # noqa: E402
from specprefill_rag.gateway.responses_api import ResponsesCall, ResponseStore  # noqa: E402
from specprefill_rag.testing import ScriptedBackend, tiny_engine  # noqa: E402

URL = "/v1/responses"
SEARCH = {"type": "function", "name": "search", "description": "Search the station's documents.",
          "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}
DOCS = ["The sky is blue. The quick brown fox jumps over the lazy dog. " * 6,
        "The passkey is 48213. The sky is blue. " * 6,
        "Answer the question using the context. The fox jumps. " * 6]
KEYS = {"key-a": "alpha", "key-b": "beta"}


def call(name: str = "search", **arguments: object) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


@pytest.fixture(scope="module")
def engine() -> SpecPrefillEngine:
    return tiny_engine(tools=True)


@contextlib.contextmanager
def gateway(engine: SpecPrefillEngine, text: str, *then: str, **options: Any
            ) -> Iterator[tuple[TestClient, ScriptedBackend]]:
    """A gateway whose model writes ``text`` (then each of ``then``); its backend records the plan."""
    backend = ScriptedBackend(engine.backend, text, *then)
    scripted = SpecPrefillEngine(backend, engine.draft, engine.config)
    with TestClient(create_app(scripted, **options), raise_server_exceptions=False) as client:
        assert client.get("/ready").status_code == 200
        yield client, backend


def sdk(test_client: TestClient, key: str = "-") -> Any:
    return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=test_client, max_retries=0)


def prompt_text(backend: ScriptedBackend) -> str:
    """The text of the tokens the main model was given (kept ones only, for a pruned plan)."""
    return backend.tokenizer.decode(backend.plan.token_ids.tolist())


def post(client: TestClient, body: dict, key: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    response = client.post(URL, content=json.dumps(body), headers=headers)
    return response.status_code, response.json()


# -- answers -------------------------------------------------------------------------------------


def test_a_text_answer_with_instructions(engine):
    with gateway(engine, "The passkey is 48213.") as (test_client, backend):
        answer = sdk(test_client).responses.create(model="m", instructions="Answer in one line.",
                                                   input="What is the passkey?", max_output_tokens=50)
    assert answer.status == "completed" and answer.output_text == "The passkey is 48213."
    [item] = answer.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert answer.id.startswith("resp_") and answer.instructions == "Answer in one line."
    assert answer.usage.output_tokens > 0 and answer.usage.input_tokens == answer.model_extra["specprefill"][
        "prompt_tokens"]
    shown = prompt_text(backend)
    assert "Answer in one line." in shown and "What is the passkey?" in shown
    assert shown.index("Answer in one line.") < shown.index("What is the passkey?")  # the system message first


def test_a_stream_is_the_typed_events_of_the_same_response(engine):
    with gateway(engine, "The passkey is 48213.") as (test_client, _):
        client = sdk(test_client)
        events = list(client.responses.create(model="m", input="What is the passkey?", max_output_tokens=50,
                                              stream=True))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == "The passkey is 48213."
    assert [event.sequence_number for event in events] == list(range(len(events)))
    done = events[-1].response
    assert done.output_text == "The passkey is 48213." and done.status == "completed"
    assert done.model_extra["specprefill"]["prompt_tokens"] > 0


def test_a_cut_answer_is_incomplete(engine):
    with gateway(engine, "The passkey is 48213, and the sky is blue over the station.") as (test_client, _):
        answer = sdk(test_client).responses.create(model="m", input="What is the passkey?", max_output_tokens=3)
    assert answer.status == "incomplete" and answer.incomplete_details.reason == "max_output_tokens"


# -- tools: an agent loop's turns ------------------------------------------------------------------


def test_function_calls_come_back_as_items(engine):
    with gateway(engine, call(query="passkey")) as (test_client, _):
        client = sdk(test_client)
        asked = {"model": "m", "input": "What is the passkey?", "tools": [SEARCH], "tool_choice": "required",
                 "max_output_tokens": 200}
        answer = client.responses.create(**asked)
        streamed = list(client.responses.create(**asked, stream=True))
    [made] = answer.output
    assert made.type == "function_call" and made.name == "search" and json.loads(made.arguments) == {
        "query": "passkey"}
    assert made.call_id.startswith("call_") and made.status == "completed"
    kinds = [event.type for event in streamed]
    assert "response.output_text.delta" not in kinds  # no raw call text reaches the client
    arguments = [event for event in streamed if event.type == "response.function_call_arguments.done"]
    assert len(arguments) == 1 and json.loads(arguments[0].arguments) == {"query": "passkey"}
    [item] = streamed[-1].response.output
    assert item.type == "function_call" and item.name == "search"


def test_function_outputs_are_prunable_passages(engine):
    """The loop's next step: the call and its output go back as input items; the output's
    documents are passages, pruned and reported one by one."""
    items = [{"role": "user", "content": "What is the passkey?"},
             {"type": "function_call", "call_id": "call_1", "name": "search", "arguments": '{"query": "passkey"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "\n\n".join(DOCS)}]
    with gateway(engine, "The passkey is 48213.") as (test_client, backend):
        status, answer = post(test_client, {"model": "m", "input": items, "tools": [SEARCH], "max_output_tokens": 200,
                                            "specprefill": {"keep_rate": 0.3}})
    assert status == 200, answer
    assert answer["output"][0]["content"][0]["text"] == "The passkey is 48213."
    ext = answer["specprefill"]
    assert ext["prompt_shape"] == "tools" and ext["speculated"] is True
    assert len([s for s in ext["kept_spans"] if s["kind"] == "tool_result"]) == len(DOCS)
    assert backend.plan.token_ids.numel() < ext["prompt_tokens"]


def test_a_loop_that_sends_the_output_items_back(engine):
    """How the Agents SDK runs a loop without ``previous_response_id``: each step sends the whole
    conversation, the earlier responses' ``output`` items as they came (ids, statuses and all), then
    each tool's output; tools stay offered at the answer step. Each output is read as a passage per
    document, and a step's draft reads the conversation the step before it read from its prefix
    store (here the third: the first step's short prompt is prefilled whole, no draft)."""
    steps = (call(query="passkey"), call(query="door"), "The passkey is 48213.")
    with gateway(engine, "Ready.", *steps) as (test_client, backend):
        client = sdk(test_client)
        items: list[dict] = [{"role": "user", "content": "What is the passkey, and which door does it open?"}]
        answers = []
        for _ in steps:
            answer = client.responses.create(model="m", input=items, tools=[SEARCH], max_output_tokens=200,
                                             extra_body={"specprefill": {"keep_rate": 0.3}})
            answers.append(answer)
            items += [item.model_dump(exclude_none=True) for item in answer.output]
            items += [{"type": "function_call_output", "call_id": item.call_id, "output": "\n\n".join(DOCS)}
                      for item in answer.output if item.type == "function_call"]
        shown = prompt_text(backend)
    assert [[item.type for item in a.output] for a in answers] == [["function_call"]] * 2 + [["message"]]
    assert answers[-1].output_text == "The passkey is 48213."
    assert '"passkey"' in shown and '"door"' in shown  # the earlier calls, rendered as the model wrote them
    reports = [a.model_extra["specprefill"] for a in answers]
    assert len([s for s in reports[-1]["kept_spans"] if s["kind"] == "tool_result"]) == 2 * len(DOCS)
    assert reports[1]["speculated"] and reports[1]["draft_cached_tokens"] == 0
    assert reports[2]["draft_cached_tokens"] > 0.9 * reports[1]["prompt_tokens"]  # step 2's prompt, read once


def test_text_format_json_schema_decodes_under_the_grammar(engine):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    with TestClient(create_app(engine), raise_server_exceptions=False) as test_client:
        status, answer = post(test_client, {"model": "m", "input": "Is the sky blue?", "max_output_tokens": 40,
                                            "text": {"format": {"type": "json_schema", "name": "verdict",
                                                                "schema": schema, "strict": True}}})
    assert status == 200, answer
    text = answer["output"][0]["content"][0]["text"]
    assert json.loads(text) in ({"ok": True}, {"ok": False}), text  # the random model can only write this
    assert answer["text"]["format"]["name"] == "verdict"


# -- conversations ---------------------------------------------------------------------------------


def test_previous_response_id_continues_the_conversation(engine):
    # The first scripted answer goes to the warm-up (``/ready``), the next ones to the two turns.
    with gateway(engine, "Ready.", "The passkey is 48213.", "It opens the north door.") as (test_client, backend):
        client = sdk(test_client)
        first = client.responses.create(model="m", input="What is the passkey?", instructions="Be brief.",
                                        max_output_tokens=50)
        second = client.responses.create(model="m", input="What does it open?", previous_response_id=first.id,
                                         max_output_tokens=50)
        shown = prompt_text(backend)
        unstored = client.responses.create(model="m", input="What is the passkey?", store=False)
        with pytest.raises(openai.BadRequestError) as missing:
            client.responses.create(model="m", input="And then?", previous_response_id=unstored.id)
    assert second.output_text == "It opens the north door." and second.previous_response_id == first.id
    assert "What is the passkey?" in shown and "The passkey is 48213." in shown and "What does it open?" in shown
    assert "Be brief." not in shown  # instructions are the request's own, not carried over
    assert missing.value.body["param"] == "previous_response_id"
    assert missing.value.body["code"] == "previous_response_not_found"


def test_a_tenant_never_continues_anothers_conversation(engine):
    with gateway(engine, "The passkey is 48213.", api_keys=KEYS) as (test_client, _):
        status, first = post(test_client, {"model": "m", "input": "What is the passkey?"}, key="key-a")
        assert status == 200, first
        status, theirs = post(test_client, {"model": "m", "input": "Go on.", "previous_response_id": first["id"]},
                              key="key-b")
        status_own, own = post(test_client, {"model": "m", "input": "Go on.", "previous_response_id": first["id"]},
                               key="key-a")
    assert status == 400 and theirs["error"]["param"] == "previous_response_id"
    assert status_own == 200, own


def test_the_store_keeps_its_most_recent_conversations():
    store = ResponseStore(entries=2)
    for rid in ("a", "b", "c"):
        store.put(("ns", rid), ({"role": "user", "content": rid},))
    assert store.get("ns", "a") is None and store.get("ns", "c") is not None and len(store) == 2
    assert store.get("other", "c") is None
    small = ResponseStore(max_bytes=100)  # and at most so many bytes of them (their JSON)
    small.put(("ns", "big"), ({"role": "user", "content": "x" * 200},))
    assert small.get("ns", "big") is None and len(small) == 0


# -- refusals name the Responses field ---------------------------------------------------------------


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"role": "user", "content": "  "}]}, "input[0].content"),
    ({"input": [{"role": "user", "content": "Q?"}, {"type": "function_call", "call_id": "c1", "name": "search",
                                                    "arguments": "{not json"}], "tools": [SEARCH]},
     "input[1].arguments"),
    ({"input": [{"role": "user", "content": "Q?"}, {"type": "function_call_output", "output": "x"}],
      "tools": [SEARCH]}, "input[1].call_id"),
    ({"input": "Q?", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "Q?", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "Q?", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"$ref": "#"}}}},
     "text.format.schema"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": "Q?", "background": True}, "background"),
    ({"input": []}, "input"),
])
def test_a_refusal_names_the_responses_field(engine, body, param):
    with TestClient(create_app(engine), raise_server_exceptions=False) as test_client:
        status, answer = post(test_client, {"model": "m", **body})
    assert status == 400, answer
    error = answer["error"]
    assert error["type"] == "invalid_request_error" and error["param"] is not None
    assert error["param"].startswith(param), error
    assert "messages[" not in error["message"], error  # the chat body it became is not the client's


def test_the_chat_body_it_becomes():
    body = {"input": [{"role": "developer", "content": "Use tools."},
                      {"role": "user", "content": [{"type": "input_text", "text": "Q?"}]},
                      {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me."}]},
                      {"type": "function_call", "call_id": "c1", "name": "search", "arguments": "{}"},
                      {"type": "function_call", "call_id": "c2", "name": "search", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "c1", "output": "one"},
                      {"type": "function_call_output", "call_id": "c2", "output": "two"}],
            "instructions": "Be brief.", "tools": [SEARCH], "tool_choice": {"type": "function", "name": "search"},
            "max_output_tokens": 9, "text": {"format": {"type": "json_object"}}, "metadata": {"k": "v"}}
    chat = ResponsesCall.read(body, ResponseStore(), "ns").chat
    roles = [m["role"] for m in chat["messages"]]
    assert roles == ["system", "system", "user", "assistant", "tool", "tool"]
    assert [c["id"] for c in chat["messages"][3]["tool_calls"]] == ["c1", "c2"]  # one turn, two calls
    assert chat["messages"][3]["content"] == [{"type": "text", "text": "Let me."}]
    assert chat["tools"] == [{"type": "function", "function": {k: v for k, v in SEARCH.items() if k != "type"}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "search"}}
    assert chat["max_tokens"] == 9 and chat["response_format"] == {"type": "json_object"}
    assert "metadata" not in chat and "input" not in chat


def test_responses_are_counted_in_metrics(engine):
    with gateway(engine, "The passkey is 48213.") as (test_client, _):
        assert post(test_client, {"model": "m", "input": "What is the passkey?"})[0] == 200
        text = test_client.get("/metrics").text
    assert 'specprefill_gateway_requests_total{endpoint="responses",mode="specprefill",status="200"} 1.0' in text


def test_chat_params_become_the_responses_fields():
    """What ``renamed`` does to any error of the chat path, the engine's after parsing included."""
    body = {"input": [{"role": "user", "content": "Q?"},
                      {"type": "function_call", "call_id": "c1", "name": "search", "arguments": "{}"},
                      {"type": "function_call", "call_id": "c2", "name": "search", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "c1", "output": "one"}],
            "instructions": "Be brief."}
    call = ResponsesCall.read(body, ResponseStore(), "ns")
    assert [call.param(p) for p in ("messages[0].content", "messages[1].content", "messages[2].tool_calls[1].id",
                                    "messages[2].tool_calls[0].function.arguments", "messages[3].tool_call_id",
                                    "messages[3].content", "response_format.json_schema.schema.x", "max_tokens",
                                    "tools[2].function.parameters", "stop")] == [
        "instructions", "input[0].content", "input[2].call_id", "input[1].arguments", "input[3].call_id",
        "input[3].output", "text.format.schema.x", "max_output_tokens", "tools[2].parameters", "stop"]
    from specprefill_rag.gateway.responses import APIError

    error = call.renamed(APIError(400, "response_format.json_schema.schema.x is refused; see messages[2].tool_calls[1]"
                                  ".function.name", param="response_format"))
    assert error.param == "text.format"
    assert error.message == "text.format.schema.x is refused; see input[2].name"
