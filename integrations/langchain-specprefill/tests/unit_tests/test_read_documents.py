"""``ChatSpecPrefill.read_documents``: documents read into the draft's passage store beside
``add_documents``, then found by the calls that send them as passages (``create_specprefill_rag_chain``,
``invoke(..., passages=...)``), in the same system part and namespace only. Tiny random engine
whose 8-layer draft reads passages apart."""

from __future__ import annotations

import dataclasses

import pytest
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.runnables import RunnableLambda
from lc_helpers import QUESTION, corpus_documents, tiny_engine, tiny_reading_engine
from specprefill_rag import ConfigError, PassagesRead, SpecPrefillEngine

from langchain_specprefill import ChatSpecPrefill, create_specprefill_rag_chain

INSTRUCTIONS = "Answer from the corpus only."


def served(metadata: dict) -> tuple[int, int]:
    return metadata["passages_cached"], metadata["passages_read"]


def test_read_documents_serves_the_rag_chain():
    docs = corpus_documents()
    n = len(docs)
    llm = ChatSpecPrefill(engine=tiny_reading_engine(), max_tokens=2)
    assert llm.read_documents(docs) == PassagesRead(0, n)
    assert llm.read_documents(docs[:2]) == PassagesRead(2, 0)
    retriever = RunnableLambda(lambda question: docs)
    out = create_specprefill_rag_chain(retriever, llm).invoke(QUESTION)
    assert served(out["response_metadata"]) == (n, 0)  # the draft read none of them again
    # The chain's own system message is another system part: read anew there, found by a warm call of it.
    out = create_specprefill_rag_chain(retriever, llm, instructions=INSTRUCTIONS).invoke(QUESTION)
    assert served(out["response_metadata"]) == (0, n)
    assert llm.read_documents(docs, instructions=INSTRUCTIONS) == PassagesRead(n, 0)
    message = llm.invoke([SystemMessage(INSTRUCTIONS), HumanMessage(QUESTION)], passages=docs[::-1])
    assert served(message.response_metadata) == (n, 0)  # another order, the same readings


def test_a_models_own_instructions_and_a_salted_engine():
    """Without a system message the model's ``instructions`` are the system part; an engine's default
    ``cache_salt`` is the namespace of every call, so reading ahead uses it too."""
    docs = corpus_documents()
    inner = tiny_reading_engine()
    config = dataclasses.replace(inner.config, generation=inner.config.generation.with_overrides(cache_salt="t-a"))
    engine = SpecPrefillEngine(inner.backend, inner.draft, config)
    llm = ChatSpecPrefill(engine=engine, instructions=INSTRUCTIONS, max_tokens=2)
    assert llm.read_documents(docs[0]) == PassagesRead(0, 1)  # one Document alone is one passage
    assert llm.read_documents(docs) == PassagesRead(1, len(docs) - 1)
    assert served(llm.invoke(QUESTION, passages=docs).response_metadata) == (len(docs), 0)
    texts = [d.page_content for d in docs]
    assert engine.read_passages(texts, instructions=INSTRUCTIONS, cache_salt="t-a") == (len(docs), 0)
    assert engine.read_passages(texts, instructions=INSTRUCTIONS) == (0, len(docs))  # no salt: another namespace


async def test_aread_documents_reads_in_a_thread():
    docs = corpus_documents()
    llm = ChatSpecPrefill(engine=tiny_reading_engine(), max_tokens=2)
    assert await llm.aread_documents(docs) == PassagesRead(0, len(docs))
    assert served((await llm.ainvoke(QUESTION, passages=docs)).response_metadata) == (len(docs), 0)


def test_an_engine_that_reads_jointly_refuses():
    with pytest.raises(ConfigError, match="DraftConfig\\(passages=PassageReading"):
        ChatSpecPrefill(engine=joint_engine()).read_documents(corpus_documents())



def joint_engine():
    """The tiny engine with its draft reading every prompt jointly (``DraftConfig(passages=None)``)."""
    import dataclasses

    engine = tiny_engine()
    engine.config = dataclasses.replace(engine.config, draft=dataclasses.replace(engine.config.draft, passages=None))
    return engine
