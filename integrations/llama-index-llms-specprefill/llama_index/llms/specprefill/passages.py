"""Retrieved nodes as the engine's passages: cut a query engine's ``context_str`` back into nodes
(``split_context``, with the ``passage_id`` marker lines ``PassageIdPostprocessor`` writes), and
turn nodes, a ``Response``'s source nodes or texts into ``Passage``s (``node_passages``).

The rule for ``context_str`` (docs/integrations.md):

- with ``PassageIdPostprocessor`` in the query engine, each node's LLM text starts with a
  ``passage_id: <node id>`` metadata line; ``context_str`` is cut at those lines and every
  passage keeps its node id (the marker line itself is not sent to the model);
- without it, ``context_str`` is cut at blank lines (LlamaIndex joins node texts with
  ``"\\n\\n"``), and passages are numbered 1, 2, ...
"""

from __future__ import annotations

import re
from typing import Any

from llama_index.core.bridge.pydantic import Field
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import BaseNode, NodeWithScore, QueryBundle
from specprefill_rag.adapters import RETRIEVER_SCORE_KEY, InputTypeError, Passage, split_documents

__all__ = ["DEFAULT_PASSAGE_ID_KEY", "PassageIdPostprocessor", "node_passages", "split_context"]

DEFAULT_PASSAGE_ID_KEY = "passage_id"
DEFAULT_PASSAGE_SCORE_KEY = "passage_score"


def split_context(
    context_str: str, id_key: str = DEFAULT_PASSAGE_ID_KEY, score_key: str = DEFAULT_PASSAGE_SCORE_KEY
) -> list[Passage]:
    """Passages of a query engine's ``context_str`` (the rule in the module docstring).

    A ``score_key`` line right after a node's id marker (written by ``PassageIdPostprocessor``)
    becomes the passage's ``metadata[RETRIEVER_SCORE_KEY]`` (the retriever's score, which
    ``SelectionConfig.retriever_weight`` can weigh) and is removed from the text.
    """
    marker = re.compile(rf"^{re.escape(id_key)}: *(\S+?) *$", re.MULTILINE)
    score_line = re.compile(rf"\s*{re.escape(score_key)}: *(-?[0-9.eE+-]+) *(?:\n|$)")
    marks = list(marker.finditer(context_str))
    if not marks:
        return split_documents(context_str)
    passages = []
    head = context_str[: marks[0].start()].strip()
    if head:  # text before the first node (a repacked chunk that starts mid-node)
        passages.append(Passage(text=head))
    ends = [m.start() for m in marks[1:]] + [len(context_str)]
    for mark, end in zip(marks, ends, strict=True):
        text = context_str[mark.end() : end]
        metadata = {}
        scored = score_line.match(text)
        if scored:
            try:
                metadata[RETRIEVER_SCORE_KEY] = float(scored.group(1))
                text = text[scored.end() :]
            except ValueError:
                pass
        if text.strip():
            passages.append(Passage(text=text.strip(), id=mark.group(1), metadata=metadata))
    return passages


class PassageIdPostprocessor(BaseNodePostprocessor):
    """Puts each node's id first in its LLM-visible metadata, so ``SpecPrefillLLM`` can cut
    ``context_str`` back into nodes and report kept spans per node id, and the retriever's score
    second (read back as ``Passage.metadata[RETRIEVER_SCORE_KEY]``, never shown to the model). Nodes are
    copied."""

    id_key: str = Field(default=DEFAULT_PASSAGE_ID_KEY, description="Metadata key of the marker line.")
    score_key: str | None = Field(
        default=DEFAULT_PASSAGE_SCORE_KEY, description="Metadata key of the retriever-score line; None: no score."
    )

    @classmethod
    def class_name(cls) -> str:
        return "PassageIdPostprocessor"

    def _postprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        marked = []
        for item in nodes:
            node = item.node
            marks = {self.id_key: node.node_id}
            if self.score_key and item.score is not None:
                marks[self.score_key] = f"{item.score:.6g}"
            metadata = {**marks, **{k: v for k, v in node.metadata.items() if k not in marks}}
            excluded = [k for k in node.excluded_llm_metadata_keys if k not in marks]
            copy = node.model_copy(update={"metadata": metadata, "excluded_llm_metadata_keys": excluded})
            marked.append(NodeWithScore(node=copy, score=item.score))
        return marked


def _passage(item: object, number: int) -> Passage:
    if isinstance(item, Passage):
        return item
    if isinstance(item, str):
        return Passage(text=item)
    if isinstance(item, NodeWithScore):
        metadata = {} if item.score is None else {RETRIEVER_SCORE_KEY: float(item.score)}
        return Passage(text=item.node.get_content(), id=item.node.node_id, metadata=metadata)
    if isinstance(item, BaseNode):
        return Passage(text=item.get_content(), id=item.node_id)
    raise InputTypeError(f"document {number} must be a NodeWithScore, a node, a Passage or a str, "
                         f"got {type(item).__name__}")


def node_passages(documents: Any) -> list[Passage]:
    """Passages of retrieved documents: a list of ``NodeWithScore``s (a ``RetrieverTool``'s raw
    output), nodes, ``Passage``s or str, or anything with ``source_nodes`` (a query engine's
    ``Response``). Each node keeps its id and the retriever's score (``RETRIEVER_SCORE_KEY``)."""
    if hasattr(documents, "source_nodes"):
        documents = documents.source_nodes
    if isinstance(documents, (str, bytes)) or not isinstance(documents, (list, tuple)):
        raise InputTypeError(f"documents must be a list of nodes, Passages or str, got {type(documents).__name__}")
    return [_passage(item, number) for number, item in enumerate(documents)]
