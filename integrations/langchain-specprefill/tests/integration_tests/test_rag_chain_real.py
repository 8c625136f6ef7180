"""The RAG runnable end to end: InMemoryVectorStore (MiniLM) → ChatSpecPrefill on SmolLM2-135M."""

from __future__ import annotations

import pytest
from langchain_core.documents import Document
from langchain_core.vectorstores import InMemoryVectorStore
from lc_helpers import smollm_engine
from specprefill_rag.tools.retrieval import demo_documents, demo_questions, split_passages

from langchain_specprefill import ChatSpecPrefill, MiniLMEmbeddings, create_specprefill_rag_chain

pytestmark = [pytest.mark.real_model, pytest.mark.full]  # the README block runs this face in `make test`

# SmolLM2-135M answers this demo question reliably; the fact appears in one document only.
QUESTION = next(q for q in demo_questions() if q.answer == "14 March 1991")


@pytest.fixture(scope="module")
def retriever():
    passages = split_passages(demo_documents())
    documents = [Document(p.text, id=p.id, metadata=dict(p.metadata)) for p in passages]
    store = InMemoryVectorStore(MiniLMEmbeddings())
    store.add_documents(documents)
    return store.as_retriever(search_kwargs={"k": 4})


@pytest.fixture(scope="module")
def chain(retriever):
    return create_specprefill_rag_chain(retriever, ChatSpecPrefill(engine=smollm_engine(), max_tokens=48))


def test_documents_arrive_as_passages_and_answer_is_grounded(chain):
    out = chain.invoke(QUESTION.question)
    ids = [d.id for d in out["documents"]]
    assert len(ids) == 4 and any(d.metadata["source"] == QUESTION.source for d in out["documents"])
    spans = out["kept_spans"]
    assert [s["id"] for s in spans if s["kind"] == "passage"] == ids  # one segment per document
    question = [s for s in spans if s["kind"] == "question"]
    assert len(question) == 1 and question[0]["keep_ratio"] == 1.0  # the question is protected
    meta = out["response_metadata"]
    assert meta["speculated"] and meta["keep_ratio"] < 0.9
    assert meta["prefilled_tokens"] < meta["prompt_tokens"]
    assert "1991" in out["answer"], out["answer"]


def test_stream_yields_answer_deltas(chain):
    parts = list(chain.stream({"question": QUESTION.question}))
    deltas = [p["answer"] for p in parts if p.get("answer")]
    assert len(deltas) > 1
    assert "1991" in "".join(deltas)
    assert any("kept_spans" in p for p in parts)


def test_cross_family_draft_by_name(retriever):
    # What a user writes: a Qwen main model scored by SmolLM2 (another tokenizer and template).
    llm = ChatSpecPrefill(
        model="qwen2.5-coder-0.5b-instruct", draft_model="smollm2-135m-instruct", keep_rate=0.3, max_tokens=24
    )
    out = create_specprefill_rag_chain(retriever, llm).invoke(QUESTION.question)
    assert llm.engine is not None and llm.engine.maps_tokens
    meta = out["response_metadata"]
    assert meta["speculated"] and meta["keep_ratio"] < 0.5
    question = [s for s in out["kept_spans"] if s["kind"] == "question"]
    assert question[0]["keep_ratio"] == 1.0
    assert "1991" in out["answer"], out["answer"]
