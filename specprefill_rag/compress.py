"""Portable mode: the draft's selection as text, for an LLM that is not ours.

``SpecPrefillEngine.compress`` plans a prompt exactly as ``plan`` does; this module turns that
plan back into the passages' own text: per passage the characters of its kept tokens (whole
sentences under ``SelectionConfig(unit="sentence")``, the default; a sentence longer than
``max_sentence_tokens`` may be cut between clauses or words), their character spans in the text
the client sent, the kept ratio and the draft's score. Any LLM (a hosted API, a stock vLLM,
Ollama) can then read the compressed passages as an ordinary prompt: it saves the remote
prefill without our plugin, at the cost of the positions (docs/integrations.md, "Portable mode").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from .errors import InputTypeError
from .prompt import Passages, as_passages
from .types import KeptSpan, Passage, PathChoice, PlannedPrompt, SegmentKind

__all__ = ["DEFAULT_MARKER", "CompressedPassage", "Compression", "check_request", "compression", "kept_texts"]

DEFAULT_MARKER = " … "  # what stands for each dropped run of a passage in its kept text

_EMPTY: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True)
class CompressedPassage:
    """What SpecPrefill keeps of one passage, as text.

    ``spans`` are [start, end) character spans in the passage's text as given (``Passage.text``,
    white space and all), in order: ``passage.text[a:b]`` for each is a kept run, trimmed of white
    space at its ends. ``text`` joins the runs with the marker (``compress(marker=...)``) where a
    run was dropped, before, between or after them.
    """

    index: int  # the passage's place in the request's list, from 0
    id: str | None  # the passage's id; one without an id is named by its number, from 1
    text: str  # the kept text ("" when nothing was kept)
    spans: tuple[tuple[int, int], ...]  # kept [start, end) character spans in the passage's own text
    n_tokens: int  # the passage's tokens in the main model's prompt
    n_kept: int  # of them, the kept ones (those SpecPrefill would prefill)
    token_ranges: tuple[tuple[int, int], ...]  # kept [start, end) token ranges in the prompt (KeptSpan.ranges)
    score: float | None  # the draft's mean importance of its tokens, 1.0 = the request's best passage; None: no draft
    metadata: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)  # the passage's own metadata

    @property
    def keep_ratio(self) -> float:
        """Kept tokens / the passage's tokens (1.0 for a passage without text: nothing was dropped)."""
        return self.n_kept / self.n_tokens if self.n_tokens else 1.0

    @property
    def kept_nothing(self) -> bool:
        """Whether no text of the passage is left (a passage without text kept nothing either)."""
        return not self.text

    def to_metadata(self) -> dict[str, Any]:
        """The report as flat, JSON-friendly metadata keys (what both framework integrations add
        to a document's or node's own metadata): ``specprefill_keep_ratio``, ``specprefill_spans``
        (kept [start, end) character spans in the passage's text) and ``specprefill_score``."""
        return {
            "specprefill_keep_ratio": self.keep_ratio,
            "specprefill_spans": [[a, b] for a, b in self.spans],
            "specprefill_score": self.score,
        }


@dataclass(frozen=True)
class Compression:
    """The passages of one request as SpecPrefill would prefill them, with the plan they come from."""

    passages: tuple[CompressedPassage, ...]  # one per passage given, in order
    planned: PlannedPrompt  # the prompt, its plan (``plan``'s) and the draft's scores
    seconds: float  # wall time of the whole call: assembly, draft, selection, text

    @property
    def path(self) -> PathChoice:
        """Pruned by the draft, or kept whole and why (a short prompt: ``min_prompt_tokens``)."""
        return self.planned.path

    @property
    def keep_ratio(self) -> float:
        """Kept tokens / tokens over all passages (1.0 when they hold none)."""
        total = sum(p.n_tokens for p in self.passages)
        return sum(p.n_kept for p in self.passages) / total if total else 1.0

    @property
    def texts(self) -> list[str]:
        """The kept text of every passage, in order."""
        return [p.text for p in self.passages]


def check_request(question: object, passages: Passages, marker: object) -> list[Passage]:
    """``passages`` as a list of ``Passage``, before any model runs (``InputTypeError`` for a
    question that is not a str: compression maps passages, so it takes no ``Segment`` list; for
    a marker that is not a str; for passages that are not ``Passage`` or str)."""
    if not isinstance(question, str):
        raise InputTypeError(f"the question must be a str, got {type(question).__name__}")
    if not isinstance(marker, str):
        raise InputTypeError(f"marker must be a str, got {type(marker).__name__}")
    return as_passages(passages)


def compression(planned: PlannedPrompt, passages: Passages, marker: str, seconds: float) -> Compression:
    """The ``Compression`` of ``passages`` (as given to ``assemble``: the prompt's passage
    segments are their non-empty ones, in order) under ``planned``."""
    prompt, plan = planned.prompt, planned.plan
    spans = {s.segment_index: s for s in plan.kept_spans if s.kind is SegmentKind.PASSAGE}
    segment_of = iter(sorted(spans))
    kept = _kept_tokens(plan.kept_spans, prompt.n_tokens)
    means = _passage_means(planned, list(spans.values()))
    best = max(means.values(), default=0.0)
    out = []
    for index, passage in enumerate(as_passages(passages)):
        if not passage.text.strip():
            out.append(CompressedPassage(index, passage.id if passage.id is not None else str(index + 1), "", (),
                                         0, 0, (), None, passage.metadata))
            continue
        segment = next(segment_of)
        span = spans[segment]
        runs = _kept_runs(planned, kept, segment)
        lead = len(passage.text) - len(passage.text.lstrip())
        text = _joined(prompt.segments[segment].text, runs, marker)
        score = means[segment] / best if segment in means and best > 0 else None
        out.append(CompressedPassage(index, span.id, text, tuple((a + lead, b + lead) for a, b in runs),
                                     span.n_tokens, span.n_kept, span.ranges, score, passage.metadata))
    return Compression(tuple(out), planned, seconds)


def kept_texts(planned: PlannedPrompt, marker: str) -> dict[int, str]:
    """Segment index → the kept text of every prunable segment of ``planned``'s prompt, by
    ``compression``'s rule (a passage's is its ``CompressedPassage.text``): what the gateway's
    text mode sends in place of each passage."""
    prompt = planned.prompt
    kept = _kept_tokens(planned.plan.kept_spans, prompt.n_tokens)
    return {i: _joined(segment.text, _kept_runs(planned, kept, i), marker)
            for i, segment in enumerate(prompt.segments) if segment.prunable}


def _kept_tokens(spans: tuple[KeptSpan, ...], n: int) -> torch.Tensor:
    """(n,) bool: the prompt's tokens the plan keeps (template tokens count as not kept here)."""
    kept = torch.zeros(n, dtype=torch.bool)
    for span in spans:
        for start, end in span.ranges:
            kept[start:end] = True
    return kept


def _passage_means(planned: PlannedPrompt, spans: list[KeptSpan]) -> dict[int, float]:
    """Segment index → the draft's mean score over the passage's tokens (none without scores)."""
    if planned.scores is None:
        return {}
    scores, owner = planned.scores.scores.float(), planned.prompt.segment_index
    return {s.segment_index: float(scores[owner == s.segment_index].mean()) for s in spans if s.n_tokens}


def _kept_runs(planned: PlannedPrompt, kept: torch.Tensor, segment: int) -> list[tuple[int, int]]:
    """Kept [start, end) character runs of one passage segment, relative to its text, trimmed of
    white space. A character is kept when a kept token of the passage covers it, dropped when only
    a dropped one does; one that no token of the passage covers (punctuation that the tokenizer
    merged with the template's text after the passage) follows the character before it. Runs that
    only white space separates are one run."""
    prompt = planned.prompt
    where = [(a, b) for i, a, b in prompt.segment_spans if i == segment]
    if not where:
        return []
    a, b = where[0]
    state = np.zeros(b - a, dtype=np.int8)  # 1 kept, -1 dropped, 0 no token of the passage
    mine = (prompt.segment_index == segment).nonzero().flatten()
    bounds = prompt.offsets[mine].clamp(a, b) - a
    for (start, end), is_kept in zip(bounds.tolist(), kept[mine].tolist(), strict=True):
        part = state[start:end]
        state[start:end] = np.where(part == 1, 1, 1 if is_kept else -1)  # kept wins where tokens overlap
    known = np.flatnonzero(state)
    if known.size == 0:
        return []
    fill = np.maximum.accumulate(np.where(state != 0, np.arange(state.size), -1))
    chars = state[np.where(fill >= 0, fill, known[0])] == 1
    text = prompt.segments[segment].text
    edges = np.flatnonzero(np.diff(np.concatenate([[False], chars, [False]]).astype(np.int8)))
    runs: list[tuple[int, int]] = []
    for start, end in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True):
        piece = text[start:end]
        left, right = len(piece) - len(piece.lstrip()), len(piece.rstrip())
        if right <= left:
            continue
        if runs and not text[runs[-1][1]:start + left].strip():  # only white space dropped between
            runs[-1] = (runs[-1][0], start + right)
        else:
            runs.append((start + left, start + right))
    return runs


def _joined(text: str, runs: list[tuple[int, int]], marker: str) -> str:
    """The kept runs of ``text`` in order, with ``marker`` wherever text was dropped (before,
    between or after them); outer white space stripped."""
    if not runs:
        return ""
    parts = [marker] if text[: runs[0][0]].strip() else []
    for n, (a, b) in enumerate(runs):
        if n:
            parts.append(marker)
        parts.append(text[a:b])
    if text[runs[-1][1]:].strip():
        parts.append(marker)
    return "".join(parts).strip()
