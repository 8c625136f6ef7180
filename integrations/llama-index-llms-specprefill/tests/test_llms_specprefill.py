"""SpecPrefillLLM on a tiny random engine: segments, metadata, streaming, async, query engines."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import pytest
from li_helpers import tiny_cross_family_engine, tiny_engine
from llama_index.core import Document, MockEmbedding, VectorStoreIndex
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.prompts import PromptTemplate
from llama_index.core.schema import NodeWithScore
from specprefill_rag import BackendTimeoutError, SpecPrefillEngine, testing

import llama_index.llms.specprefill as package
from llama_index.llms.specprefill import PassageIdPostprocessor, SpecPrefillLLM, split_context

QA = PromptTemplate("Context:\n{context_str}\nQuery: {query_str}\nAnswer: ")
CONTEXT = "The sky is blue. " * 20 + "\n\n" + "The passkey is 48213. " * 8


def test_public_api():
    assert package.__all__ == ["DocumentsTool", "MiniLMEmbedding", "PassageIdPostprocessor", "SpecPrefillLLM",
                               "SpecPrefillPassageReader", "messages_to_segments", "split_context",
                               "tool_result_message"]
    assert issubclass(SpecPrefillLLM, FunctionCallingLLM)


def test_split_context_rules():
    marked = "passage_id: a\nsource: x.md\n\nFirst.\n\nStill first.\n\npassage_id: b\n\nSecond."
    assert [(p.id, p.text) for p in split_context(marked)] == [
        ("a", "source: x.md\n\nFirst.\n\nStill first."),
        ("b", "Second."),
    ]
    assert [(p.id, p.text) for p in split_context("One.\n\n\nTwo.\n  \nThree.")] == [
        (None, "One."),
        (None, "Two."),
        (None, "Three."),
    ]


def test_metadata_comes_from_the_engine():
    llm = SpecPrefillLLM(engine=tiny_engine(), max_new_tokens=3)
    meta = llm.metadata
    assert meta.model_name == "tiny-llama" and meta.context_window == 4096 and meta.num_output == 3
    with pytest.raises(ValueError, match="engine=SpecPrefillEngine"):
        SpecPrefillLLM()


def test_complete_sends_one_prunable_context(recorder):
    llm = SpecPrefillLLM(engine=tiny_engine())
    response = llm.complete(CONTEXT)
    kw = response.additional_kwargs
    assert [s["kind"] for s in kw["kept_spans"]] == ["context"]
    assert kw["speculated"] and kw["prefilled_tokens"] < kw["prompt_tokens"]
    assert kw["timings"]["draft_s"] > 0 and kw["model_name"] == "tiny-llama"
    assert recorder.responses[-1].additional_kwargs == kw  # instrumentation sees the metadata
    deltas = list(llm.stream_complete(CONTEXT))
    assert "".join(d.delta for d in deltas) == response.text == deltas[-1].text
    assert deltas[-1].additional_kwargs["kept_spans"] == kw["kept_spans"]


def test_predict_with_context_and_query_protects_the_question(recorder):
    llm = SpecPrefillLLM(engine=tiny_engine())
    text = llm.predict(QA.partial_format(query_str="what is the passkey?"), context_str=CONTEXT)
    kw = recorder.responses[-1].additional_kwargs
    spans = kw["kept_spans"]
    assert [(s["kind"], s["id"]) for s in spans] == [
        ("instructions", None), ("passage", "1"), ("passage", "2"), ("question", None),
    ]
    assert spans[-1]["keep_ratio"] == 1.0 and spans[0]["keep_ratio"] == 1.0
    assert kw["keep_ratio"] < 1.0
    assert "".join(llm.stream(QA, context_str=CONTEXT, query_str="what is the passkey?")) == text
    # A template without both slots is sent whole, as one context segment.
    llm.predict(PromptTemplate("Summarise: {text}"), text=CONTEXT)
    assert [s["kind"] for s in recorder.responses[-1].additional_kwargs["kept_spans"]] == ["context"]


def test_cross_family_draft_scores_through_character_offsets(recorder):
    engine = tiny_cross_family_engine()
    assert engine.maps_tokens
    llm = SpecPrefillLLM(engine=engine)
    with testing.recording_score_maps() as mapped:
        text = llm.predict(QA.partial_format(query_str="what is the passkey?"), context_str=CONTEXT)
    kw = recorder.responses[-1].additional_kwargs
    # The draft read its own rendering (another token count); its scores reached the main prompt.
    assert len(mapped) == 1 and mapped[0][1] == kw["prompt_tokens"] and mapped[0][0] != mapped[0][1]
    assert kw["speculated"] and kw["prefilled_tokens"] < kw["prompt_tokens"]
    spans = kw["kept_spans"]
    assert [s["kind"] for s in spans] == ["instructions", "passage", "passage", "question"]
    assert spans[-1]["keep_ratio"] == 1.0
    assert "".join(llm.stream(QA, context_str=CONTEXT, query_str="what is the passkey?")) == text
    assert recorder.responses[-1].additional_kwargs["kept_spans"] == spans


def test_chat_maps_roles():
    llm = SpecPrefillLLM(engine=tiny_engine())
    messages = [
        ChatMessage(role=MessageRole.SYSTEM, content="Be brief."),
        ChatMessage(role=MessageRole.USER, content="hello"),
        ChatMessage(role=MessageRole.ASSISTANT, content="hi"),
        ChatMessage(role=MessageRole.USER, content="what is the passkey?"),
    ]
    response = llm.chat(messages)
    assert [(s["kind"], s["id"]) for s in response.additional_kwargs["kept_spans"]] == [
        ("instructions", None), ("history", "turn-0"), ("history", "turn-1"), ("question", None),
    ]
    chunks = list(llm.stream_chat(messages))
    assert chunks[-1].message.content == response.message.content


async def test_async_variants_match_and_do_not_block():
    llm = SpecPrefillLLM(engine=tiny_engine())
    sync = llm.complete(CONTEXT).text
    messages = [ChatMessage(role=MessageRole.USER, content=CONTEXT)]
    async with testing.counting_loop_ticks() as ticks:
        assert (await llm.acomplete(CONTEXT)).text == sync
        assert "".join([r.delta async for r in await llm.astream_complete(CONTEXT)]) == sync
        chat = await llm.achat(messages)
        streamed = [r async for r in await llm.astream_chat(messages)]
        answer = await llm.apredict(QA, context_str=CONTEXT, query_str="what is the passkey?")
        tokens = [t async for t in await llm.astream(QA, context_str=CONTEXT, query_str="what is the passkey?")]
    assert streamed[-1].message.content == chat.message.content
    assert "".join(tokens) == answer
    assert ticks.count > 5


@pytest.mark.parametrize("marked", [True, False])
def test_query_engine_passages_are_nodes(recorder, marked):
    docs = [Document(text="The sky is blue. " * 30), Document(text="The passkey is 48213. " * 20)]
    index = VectorStoreIndex.from_documents(docs, embed_model=MockEmbedding(embed_dim=8))
    llm = SpecPrefillLLM(engine=tiny_engine())
    post = [PassageIdPostprocessor()] if marked else []
    response = index.as_query_engine(llm=llm, similarity_top_k=2, node_postprocessors=post).query("passkey?")
    spans = recorder.responses[-1].additional_kwargs["kept_spans"]
    passage_ids = [s["id"] for s in spans if s["kind"] == "passage"]
    node_ids = [n.node.node_id for n in response.source_nodes]
    assert passage_ids == (node_ids if marked else ["1", "2"])
    assert spans[-1]["kind"] == "question" and spans[-1]["keep_ratio"] == 1.0


def test_timeout_bounds_the_call():
    llm = SpecPrefillLLM(engine=tiny_engine(), max_new_tokens=4, timeout=1e-6)
    with pytest.raises(BackendTimeoutError, match="timeout=1e-06 s"):
        llm.complete("hello there")
    with pytest.raises(TimeoutError):
        asyncio.run(llm.acomplete("hello there"))
    assert llm.complete("hello there", timeout=60.0).text is not None


def test_concurrent_first_calls_build_one_engine(monkeypatch):
    built = []

    def from_pretrained(main, draft, **kwargs):
        built.append(kwargs)
        time.sleep(0.2)  # every thread arrives while the first one loads
        return tiny_engine()

    monkeypatch.setattr(SpecPrefillEngine, "from_pretrained", staticmethod(from_pretrained))
    llm = SpecPrefillLLM(model_name="some-model", draft_model="some-draft", max_new_tokens=1)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: llm.complete("hello there"), range(8)))
    assert built == [{"backend": "transformers"}]
    SpecPrefillLLM(model_name="m", backend="vllm_server", max_retries=5).engine  # noqa: B018
    assert built[1] == {"backend": "vllm_server", "max_retries": 5}  # retries belong to the backend


def test_retriever_scores_reach_the_passages_but_not_the_model():
    from llama_index.core.schema import MetadataMode, TextNode

    nodes = [NodeWithScore(node=TextNode(text="The sky is blue.", id_="a"), score=0.91),
             NodeWithScore(node=TextNode(text="The passkey is 48213.", id_="b"), score=None)]
    marked = PassageIdPostprocessor().postprocess_nodes(nodes)
    context = "\n\n".join(n.node.get_content(metadata_mode=MetadataMode.LLM) for n in marked)
    passages = split_context(context)
    assert [(p.id, p.text, dict(p.metadata)) for p in passages] == [
        ("a", "The sky is blue.", {"score": 0.91}),
        ("b", "The passkey is 48213.", {}),
    ]
    assert "passage_score" in context and all("passage_score" not in p.text for p in passages)
    assert PassageIdPostprocessor(score_key=None).postprocess_nodes(nodes)[0].node.metadata == {"passage_id": "a"}
