"""``SpecPrefillCompressor``: the draft's selection as a LangChain document compressor (portable mode).

A translation layer only: the documents become passages, ``SpecPrefillEngine.compress`` keeps
of each what SpecPrefill would prefill (whole sentences, chosen by the draft for this question),
and each ``Document`` comes back with its kept text, its own id and metadata, and the report
under ``specprefill_*`` keys. Any chat model can then answer from the compressed documents: a
hosted API, a stock vLLM, Ollama (docs/integrations.md, "Portable mode").
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Literal

from langchain_core.callbacks import Callbacks
from langchain_core.documents import BaseDocumentCompressor, Document
from langchain_core.runnables import RunnableConfig, RunnableSerializable
from pydantic import ConfigDict, Field, PrivateAttr, model_validator
from specprefill_rag import CompressedPassage, InputTypeError, Passage, SelectionConfig, SpecPrefillEngine
from specprefill_rag.backends.vllm_server import DEFAULT_MAX_RETRIES
from specprefill_rag.compress import DEFAULT_MARKER
from specprefill_rag.engine import LazyEngine

__all__ = ["SpecPrefillCompressor"]

CompressorInput = dict[str, Any]  # {"question": str, "documents": list[Document]}


class SpecPrefillCompressor(BaseDocumentCompressor, RunnableSerializable[CompressorInput, list[Document]]):
    """Keeps of each retrieved document what SpecPrefill would prefill for the query.

    Use it in a ``ContextualCompressionRetriever(base_compressor=..., base_retriever=...)``, or
    as a runnable in LCEL: ``{"question": ..., "documents": [...]}`` → the compressed documents.
    One ``Document`` per input document, in order, each with its ``id`` and metadata plus
    ``specprefill_keep_ratio``, ``specprefill_spans`` (kept [start, end) character spans in the
    input's ``page_content``) and ``specprefill_score`` (``CompressedPassage.to_metadata``); a
    document of which nothing is kept is dropped (``if_nothing_kept="drop"``, the default) or
    kept with empty text (``"keep"``).

    Example:
        ```python
        from langchain_specprefill import SpecPrefillCompressor

        compressor = SpecPrefillCompressor(engine=engine, keep_rate=0.3)
        retriever = ContextualCompressionRetriever(base_compressor=compressor, base_retriever=base)
        ```
    """

    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True)

    engine: SpecPrefillEngine | None = Field(default=None, exclude=True, description="A ready engine.")
    model_name: str | None = Field(
        default=None, alias="model", description="Main model (name, dir or GGUF): its tokenizer renders the prompt."
    )
    draft_model: str | None = Field(default=None, description="Draft model that scores the prompt (default: model).")
    backend: str = Field(default="transformers", description="Main-model backend, by registry name.")
    keep_rate: float | None = Field(
        default=None, description="Fraction of the documents' tokens kept; None = the engine's selection."
    )
    selection: SelectionConfig | None = Field(default=None, description="Selection settings; None = the engine's.")
    instructions: str | None = Field(default=None, description="System text of the scored prompt; None = engine's.")
    marker: str = Field(default=DEFAULT_MARKER, description="Text that stands for each dropped run of a document.")
    if_nothing_kept: Literal["drop", "keep"] = Field(
        default="drop", description="A document of which nothing is kept: dropped, or kept with empty text."
    )
    max_retries: int = Field(default=DEFAULT_MAX_RETRIES, description="Retries of the vllm_server backend.")

    _lazy: LazyEngine = PrivateAttr(default_factory=LazyEngine)

    @model_validator(mode="after")
    def _check_source(self) -> SpecPrefillCompressor:
        if self.engine is None and not self.model_name:
            raise ValueError("pass engine=SpecPrefillEngine(...) or model='<name, dir or GGUF>'")
        return self

    def _engine(self) -> SpecPrefillEngine:
        if self.engine is not None:
            return self.engine
        assert self.model_name is not None
        draft = self.draft_model or self.model_name
        return self._lazy.get(self.model_name, draft, backend=self.backend, max_retries=self.max_retries)

    def compress_documents(
        self, documents: Sequence[Document], query: str, callbacks: Callbacks | None = None
    ) -> Sequence[Document]:
        """The documents as SpecPrefill would prefill them for ``query`` (see the class docstring)."""
        documents = list(documents)
        for number, document in enumerate(documents):
            if not isinstance(document, Document):
                raise InputTypeError(f"document {number} must be a Document, got {type(document).__name__}")
        if not any(d.page_content.strip() for d in documents):
            compressed = [CompressedPassage(i, d.id, "", (), 0, 0, (), None) for i, d in enumerate(documents)]
        else:
            passages = [Passage(d.page_content, id=d.id, metadata=dict(d.metadata)) for d in documents]
            compressed = list(self._engine().compress(
                query, passages, keep_rate=self.keep_rate, selection=self.selection, instructions=self.instructions,
                marker=self.marker,
            ).passages)
        return [
            Document(page_content=kept.text, id=document.id, metadata={**document.metadata, **kept.to_metadata()})
            for document, kept in zip(documents, compressed, strict=True)
            if not (kept.kept_nothing and self.if_nothing_kept == "drop")
        ]

    async def acompress_documents(
        self, documents: Sequence[Document], query: str, callbacks: Callbacks | None = None
    ) -> Sequence[Document]:
        """``compress_documents`` in a worker thread: the draft runs while the event loop stays free."""
        return await asyncio.to_thread(self.compress_documents, documents, query, callbacks)

    # -- LCEL: {"question": ..., "documents": [...]} → compressed documents -----------------------

    @staticmethod
    def _unpack(input: CompressorInput) -> tuple[list[Document], str]:
        if not isinstance(input, dict) or not isinstance(input.get("question"), str) or "documents" not in input:
            raise InputTypeError('the compressor takes {"question": str, "documents": [Document, ...]}')
        return list(input["documents"]), input["question"]

    def invoke(self, input: CompressorInput, config: RunnableConfig | None = None, **kwargs: Any) -> list[Document]:
        return self._call_with_config(lambda x: list(self.compress_documents(*self._unpack(x))), input, config)

    async def ainvoke(
        self, input: CompressorInput, config: RunnableConfig | None = None, **kwargs: Any
    ) -> list[Document]:
        async def run(x: CompressorInput) -> list[Document]:
            return list(await self.acompress_documents(*self._unpack(x)))

        return await self._acall_with_config(run, input, config)
