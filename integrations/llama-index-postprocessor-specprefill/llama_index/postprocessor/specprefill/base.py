"""``SpecPrefillNodePostprocessor``: the draft's selection as a LlamaIndex node postprocessor (portable mode).

A translation layer only: the retrieved nodes become passages (their ids, their text without
metadata), ``SpecPrefillEngine.compress`` keeps of each what SpecPrefill would prefill for the
query (whole sentences, chosen by the draft), and each node comes back as a copy with its kept
text, its id, score and metadata, plus the report under ``specprefill_*`` metadata keys, which
the LLM and the embedder do not see. Any LLM can then answer from the nodes: ``OpenAILike`` on a
stock vLLM, a hosted API, Ollama (docs/integrations.md, "Portable mode").
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle, TextNode
from specprefill_rag.adapters import (
    CompressedPassage,
    InputError,
    InputTypeError,
    LazyEngine,
    SelectionConfig,
    SpecPrefillEngine,
    compress_passages,
    option,
    to_passage,
)

__all__ = ["SpecPrefillNodePostprocessor"]


class SpecPrefillNodePostprocessor(BaseNodePostprocessor):
    """Keeps of each retrieved node what SpecPrefill would prefill for the query.

    One node per input node, in order (``if_nothing_kept="drop"`` drops those of which nothing is
    kept): a copy of the node with the kept text (``marker`` where a run was dropped), the same
    ``node_id``, score and metadata, plus ``specprefill_keep_ratio``, ``specprefill_spans`` (kept
    [start, end) character spans in the node's text) and ``specprefill_score``
    (``CompressedPassage.to_metadata``), excluded from what the LLM and the embedder read. A node
    without text (an ``ImageNode``) keeps nothing; one that is not a ``TextNode`` passes through.

    Example:
        ```python
        from llama_index.postprocessor.specprefill import SpecPrefillNodePostprocessor

        query_engine = index.as_query_engine(
            llm=OpenAILike(...), node_postprocessors=[SpecPrefillNodePostprocessor(engine=engine, keep_rate=0.3)]
        )
        ```
    """

    model_name: str | None = option(
        "model_name", description="Main model (name, dir or GGUF): its tokenizer renders the scored prompt."
    )
    draft_model: str | None = option("draft_model", description="Draft model that scores the prompt (default: model).")
    backend: str = option("backend")
    keep_rate: float | None = option(
        "keep_rate", description="Fraction of the nodes' tokens kept; None = the engine's selection."
    )
    selection: SelectionConfig | None = option("selection")
    instructions: str | None = Field(default=None, description="System text of the scored prompt; None = engine's.")
    marker: str = option("marker")
    if_nothing_kept: Literal["keep", "drop"] = Field(
        default="keep", description="A node of which nothing is kept: kept with empty text, or dropped."
    )
    max_retries: int = option("max_retries")

    _engine: SpecPrefillEngine | None = PrivateAttr(default=None)
    _lazy: LazyEngine = PrivateAttr(default_factory=LazyEngine)

    def __init__(self, engine: SpecPrefillEngine | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if engine is None and not self.model_name:
            raise ValueError("pass engine=SpecPrefillEngine(...) or model_name='<name, dir or GGUF>'")
        self._engine = engine

    @classmethod
    def class_name(cls) -> str:
        return "SpecPrefillNodePostprocessor"

    @property
    def engine(self) -> SpecPrefillEngine:
        """The engine (built from ``model_name``/``draft_model`` on first use, once)."""
        if self._engine is None:
            assert self.model_name is not None
            self._engine = self._lazy.get(self.model_name, self.draft_model or self.model_name,
                                          backend=self.backend, max_retries=self.max_retries)
        return self._engine

    def _postprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        if query_bundle is None:
            raise InputError("the SpecPrefill postprocessor needs the query: pass query_str or query_bundle")
        for number, item in enumerate(nodes):
            if not isinstance(item, NodeWithScore):
                raise InputTypeError(f"node {number} must be a NodeWithScore, got {type(item).__name__}")
        with_text = [i for i, n in enumerate(nodes) if isinstance(n.node, TextNode)]
        compressions = self._compress([nodes[i] for i in with_text], query_bundle.query_str)
        kept = dict(zip(with_text, compressions, strict=True))
        out = []
        for i, item in enumerate(nodes):
            compressed = kept.get(i)
            if compressed is None:
                out.append(item)
            elif not (compressed.kept_nothing and self.if_nothing_kept == "drop"):
                assert isinstance(item.node, TextNode)
                out.append(NodeWithScore(node=_with_text(item.node, compressed), score=item.score))
        return out

    async def _apostprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        """``_postprocess_nodes`` in a worker thread: the draft runs while the event loop stays free."""
        return await asyncio.to_thread(self._postprocess_nodes, nodes, query_bundle)

    def _compress(self, nodes: list[NodeWithScore], query: str) -> list[CompressedPassage]:
        """What the engine keeps of each node's text (without its metadata), in order."""
        passages = [to_passage(n.node.get_content(metadata_mode=MetadataMode.NONE), n.node.node_id, n.node.metadata)
                    for n in nodes]
        return compress_passages(lambda: self.engine, query, passages, keep_rate=self.keep_rate,
                                 selection=self.selection, instructions=self.instructions, marker=self.marker)


def _with_text(node: TextNode, compressed: CompressedPassage) -> TextNode:
    """A copy of ``node`` with the kept text and the report in its metadata (hidden from the LLM
    and the embedder); the input node is left as it was."""
    report = compressed.to_metadata()
    copy = node.model_copy(update={
        "metadata": {**node.metadata, **report},
        "excluded_llm_metadata_keys": [*node.excluded_llm_metadata_keys, *report],
        "excluded_embed_metadata_keys": [*node.excluded_embed_metadata_keys, *report],
    })
    copy.set_content(compressed.text)
    return copy
