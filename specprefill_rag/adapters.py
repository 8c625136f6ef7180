"""What the LangChain and LlamaIndex integrations use of the core, in one stable module.

The integration packages (``integrations/``) import this module and nothing else of
``specprefill_rag`` (``tests/test_house_plan.py`` checks): the engine and the values it takes and
returns, the prompt helpers that turn a framework's chat into segments, and what the frameworks'
classes share:

- ``option(name)``: a pydantic ``Field`` with the shared default and description of an engine
  option the integration classes all offer (``model_name``, ``keep_rate``, ``max_retries``, ...),
  so a default is said once;
- ``to_passage``: a framework document (its text, id, metadata) as a :class:`Passage`;
- ``compress_passages``: what the compressors (LangChain's ``SpecPrefillCompressor``,
  LlamaIndex's ``SpecPrefillNodePostprocessor``) keep of each passage;
- ``answer_report``: the report an answer carries (LangChain's ``response_metadata``, LlamaIndex's
  ``additional_kwargs``);
- ``embed``: the packaged all-MiniLM-L6-v2 embedder behind each framework's ``MiniLM`` adapter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .backends.vllm_server import DEFAULT_MAX_RETRIES
from .compress import DEFAULT_MARKER, CompressedPassage
from .config import SelectionConfig
from .engine import LazyEngine, Mode, SpecPrefillEngine
from .errors import InputError, InputTypeError
from .grammar import json_grammar
from .prompt import build_segments, message_segments, split_documents
from .streams import AsyncTextStream, TextStream
from .toolcalls import content_filter, parser_for
from .types import RETRIEVER_SCORE_KEY, GenerationResult, Passage, PassagesRead, Segment, SegmentKind

__all__ = [
    "DEFAULT_MARKER",
    "DEFAULT_MAX_RETRIES",
    "OPTIONS",
    "RETRIEVER_SCORE_KEY",
    "AsyncTextStream",
    "CompressedPassage",
    "GenerationResult",
    "InputError",
    "InputTypeError",
    "LazyEngine",
    "Mode",
    "Option",
    "Passage",
    "PassagesRead",
    "Segment",
    "SegmentKind",
    "SelectionConfig",
    "SpecPrefillEngine",
    "TextStream",
    "answer_report",
    "build_segments",
    "compress_passages",
    "content_filter",
    "embed",
    "json_grammar",
    "message_segments",
    "option",
    "parser_for",
    "split_documents",
    "to_passage",
]


@dataclass(frozen=True)
class Option:
    """An engine option the integration classes share: its default and what it means."""

    default: Any
    description: str


OPTIONS: Mapping[str, Option] = {
    "model_name": Option(None, "Main model: a packaged name, a Hugging Face directory or a GGUF file."),
    "draft_model": Option(None, "Draft model that scores the prompt; None serves mode='full' only."),
    "backend": Option("transformers", "Main-model backend, by registry name."),
    "mode": Option("specprefill", "'full' = the baseline: the whole prompt prefilled."),
    "keep_rate": Option(None, "Fraction of the context (retrieved passages, history) prefilled; the question "
                              "always is. None = the engine's selection."),
    "temperature": Option(None, "0 = greedy; None = the engine's default."),
    "max_tokens": Option(None, "Max generated tokens; None = the engine's default."),
    "timeout": Option(None, "Seconds for the whole call (draft, prefill, every token, retries); then "
                            "BackendTimeoutError."),
    "max_retries": Option(DEFAULT_MAX_RETRIES, "Retries of a failed connection or a 502/503/504 before the first "
                                               "token, by the vllm_server backend (never a 4xx; the draft's plan is "
                                               "re-sent, not recomputed)."),
    "engine": Option(None, "A ready engine (shares loaded models); else one is built from the model names."),
    "selection": Option(None, "Selection settings; None = the engine's."),
    "marker": Option(DEFAULT_MARKER, "Text that stands for each dropped run of a passage."),
}


def option(name: str, **extra: Any) -> Any:
    """A pydantic ``Field`` for the shared option ``name`` (its default and description from
    :data:`OPTIONS`); ``extra`` goes to ``Field`` (``alias``, ``exclude``, a class's own
    ``description``). pydantic comes with either framework; the core does not need it."""
    from pydantic import Field

    shared = OPTIONS[name]
    return Field(**{"default": shared.default, "description": shared.description, **extra})


def to_passage(text: str, id: str | None = None, metadata: Mapping[str, Any] | None = None) -> Passage:
    """A framework's document as a passage: its text, its id and a copy of its metadata (a
    retriever's score under ``RETRIEVER_SCORE_KEY`` steers selection, docs/configuration.md)."""
    return Passage(text=text, id=id, metadata=dict(metadata or {}))


def compress_passages(
    engine: Callable[[], SpecPrefillEngine], query: str, passages: Sequence[Passage], *,
    keep_rate: float | None = None, selection: SelectionConfig | None = None, instructions: str | None = None,
    marker: str = DEFAULT_MARKER,
) -> list[CompressedPassage]:
    """What the engine keeps of each passage for ``query``, in order (``SpecPrefillEngine.compress``).
    ``engine`` gives the engine when there is something to score, so that a lazily built one is not
    loaded for nothing: passages with no text at all each come back empty, the draft unrun."""
    if not any(p.text.strip() for p in passages):
        return [CompressedPassage(i, p.id, "", (), 0, 0, (), None) for i, p in enumerate(passages)]
    return list(engine().compress(query, list(passages), keep_rate=keep_rate, selection=selection,
                                instructions=instructions, marker=marker).passages)


def answer_report(model_name: str | None, result: GenerationResult) -> dict[str, Any]:
    """The facts an answer carries in a framework's metadata: the model, then the result's counts,
    keep ratio, timings and kept spans (``GenerationResult.to_dict``)."""
    return {"model_name": model_name, **result.to_dict()}


def embed(texts: Sequence[str]) -> list[list[float]]:
    """Unit-length all-MiniLM-L6-v2 embeddings (384 floats per text), offline on CPU; the model is
    the one ``specprefill-rag[rag]`` packages, loaded once per process."""
    from .tools.retrieval import load_embedder

    return load_embedder().encode(list(texts), normalize_embeddings=True, show_progress_bar=False).tolist()
