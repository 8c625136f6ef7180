"""ChatSpecPrefill on a tiny random engine: message mapping, metadata, streaming, async, errors."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import pytest
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, SystemMessage
from lc_helpers import tiny_cross_family_engine, tiny_engine
from specprefill_rag import BackendTimeoutError, InputTypeError, SegmentKind, SpecPrefillEngine, testing

import langchain_specprefill
from langchain_specprefill import ChatSpecPrefill, messages_to_segments

DOCS = [
    Document("The sky is blue. " * 20, id="sky"),
    Document("The passkey is 48213. " * 6, id="key"),
    Document("The sky is blue and the passkey is 48213. " * 10),
]


def test_public_api():
    expected = {"ChatSpecPrefill", "SpecPrefillCompressor", "create_specprefill_rag_chain"}
    assert set(langchain_specprefill.__all__) >= expected
    for name in langchain_specprefill.__all__:
        assert hasattr(langchain_specprefill, name)


def test_messages_map_to_segments():
    messages = [
        SystemMessage("Be brief."),
        HumanMessage("hello"),
        AIMessage("hi there"),
        HumanMessage("what is the passkey?"),
    ]
    segments = messages_to_segments(messages, DOCS)
    assert [(s.kind, s.id) for s in segments] == [
        (SegmentKind.INSTRUCTIONS, None),
        (SegmentKind.HISTORY, "turn-0"),
        (SegmentKind.HISTORY, "turn-1"),
        (SegmentKind.PASSAGE, "sky"),
        (SegmentKind.PASSAGE, "key"),
        (SegmentKind.PASSAGE, "3"),
        (SegmentKind.QUESTION, None),
    ]
    assert (segments[1].role, segments[1].text) == ("user", "hello")
    assert (segments[2].role, segments[2].text) == ("assistant", "hi there")
    assert segments[-1].text == "what is the passkey?"
    with pytest.raises(ValueError, match="no messages"):
        messages_to_segments([])
    with pytest.raises(ValueError, match="only system messages"):
        messages_to_segments([SystemMessage("x")])


def test_needs_engine_or_model():
    with pytest.raises(ValueError, match="engine=SpecPrefillEngine"):
        ChatSpecPrefill()
    assert ChatSpecPrefill(engine=tiny_engine()).model_name == "tiny-llama"


def test_invoke_with_passages_reports_spans_and_usage():
    llm = ChatSpecPrefill(engine=tiny_engine(), max_tokens=3)
    message = llm.invoke("what is the passkey?", passages=DOCS)
    meta = message.response_metadata
    assert meta["model_name"] == "tiny-llama" and meta["speculated"]
    assert 0 < meta["keep_ratio"] < 1 and meta["prefilled_tokens"] < meta["prompt_tokens"]
    spans = {s["kind"]: s for s in meta["kept_spans"]}
    assert spans["question"]["keep_ratio"] == 1.0
    assert [s["id"] for s in meta["kept_spans"] if s["kind"] == "passage"] == ["sky", "key", "3"]
    assert meta["timings"]["draft_s"] > 0 and meta["timings"]["ttft_s"] > 0
    usage = message.usage_metadata
    assert usage["input_tokens"] == meta["prompt_tokens"] and usage["output_tokens"] == 3
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_stream_matches_invoke_and_full_mode_is_baseline():
    llm = ChatSpecPrefill(engine=tiny_engine(), max_tokens=3)
    chunks = list(llm.stream("what is the passkey?", passages=DOCS))
    assert all(isinstance(c, AIMessageChunk) for c in chunks) and chunks[-1].chunk_position == "last"
    full = sum(chunks[1:], chunks[0])
    assert full.text == llm.invoke("what is the passkey?", passages=DOCS).text
    baseline = llm.invoke("what is the passkey?", passages=DOCS, mode="full")
    assert baseline.response_metadata["keep_ratio"] == 1.0
    assert not baseline.response_metadata["speculated"]


def test_cross_family_draft_scores_through_character_offsets():
    engine = tiny_cross_family_engine()
    assert engine.maps_tokens
    llm = ChatSpecPrefill(engine=engine, max_tokens=3)
    with testing.recording_score_maps() as mapped:
        message = llm.invoke("what is the passkey?", passages=DOCS)
        chunks = list(llm.stream("what is the passkey?", passages=DOCS))
    meta = message.response_metadata
    # The draft read its own rendering (another token count); its scores reached the main prompt
    # once: the stream repeats the request, so its scores come from the engine's memo.
    assert len(mapped) == 1 and not meta["draft_memo_hit"]
    assert mapped[0][1] == meta["prompt_tokens"] and mapped[0][0] != mapped[0][1]
    assert any(c.response_metadata.get("draft_memo_hit") for c in chunks)
    assert meta["speculated"] and meta["prefilled_tokens"] < meta["prompt_tokens"]
    spans = {s["kind"]: s for s in meta["kept_spans"]}
    assert spans["question"]["keep_ratio"] == 1.0
    assert sum(chunks[1:], chunks[0]).text == message.text


async def test_async_matches_sync_and_keeps_the_loop_free():
    llm = ChatSpecPrefill(engine=tiny_engine(), max_tokens=3)
    sync = llm.invoke("what is the passkey?", passages=DOCS)
    async with testing.counting_loop_ticks() as ticks:
        result = await llm.ainvoke("what is the passkey?", passages=DOCS)
        chunks = [c async for c in llm.astream("what is the passkey?", passages=DOCS)]
    assert result.text == sync.text == "".join(c.text for c in chunks)
    assert ticks.count > 3


def test_standard_params_reach_the_engine():
    llm = ChatSpecPrefill(engine=tiny_engine(), max_tokens=2, stop=["never"])
    assert llm.invoke("hello").usage_metadata["output_tokens"] <= 2
    assert llm.invoke("hello", max_tokens=1).usage_metadata["output_tokens"] == 1
    ls = llm._get_ls_params()
    assert ls["ls_max_tokens"] == 2 and ls["ls_stop"] == ["never"] and ls["ls_provider"] == "specprefill"
    with pytest.raises(ValueError, match="per-call model"):
        llm.invoke("hello", model="other")
    with pytest.raises(TypeError, match="unexpected arguments"):
        llm.invoke("hello", bogus=1)


def test_timeout_bounds_the_call():
    llm = ChatSpecPrefill(engine=tiny_engine(), max_tokens=4, timeout=1e-6)
    with pytest.raises(BackendTimeoutError, match="timeout=1e-06 s") as caught:
        llm.invoke("hello")
    assert isinstance(caught.value, TimeoutError)
    with pytest.raises(BackendTimeoutError):
        asyncio.run(llm.ainvoke("hello"))
    assert llm.invoke("hello", timeout=60.0).content is not None  # per call


def test_one_passage_and_wrong_passage_types():
    segments = messages_to_segments([HumanMessage("what?")], "The passkey is 48213.")
    assert [s.text for s in segments if s.kind is SegmentKind.PASSAGE] == ["The passkey is 48213."]
    assert len(messages_to_segments([HumanMessage("what?")], DOCS[0])) == 2
    with pytest.raises(InputTypeError, match="got dict"):
        messages_to_segments([HumanMessage("what?")], {"The passkey is 48213.": 1})
    with pytest.raises(InputTypeError, match="passage 1 must be a Document, Passage or str, got int"):
        messages_to_segments([HumanMessage("what?")], ["fine", 7])


def test_concurrent_first_calls_build_one_engine(monkeypatch):
    built = []

    def from_pretrained(main, draft, **kwargs):
        built.append(kwargs)
        time.sleep(0.2)  # loading takes a while: every thread arrives before it ends
        return tiny_engine()

    monkeypatch.setattr(SpecPrefillEngine, "from_pretrained", staticmethod(from_pretrained))
    llm = ChatSpecPrefill(model="some-model", draft_model="some-draft", max_tokens=1)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: llm.invoke("hello"), range(8)))
    assert len(built) == 1 and built[0] == {"backend": "transformers"}
    server = ChatSpecPrefill(model="m", backend="vllm_server", max_retries=5)
    server._get_engine()
    assert built[1] == {"backend": "vllm_server", "max_retries": 5}  # retries belong to the backend


def test_rag_chain_keeps_documents_as_passages():
    from langchain_core.runnables import RunnableLambda

    from langchain_specprefill import create_specprefill_rag_chain

    retriever = RunnableLambda(lambda question: DOCS)
    chain = create_specprefill_rag_chain(retriever, ChatSpecPrefill(engine=tiny_engine(), max_tokens=3))
    out = chain.invoke({"question": "what is the passkey?"})
    assert [d.id for d in out["documents"]] == ["sky", "key", "3"]
    assert [s["id"] for s in out["kept_spans"] if s["kind"] == "passage"] == ["sky", "key", "3"]
    assert out["response_metadata"]["speculated"] and isinstance(out["answer"], str)
    parts = list(chain.stream("what is the passkey?"))
    assert "".join(p.get("answer", "") for p in parts) == out["answer"]
    with pytest.raises(ValueError, match="takes a question"):
        chain.invoke({"q": "x"})
