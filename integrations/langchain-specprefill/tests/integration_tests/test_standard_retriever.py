"""LangChain's standard retriever suite on a ``ContextualCompressionRetriever`` whose compressor is
``SpecPrefillCompressor`` (LangChain has no standard suite for compressors), on the tiny engine."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.retrievers import BaseRetriever
from langchain_tests.integration_tests import RetrieversIntegrationTests
from lc_helpers import QUESTION, KeywordRetriever, tiny_engine
from specprefill_rag import SelectionConfig

from langchain_specprefill import SpecPrefillCompressor

retrievers = pytest.importorskip("langchain_classic.retrievers", reason="pip install langchain-classic")


def compression_retriever(k: int = 4) -> BaseRetriever:
    """The keyword retriever's ``k`` documents, compressed; every document comes back (empty when
    nothing of it is kept), so ``k`` is the count the suite checks."""
    compressor = SpecPrefillCompressor(
        engine=tiny_engine(), selection=SelectionConfig(keep_rate=0.3, min_prompt_tokens=16), if_nothing_kept="keep"
    )
    return retrievers.ContextualCompressionRetriever(base_compressor=compressor, base_retriever=KeywordRetriever(k=k))


class TestSpecPrefillCompressionRetriever(RetrieversIntegrationTests):
    @property
    def retriever_constructor(self) -> Any:
        return compression_retriever  # a factory: the suite calls it with k

    @property
    def retriever_query_example(self) -> str:
        return QUESTION


def test_the_compressed_documents_are_shorter_and_carry_the_report():
    documents = compression_retriever(k=5).invoke(QUESTION)
    originals = {d.id: d for d in KeywordRetriever(k=5).invoke(QUESTION)}
    assert len(documents) == 5
    for document in documents:
        source = originals[document.id].page_content
        assert len(document.page_content) <= len(source)
        for a, b in document.metadata["specprefill_spans"]:
            assert source[a:b] in document.page_content
