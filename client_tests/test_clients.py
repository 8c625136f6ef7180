"""Unmodified OpenAI clients and both integrations, on current framework releases, against a
real vLLM server (SmolLM2-135M with our plugin).

- The environment: no vLLM, the framework versions pinned in requirements.txt.
- The ``openai`` client, LangChain ``ChatOpenAI`` and LlamaIndex ``OpenAILike`` pointed at the
  gateway: answers stream, pruning happened (the response's ``specprefill`` object, or the
  gateway's token counters for clients that drop unknown fields), and the greedy text equals the
  engine's ``vllm_server`` backend for the same prompt (the same plan).
- ``SpecPrefillLLM`` and ``ChatSpecPrefill`` on the ``vllm_server`` backend: the engine's answer.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from pathlib import Path

import pytest
from conftest import KEY, MAX_NEW_TOKENS, MESSAGES, PASSAGES, QUESTION
from servers import metric  # tests/servers.py (client_tests/conftest.py puts tests/ on the path)

from specprefill_rag.gateway.messages import to_segments

pytestmark = [pytest.mark.full, pytest.mark.timeout(1200)]
URL = "http://127.0.0.1:{}/v1"



def expected(engine, messages: list[dict]) -> object:
    """The engine's answer to the prompt the gateway derives from ``messages``."""
    segments, _ = to_segments([(m["role"], m["content"]) for m in messages])
    return engine.generate(list(segments))


def tokens(gateway) -> dict[str, float]:
    text = gateway.metrics()
    return {k: metric(text, "specprefill_gateway_tokens_total", kind=k) for k in ("prompt", "prefilled")}


def test_the_client_environment_has_no_vllm_and_current_frameworks():
    assert importlib.util.find_spec("vllm") is None
    pins = dict(re.findall(r"^([\w-]+)==([\w.]+)", (Path(__file__).parent / "requirements.txt").read_text(), re.M))
    for dist in ("llama-index-core", "langchain-core", "langchain-openai", "llama-index-llms-openai-like"):
        assert importlib.metadata.version(dist) == pins[dist], dist
    assert pins["llama-index-core"].startswith("0.14.")


def test_openai_client_streams_a_pruned_answer(gateway, engine):
    want = expected(engine, MESSAGES)
    assert want.plan.speculated and want.text
    client = gateway.client(api_key=KEY, timeout=300)
    chunks = list(client.chat.completions.create(model="x", messages=MESSAGES, stream=True, temperature=0))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    answer = client.chat.completions.create(model="x", messages=MESSAGES, temperature=0)
    assert answer.choices[0].message.content == want.text
    ext = answer.model_extra["specprefill"]
    assert ext["prompt_shape"] == "langchain_rag_system" and ext["speculated"] is True
    assert ext["prefilled_tokens"] == want.prefilled_tokens < ext["prompt_tokens"] == want.prompt_tokens
    # "\n\n"-joined documents are split at every blank line (the passages' own paragraphs too)
    assert [s["kind"] for s in ext["kept_spans"]] == [str(s.kind) for s in want.kept_spans]
    assert [s["kind"] for s in ext["kept_spans"]].count("passage") >= len(PASSAGES)


def test_langchain_chat_openai_unmodified(gateway, engine):
    ChatOpenAI = pytest.importorskip("langchain_openai").ChatOpenAI

    want = expected(engine, MESSAGES)
    llm = ChatOpenAI(base_url=URL.format(gateway.port), api_key=KEY, model="x", temperature=0, max_retries=0,
                     timeout=300)
    before = tokens(gateway)
    streamed = "".join(chunk.text for chunk in llm.stream([(m["role"], m["content"]) for m in MESSAGES]))
    after = tokens(gateway)
    assert streamed == want.text
    assert after["prompt"] - before["prompt"] == want.prompt_tokens
    assert after["prefilled"] - before["prefilled"] == want.prefilled_tokens < want.prompt_tokens
    assert llm.invoke([(m["role"], m["content"]) for m in MESSAGES]).content == want.text


def test_the_responses_api_through_the_gateway(gateway, engine):
    """``client.responses.create`` (streamed and not) and ``ChatOpenAI(use_responses_api=True)``:
    the same messages as input items give the chat answer, pruned alike."""
    ChatOpenAI = pytest.importorskip("langchain_openai").ChatOpenAI

    want = expected(engine, MESSAGES)
    client = gateway.client(api_key=KEY, timeout=300)
    answer = client.responses.create(model="x", input=MESSAGES, temperature=0)
    assert answer.status in ("completed", "incomplete") and answer.output_text == want.text
    ext = answer.model_extra["specprefill"]
    assert ext["speculated"] is True and ext["prefilled_tokens"] == want.prefilled_tokens
    events = list(client.responses.create(model="x", input=MESSAGES, temperature=0, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want.text
    assert events[-1].response.output_text == want.text
    llm = ChatOpenAI(base_url=URL.format(gateway.port), api_key=KEY, model="x", temperature=0, max_retries=0,
                     timeout=300, use_responses_api=True)
    assert llm.invoke([(m["role"], m["content"]) for m in MESSAGES]).text == want.text
    assert "".join(c.text for c in llm.stream([(m["role"], m["content"]) for m in MESSAGES])) == want.text


def test_llamaindex_openai_like_unmodified(gateway, engine):
    OpenAILike = pytest.importorskip("llama_index.llms.openai_like").OpenAILike
    CHAT_TEXT_QA_PROMPT = pytest.importorskip("llama_index.core.prompts.chat_prompts").CHAT_TEXT_QA_PROMPT

    chat = CHAT_TEXT_QA_PROMPT.format_messages(context_str="\n\n".join(PASSAGES), query_str=QUESTION.question)
    messages = [{"role": m.role.value, "content": m.content} for m in chat]
    want = expected(engine, messages)
    llm = OpenAILike(api_base=URL.format(gateway.port), api_key=KEY, model="x", is_chat_model=True, temperature=0,
                     max_tokens=MAX_NEW_TOKENS, max_retries=0, timeout=300)
    before = tokens(gateway)
    streamed = "".join(r.delta or "" for r in llm.stream_chat(chat))
    after = tokens(gateway)
    assert streamed == want.text
    assert after["prefilled"] - before["prefilled"] == want.prefilled_tokens < want.prompt_tokens


def test_integrations_on_the_vllm_server_backend(engine):
    from langchain_core.messages import HumanMessage
    from langchain_specprefill import ChatSpecPrefill
    from langchain_specprefill.chat_models import messages_to_segments
    from llama_index.llms.specprefill import SpecPrefillLLM

    segments = messages_to_segments([HumanMessage(QUESTION.question)], PASSAGES,
                                    default_instructions=engine.config.instructions)
    want = engine.generate(segments)
    assert want.plan.speculated
    chat = ChatSpecPrefill(engine=engine)
    message = chat.invoke(QUESTION.question, passages=PASSAGES)
    assert message.content == want.text
    assert message.response_metadata["prefilled_tokens"] == want.prefilled_tokens < want.prompt_tokens
    assert "".join(chunk.text for chunk in chat.stream(QUESTION.question, passages=PASSAGES)) == want.text

    llm = SpecPrefillLLM(engine=engine)
    prompt = (f"Context information is below.\n{'-' * 10}\n" + "\n\n".join(PASSAGES) + f"\n{'-' * 10}\n"
              f"Query: {QUESTION.question}\nAnswer: ")
    answer = llm.complete(prompt)
    assert answer.additional_kwargs["speculated"] and answer.text
    assert answer.additional_kwargs["prefilled_tokens"] < answer.additional_kwargs["prompt_tokens"]
    assert "".join(r.delta for r in llm.stream_complete(prompt)) == answer.text


# -- tools and structured output through the gateway (issue 50) -------------------------------------


@pytest.fixture(scope="module")
def tool_gateway():
    """The gateway over the tiny engine whose chat template renders tools (its random model decodes
    under the grammar), served by uvicorn in a thread on a loopback port."""
    from servers import app_in_thread

    from specprefill_rag.gateway import create_app
    from specprefill_rag.testing import tiny_engine

    with app_in_thread(create_app(tiny_engine(tools=True))) as port:
        yield URL.format(port)


def test_chat_openai_tools_and_structured_output_through_the_gateway(tool_gateway):
    """Calls and JSON answers the unmodified ChatOpenAI parses: a forced single call (invoke and
    stream), structured output by function calling and by a JSON schema (response_format)."""
    from typing import Literal

    from pydantic import BaseModel

    ChatOpenAI = pytest.importorskip("langchain_openai").ChatOpenAI

    class Verdict(BaseModel):
        """A yes/no verdict."""

        answer: Literal["yes", "no"]
        sure: bool

    llm = ChatOpenAI(base_url=tool_gateway, api_key=KEY, model="x", temperature=0, max_tokens=200, max_retries=0,
                     timeout=120)
    forced = llm.bind_tools([Verdict], tool_choice="Verdict", parallel_tool_calls=False)
    message = forced.invoke("Is the sky blue?")
    (call,) = message.tool_calls
    assert call["name"] == "Verdict" and Verdict(**call["args"])
    streamed = None
    for chunk in forced.stream("Is the sky blue?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(call["name"], call["args"])]
    for method in ("function_calling", "json_schema"):
        verdict = llm.with_structured_output(Verdict, method=method).invoke("Is the sky blue?")
        assert isinstance(verdict, Verdict), method
