"""``SpecPrefillPassageReader``: nodes read by the draft as they are ingested, so a question over them
later costs the draft only its own tokens.

With passages read apart (``DraftConfig(passages=PassageReading())``) the draft reads each passage
once, against the prompt's system part, and keeps that reading (``SpecPrefillEngine.read_passages``).
This ``TransformComponent`` reads nodes in an ``IngestionPipeline`` exactly as ``SpecPrefillLLM``
will later send them: each node's LLM text (``MetadataMode.LLM``) cut by ``split_context``, as a
query engine's ``context_str`` is cut (whole nodes with ``PassageIdPostprocessor``, else blank-line
pieces), after the LLM's query-engine instructions, in its engine's cache namespace.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from llama_index.core.bridge.pydantic import Field
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore, TransformComponent
from specprefill_rag.adapters import Passage, PassagesRead

from .base import SpecPrefillLLM, rag_instructions
from .passages import PassageIdPostprocessor, split_context

__all__ = ["SpecPrefillPassageReader"]


class SpecPrefillPassageReader(TransformComponent):
    """Reads each node into the draft's passage store and returns the nodes unchanged.

    Put it last in the pipeline (after splitters and extractors: what it reads must be what the
    vector store keeps), and give it the ``SpecPrefillLLM`` the query engine answers with: its
    engine, ``system_prompt`` / ``instructions`` and ``passage_id_key`` decide what is read.
    ``read(nodes)`` does the same and returns how many passages the store held already and read.
    """

    llm: SpecPrefillLLM = Field(description="The LLM the query engine answers with.")
    passage_ids: bool = Field(
        default=True,
        description="The query engine marks nodes with PassageIdPostprocessor (a node is one passage); "
        "False: context_str is cut at blank lines (a node with paragraphs is several passages).",
    )

    @classmethod
    def class_name(cls) -> str:
        return "SpecPrefillPassageReader"

    def passages(self, nodes: Sequence[BaseNode]) -> list[Passage]:
        """The passages ``SpecPrefillLLM`` will cut these nodes' ``context_str`` into."""
        id_key = self.llm.passage_id_key
        marker = PassageIdPostprocessor(id_key=id_key, score_key=None)
        out: list[Passage] = []
        for node in nodes:
            if self.passage_ids:  # the marker line the postprocessor writes, which split_context cuts at
                node = marker._postprocess_nodes([NodeWithScore(node=node)])[0].node
            out.extend(split_context(node.get_content(metadata_mode=MetadataMode.LLM), id_key))
        return out

    def read(self, nodes: Sequence[BaseNode]) -> PassagesRead:
        """Read ``nodes`` into the draft's passage store (``SpecPrefillEngine.read_passages``)."""
        passages = self.passages(nodes)
        if not passages:
            return PassagesRead(0, 0)
        engine = self.llm.engine
        return engine.read_passages(passages, instructions=rag_instructions(self.llm),
                                    cache_salt=engine.config.generation.cache_salt)

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        self.read(nodes)
        return nodes

    async def acall(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        await asyncio.to_thread(self.read, nodes)  # the draft runs in a worker thread, never on the loop
        return nodes
