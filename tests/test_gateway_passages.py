"""The gateway and passages read apart: ``POST /v1/passages`` warms the draft's passage store in a
request's namespace, each answer's ``specprefill`` object says what the store served, and
``/metrics`` shows the store's hits, misses, disk hits and bytes.

In process (Starlette's TestClient) over the tiny engine with a draft of its own deep enough to
read passages apart (``testing.tiny_engine(draft_layers=8)``), its score memo off so that every
request reaches the store. What must hold: a warm call is namespaced exactly as a chat request of
the same tenant and salt (the same HMAC under the gateway's secret); a warmed passage serves the
requests whose system part equals the warm call's ``instructions`` (the recognised RAG shapes'
instruction sentences included), and no other; the body is capped as other bodies are."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

from fastapi.testclient import TestClient  # noqa: E402

from specprefill_rag import (  # noqa: E402
    DraftConfig,
    GenerationConfig,
    PassageReading,
    SelectionConfig,
    SpecPrefillConfig,
    SpecPrefillEngine,
)
from specprefill_rag.gateway import create_app  # noqa: E402
from specprefill_rag.gateway.admission import cache_namespace  # noqa: E402
from specprefill_rag.gateway.messages import MAX_PARTS  # noqa: E402
from specprefill_rag.testing import tiny_engine  # noqa: E402

SECRET = b"a test secret, 32 bytes long...."
KEYS = {"key-a": "alpha", "key-b": "beta"}
INSTRUCTIONS = "Answer from the station handbook only."
PASSAGES = [f"Hut {i} stands {100 + i} metres above the fjord and sleeps {i + 2} people." for i in range(6)]
QUESTION = "Which hut sleeps five people?"
LLAMAINDEX_QA = "Given the context information and not prior knowledge, answer the query."
LANGCHAIN_RAG = ("You are an assistant for question-answering tasks. Use the following pieces of retrieved context "
                 "to answer the question. If you don't know the answer, say that you don't know. Use three "
                 "sentences maximum and keep the answer concise.")


def reading_engine(store_dir: Path | None = None, *, passages: bool = True, layers: int | None = 8
                   ) -> SpecPrefillEngine:
    draft = DraftConfig(lookahead=2, memo_entries=0, passages=PassageReading() if passages else None,
                        passage_store_dir=None if store_dir is None else str(store_dir))
    config = SpecPrefillConfig(draft=draft, selection=SelectionConfig(keep_rate=0.3, min_prompt_tokens=32,
                                                                      chunk_size=8),
                               generation=GenerationConfig(max_new_tokens=2))
    return tiny_engine(config, draft_layers=layers)


@pytest.fixture
def engine() -> SpecPrefillEngine:
    return reading_engine()


def serve(engine: SpecPrefillEngine, **options: Any) -> TestClient:
    return TestClient(create_app(engine, api_keys=KEYS, cache_secret=SECRET, **options),
                      raise_server_exceptions=False)


@pytest.fixture
def client(engine: SpecPrefillEngine) -> Iterator[TestClient]:
    with serve(engine) as test_client:
        assert test_client.get("/ready").status_code == 200  # the warm-up is done: it reads a passage too
        yield test_client


def headers(key: str = "key-a") -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}


def warm(client: TestClient, body: dict[str, Any], key: str = "key-a") -> tuple[int, dict[str, Any]]:
    response = client.post("/v1/passages", content=json.dumps(body), headers=headers(key))
    return response.status_code, response.json()


def ask(client: TestClient, messages: list[dict[str, str]], key: str = "key-a", **fields: Any) -> dict[str, Any]:
    body = {"model": "m", "max_tokens": 2, "messages": messages, **fields}
    response = client.post("/v1/chat/completions", content=json.dumps(body), headers=headers(key))
    assert response.status_code == 200, response.text
    return response.json()["specprefill"]


def asker(client: TestClient):
    """``rag(system, key, **fields)``: (passages_cached, passages_read) of a chat question over
    ``PASSAGES`` given as ``specprefill.passages``, after a system message ``system`` (None: none)."""

    def rag(system: str | None = INSTRUCTIONS, key: str = "key-a", **fields: Any) -> tuple[int, int]:
        messages = ([{"role": "system", "content": system}] if system is not None else []) + [
            {"role": "user", "content": QUESTION}]
        facts = ask(client, messages, key, specprefill={"passages": PASSAGES}, **fields)
        return facts["passages_cached"], facts["passages_read"]

    return rag


def samples(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = client.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in prometheus_parser.text_string_to_metric_families(text) for s in family.samples}


def store_metric(client: TestClient, name: str, **labels: str) -> float:
    return samples(client).get((f"specprefill_gateway_passage_store_{name}", tuple(sorted(labels.items()))), 0.0)


# -- warming --------------------------------------------------------------------------------------


def test_a_warm_call_serves_the_chat_requests_of_its_namespace(client, engine):
    n = len(PASSAGES)
    ask_rag = asker(client)
    assert warm(client, {"passages": PASSAGES, "instructions": INSTRUCTIONS}) == (200, {"found": 0, "read": n})
    assert warm(client, {"passages": PASSAGES[:2], "instructions": INSTRUCTIONS}) == (200, {"found": 2, "read": 0})
    assert ask_rag() == (n, 0)  # the draft read none of them again
    assert ask_rag(key="key-b") == (0, n)  # another tenant: another namespace
    assert ask_rag(cache_salt="s1") == (0, n)  # a salt narrows the tenant's namespace
    assert warm(client, {"passages": PASSAGES, "instructions": INSTRUCTIONS, "cache_salt": "s1"}) == (
        200, {"found": n, "read": 0})  # what that request read, under the same derivation
    # The namespace is the chat request's: the HMAC of the tenant and the salt under the gateway's secret.
    assert engine.read_passages(PASSAGES, instructions=INSTRUCTIONS,
                                cache_salt=cache_namespace(SECRET, "alpha", None)) == (n, 0)
    assert engine.read_passages(PASSAGES, instructions=INSTRUCTIONS, cache_salt=None) == (0, n)  # no namespace


def test_a_warmed_passage_serves_only_the_same_system_part(client):
    n = len(PASSAGES)
    ask_rag = asker(client)
    assert warm(client, {"passages": [{"text": p, "id": f"hut-{i}"} for i, p in enumerate(PASSAGES)]})[1] == {
        "found": 0, "read": n}  # no instructions: requests without a system message
    assert ask_rag(system=INSTRUCTIONS) == (0, n)
    assert ask_rag(system=None) == (n, 0)
    # Stripped, as the gateway strips it: the prompt two lines up, which the prefix store holds whole.
    assert ask_rag(system=f"  {INSTRUCTIONS}\n") == (0, 0)
    # A chat with earlier turns reads its passages after the same system part: the passages read under
    # these instructions (by the request above; a warm call finds them all) serve it.
    assert warm(client, {"passages": PASSAGES, "instructions": INSTRUCTIONS})[1] == {"found": n, "read": 0}
    history = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Hello?"},
               {"role": "assistant", "content": "Hi."}, {"role": "user", "content": QUESTION}]
    first = ask(client, history, specprefill={"passages": PASSAGES})
    assert (first["passages_cached"], first["passages_read"]) == (n, 0)
    # The same conversation and passages under another question: the prefix store holds it all.
    again = ask(client, history[:3] + [{"role": "user", "content": "And which sleeps six?"}],
                specprefill={"passages": PASSAGES})
    assert (again["passages_cached"], again["passages_read"]) == (0, 0) and again["draft_cached_tokens"] > 0
    # Its next turn (the last exchange now history, the passages after it): the passage store serves them.
    later = ask(client, [*history, {"role": "assistant", "content": "The hut."},
                         {"role": "user", "content": "And which sleeps six?"}], specprefill={"passages": PASSAGES})
    assert (later["passages_cached"], later["passages_read"]) == (n, 0)


def test_recognised_rag_shapes_match_their_instruction_sentences(client):
    """LlamaIndex's default QA prompt and LangChain's RAG system prompt: their documents become
    passages, their instruction sentence the system part a warm call names."""
    n = len(PASSAGES)
    context = "\n\n".join(PASSAGES)
    assert warm(client, {"passages": PASSAGES, "instructions": LLAMAINDEX_QA})[1] == {"found": 0, "read": n}
    user = (f"Context information is below.\n---------------------\n{context}\n---------------------\n"
            f"{LLAMAINDEX_QA}\nQuery: {QUESTION}\nAnswer: ")
    facts = ask(client, [{"role": "user", "content": user}])
    assert facts["prompt_shape"] == "llamaindex_qa" and (facts["passages_cached"], facts["passages_read"]) == (n, 0)
    assert warm(client, {"passages": PASSAGES, "instructions": LANGCHAIN_RAG})[1] == {"found": 0, "read": n}
    facts = ask(client, [{"role": "system", "content": f"{LANGCHAIN_RAG}\n\n{context}"},
                         {"role": "user", "content": QUESTION}])
    assert facts["prompt_shape"] == "langchain_rag_system"
    assert (facts["passages_cached"], facts["passages_read"]) == (n, 0)


def test_every_answer_says_what_the_store_served(client):
    n = len(PASSAGES)
    assert warm(client, {"passages": PASSAGES})[0] == 200
    body = {"model": "m", "max_tokens": 2, "prompt": QUESTION, "specprefill": {"passages": PASSAGES}}
    completion = client.post("/v1/completions", content=json.dumps(body), headers=headers()).json()
    assert (completion["specprefill"]["passages_cached"], completion["specprefill"]["passages_read"]) == (n, 0)
    body = {"model": "m", "max_tokens": 2, "stream": True, "messages": [{"role": "user", "content": QUESTION}],
            "specprefill": {"passages": PASSAGES[::-1]}}  # another order: the same readings
    events = client.post("/v1/chat/completions", content=json.dumps(body), headers=headers()).text.split("\n\n")
    last = [json.loads(e.removeprefix("data: ")) for e in events if e.startswith("data: {")][-1]
    assert (last["specprefill"]["passages_cached"], last["specprefill"]["passages_read"]) == (n, 0)
    assert client.get("/health").json()["read_passages"] == "apart"


# -- metrics --------------------------------------------------------------------------------------


def test_metrics_show_the_store(client, engine):
    n = len(PASSAGES)
    before = {name: store_metric(client, f"{name}_total") for name in ("hits", "misses", "disk_hits")}
    held = store_metric(client, "passages")  # the warm-up's passage
    assert warm(client, {"passages": PASSAGES})[0] == 200
    asker(client)(system=None)
    after = {name: store_metric(client, f"{name}_total") for name in ("hits", "misses", "disk_hits")}
    assert after["misses"] - before["misses"] == n and after["hits"] - before["hits"] == n
    assert after["disk_hits"] == 0  # no disk tier
    assert store_metric(client, "passages") == held + n == len(engine.draft.passages)
    assert store_metric(client, "bytes", tier="memory") == engine.draft.passages.nbytes > 0
    assert store_metric(client, "bytes", tier="disk") == 0
    requests = samples(client)
    assert requests[("specprefill_gateway_requests_total",
                     (("endpoint", "passages"), ("mode", "none"), ("status", "200")))] == 1


def test_the_disk_tier_warms_a_gateway_that_starts_later(tmp_path):
    n = len(PASSAGES)
    with serve(reading_engine(tmp_path)) as first:
        assert first.get("/ready").status_code == 200  # the warm-up (which reads a passage too) is done
        assert warm(first, {"passages": PASSAGES})[1] == {"found": 0, "read": n}
        on_disk = store_metric(first, "bytes", tier="disk")
        assert on_disk > 0
    with serve(reading_engine(tmp_path)) as second:  # the same secret and draft: the same keys
        assert asker(second)(system=None) == (n, 0)
        # The passages, and the warm-up's own passage, which the first gateway's warm-up wrote.
        assert store_metric(second, "disk_hits_total") == n + 1
        assert store_metric(second, "bytes", tier="disk") == on_disk  # nothing new written


# -- refusals -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "param", "says"), [
    ({}, "passages", "passages must be a non-empty list"),
    ({"passages": []}, "passages", "passages must be a non-empty list"),
    ({"passages": "one text"}, "passages", "passages must be a non-empty list"),
    ({"passages": [7]}, "passages[0]", "must be a string or an object"),
    ({"passages": [{"text": "a", "id": [1]}]}, "passages[0].id", "must be a string"),
    ({"passages": ["a"], "instructions": 3}, "instructions", "instructions must be a string"),
    ({"passages": ["a"], "cache_salt": ""}, "cache_salt", "cache_salt must be a non-empty string"),
    ({"passages": ["a"], "questions": "?"}, "questions", "unknown field"),
    ({"passages": ["\ud800"]}, "passages[0]", "lone surrogate"),
    ({"passages": ["x"] * (MAX_PARTS + 1)}, "passages", f"more than the gateway's limit of {MAX_PARTS}"),
    ({"passages": ["   "]}, None, "the context is empty"),
])
def test_a_bad_body_is_400_naming_the_field(client, body, param, says):
    status, answer = warm(client, body)
    assert status == 400 and says in answer["error"]["message"] and answer["error"]["param"] == param


def test_bodies_are_admitted_as_others_are(engine):
    with serve(engine, max_body_bytes=1000) as client:
        assert warm(client, {"passages": ["x" * 2000]})[0] == 413
        assert warm(client, {"passages": PASSAGES}, key="nope")[0] == 401
        response = client.post("/v1/passages", content=b"[1, 2", headers=headers())
        assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
        assert client.post("/v1/passages", content=b"{}", headers={**headers(), "Content-Type": "text/plain"}
                           ).status_code == 415
        counted = samples(client)
    assert counted[("specprefill_gateway_requests_total",
                    (("endpoint", "passages"), ("mode", "none"), ("status", "413")))] == 1


@pytest.mark.parametrize(("build", "says"), [
    (lambda: reading_engine(passages=False), "--read-passages apart"),  # joint reading: nothing kept
    (lambda: reading_engine(layers=None), "cannot read passages apart"),  # 2 layers: no early exit below the top
    (lambda: SpecPrefillEngine(tiny_engine().backend), "no draft model"),
])
def test_a_gateway_that_keeps_no_readings_says_so(build, says):
    with TestClient(create_app(build(), default_mode="full"), raise_server_exceptions=False) as client:
        response = client.post("/v1/passages", content=json.dumps({"passages": PASSAGES}))
        assert response.status_code == 400 and says in response.json()["error"]["message"]


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_no_generated_warm_call_is_a_server_error(client, mode):
    """Schemathesis, from the route's own schema (``openapi.PASSAGES_REQUEST``): a 200 or a 4xx
    with OpenAI's error body, never a 500."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings

    operation = schemathesis.openapi.from_dict(client.app.openapi())["/v1/passages"]["POST"]

    @given(case=operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode)))
    @settings(max_examples=15, deadline=None, phases=[Phase.generate], database=None,
              suppress_health_check=list(HealthCheck))
    def fuzz(case: Any) -> None:
        request = case.as_transport_kwargs(base_url="http://testserver")
        body = json.dumps(request["json"]) if "json" in request else request.get("data", request.get("content"))
        response = client.request("POST", request["url"], content=body,
                                  headers={**headers(), **(request.get("headers") or {})})
        assert response.status_code == 200 or 400 <= response.status_code < 500, response.text[:300]
        if response.status_code == 200:
            assert set(response.json()) == {"found", "read"}
        else:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}

    fuzz()
