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
from specprefill_rag.adapters import (
    InputTypeError,
    LazyEngine,
    SelectionConfig,
    SpecPrefillEngine,
    compress_passages,
    option,
    to_passage,
)

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

    engine: SpecPrefillEngine | None = option("engine", exclude=True)
    model_name: str | None = Field(  # the alias a literal Field argument, for type checkers
        default=None, alias="model", description="Main model (name, dir or GGUF): its tokenizer renders the prompt."
    )
    draft_model: str | None = option("draft_model", description="Draft model that scores the prompt (default: model).")
    backend: str = option("backend")
    keep_rate: float | None = option(
        "keep_rate", description="Fraction of the documents' tokens kept; None = the engine's selection."
    )
    selection: SelectionConfig | None = option("selection")
    instructions: str | None = Field(default=None, description="System text of the scored prompt; None = engine's.")
    marker: str = option("marker")
    if_nothing_kept: Literal["drop", "keep"] = Field(
        default="drop", description="A document of which nothing is kept: dropped, or kept with empty text."
    )
    max_retries: int = option("max_retries")

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
        passages = [to_passage(d.page_content, d.id, d.metadata) for d in documents]
        compressed = compress_passages(self._engine, query, passages, keep_rate=self.keep_rate,
                                       selection=self.selection, instructions=self.instructions, marker=self.marker)
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
