"""Importance scores → kept token indices → ``PrefillPlan``. Pure: tensors in, tensors out.

Prunable tokens are grouped into *units* that never cross a segment boundary (so a unit
belongs to exactly one passage) nor a protected token: whole sentences (``unit="sentence"``,
cut at ``max_sentence_tokens``; text without sentence ends falls back to ``chunk_size``
pieces) or fixed chunks of ``chunk_size`` tokens. A unit's score is the mean of its tokens'
scores, optionally blended with its passage's mean score (``passage_weight``). Protected
tokens are always kept; the context budget is filled with the best units, whole units only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch

from .config import SelectionConfig
from .errors import InputError, PlanError
from .types import (
    RETRIEVER_SCORE_KEY,
    AssembledPrompt,
    KeptSpan,
    PathChoice,
    PlannedPrompt,
    PrefillPlan,
    Segment,
    TokenScores,
    is_finite_number,
)

__all__ = [
    "full_plan", "plan_from_indices", "plan_scored", "prefilled_whole", "retriever_scores", "select",
    "unit_bounds", "unit_ranks", "unit_sums",
]


def unit_bounds(
    segment_index: torch.Tensor,
    prunable: torch.Tensor,
    max_tokens: int,
    starts: torch.Tensor | None = None,
    cuts: torch.Tensor | None = None,
) -> torch.Tensor:
    """[start, end) bounds of the units of prunable tokens, in prompt order.

    segment_index (n,) int64, prunable (n,) bool, starts (n,) bool or None, cuts (n,) int8 or None
    (``AssembledPrompt.cut_level``) → (n_units, 2) int64. A unit is cut at every change of segment,
    at every non-prunable token and where ``starts`` is True (a sentence begins). A unit that
    reaches ``max_tokens`` is cut too: without ``cuts`` right there; with them never inside a word
    or number, at the latest clause start of its second half, else at its latest word start. A
    unit without any word start runs on to the next one, up to ``LONG_RUN`` × ``max_tokens``
    tokens (a run of letters or digits that long, such as an encoded blob, is cut anyway).
    """
    bounds: list[tuple[int, int]] = []
    seg = segment_index.tolist()
    ok = prunable.tolist()
    begins = starts.tolist() if starts is not None else [False] * len(seg)
    levels = cuts.tolist() if cuts is not None else None
    start = -1
    for i, (s, p, b) in enumerate(zip(seg, ok, begins, strict=True)):
        if start >= 0 and (not p or b or s != seg[start]):
            bounds.append((start, i))
            start = -1
        elif start >= 0 and i - start >= max_tokens:
            cut = i if levels is None else _cut_point(levels, start, i, max_tokens)
            if cut is not None:
                bounds.append((start, cut))
                start = cut
        if p and start < 0:
            start = i
    if start >= 0:
        bounds.append((start, len(seg)))
    return torch.tensor(bounds, dtype=torch.int64).reshape(-1, 2)


LONG_RUN = 4  # a unit without a word start is cut anyway after this many times max_tokens


def _cut_point(levels: list[int], start: int, end: int, max_tokens: int) -> int | None:
    """Where to cut the unit [start, end) that reached its limit: a token index in (start, end],
    or None to let it grow (no word start in it yet; or inside an atomic item, cut level -1)."""
    word = None
    for j in range(end, start, -1):
        if levels[j] >= 2 and j - start >= max_tokens // 2:
            return j
        if word is None and levels[j] >= 1:
            word = j
    if word is not None:
        return word
    return end if end - start >= LONG_RUN * max_tokens and levels[end] >= 0 else None


def unit_sums(scores: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """Sum of the token scores of every unit: scores (n,), bounds (n_units, 2) → (n_units,) float32.

    One prefix sum (in float64, so long prompts lose no precision) instead of a slice per unit.
    """
    prefix = torch.cat([torch.zeros(1, dtype=torch.float64), scores.double().cumsum(0)])
    return (prefix[bounds[:, 1]] - prefix[bounds[:, 0]]).float()


def unit_ranks(
    scores: torch.Tensor,
    bounds: torch.Tensor,
    segment_index: torch.Tensor,
    passage_weight: float = 0.0,
    prior: torch.Tensor | None = None,
    prior_weight: float = 0.0,
) -> torch.Tensor:
    """Rank value of every unit: its mean token score, blended with its passage's.

    scores (n,), bounds (n_units, 2), segment_index (n,) → (n_units,) float32. With
    ``passage_weight`` w the rank is (1 − w)·unit/max(unit) + w·passage/max(passage), where a
    passage's score is the mean over its units' tokens: a passage the draft reads broadly lifts
    all of its sentences (the second hop of a two-hop question often scores low on its own).

    prior (n_segments,) float, NaN where unknown: a score per segment from outside the draft
    (the retriever's similarity). With ``prior_weight`` v the rank becomes (1 − v)·rank/max(rank)
    + v·p, p the segment's prior scaled to [0, 1] over the segments that have one (segments
    without one get the middle of that range).
    """
    sizes = (bounds[:, 1] - bounds[:, 0]).float()
    sums = unit_sums(scores, bounds)
    ranks = sums / sizes
    owner = segment_index[bounds[:, 0]]
    if passage_weight != 0.0:
        _, group = torch.unique(owner, return_inverse=True)
        passage = torch.zeros(int(group.max()) + 1).index_add_(0, group, sums)
        passage = passage / torch.zeros_like(passage).index_add_(0, group, sizes)
        unit_part = ranks / ranks.max().clamp_min(1e-30)
        passage_part = passage[group] / passage.max().clamp_min(1e-30)
        ranks = (1.0 - passage_weight) * unit_part + passage_weight * passage_part
    if prior is None or prior_weight == 0.0 or not bool(torch.isfinite(prior).any()):
        return ranks
    known = prior[torch.isfinite(prior)].float()
    low, span = known.min(), (known.max() - known.min()).clamp_min(1e-30)
    scaled = torch.where(torch.isfinite(prior), (prior.float() - low) / span, torch.tensor(0.5))
    return (1.0 - prior_weight) * ranks / ranks.max().clamp_min(1e-30) + prior_weight * scaled[owner]


def retriever_scores(segments: Sequence[Segment]) -> torch.Tensor | None:
    """(n_segments,) float32: each segment's retriever score (``metadata[RETRIEVER_SCORE_KEY]``),
    NaN where it has none; None when no segment has one. What ``SelectionConfig.retriever_weight``
    weighs (the ``prior`` of ``select``)."""
    values = []
    for segment in segments:
        score = segment.metadata.get(RETRIEVER_SCORE_KEY)
        values.append(float(score) if is_finite_number(score) else math.nan)
    if all(math.isnan(v) for v in values):
        return None
    return torch.tensor(values, dtype=torch.float32)


def select(
    scores: torch.Tensor,
    protected: torch.Tensor,
    segment_index: torch.Tensor,
    config: SelectionConfig,
    sentence_start: torch.Tensor | None = None,
    passage_prior: torch.Tensor | None = None,
    cut_level: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sorted indices of the tokens to prefill.

    scores (n,) float, protected (n,) bool, segment_index (n,) int64, sentence_start (n,) bool
    (True where a sentence begins; None: fixed chunks), passage_prior (n_segments,) float or None
    (the retriever's score per segment, NaN where unknown; weighted by
    ``config.retriever_weight``), cut_level (n,) int8 or None (``AssembledPrompt.cut_level``:
    where a sentence longer than its limit may be cut; None: anywhere; fixed chunks ignore it)
    → (n_kept,) int64. Prompts shorter than ``config.min_prompt_tokens`` are kept whole.
    """
    n = scores.numel()
    if protected.numel() != n or segment_index.numel() != n:
        raise InputError(
            f"scores ({n}), protected ({protected.numel()}) and segment_index "
            f"({segment_index.numel()}) must have one entry per prompt token"
        )
    for name, given in (("sentence_start", sentence_start), ("cut_level", cut_level)):
        if given is not None and given.numel() != n:
            raise InputError(f"{name} ({given.numel()}) must have one entry per prompt token ({n})")
    if n < config.min_prompt_tokens:
        return torch.arange(n, dtype=torch.int64)
    keep = protected.clone()
    prunable = ~protected
    budget = config.budget(int(prunable.sum()))
    if config.unit == "sentence" and sentence_start is not None:
        bounds = unit_bounds(segment_index, prunable, config.max_sentence_tokens, sentence_start, cut_level)
    else:
        # the paper's fixed chunks, never cut inside an atomic item (a tool result's JSON item)
        guard = None if cut_level is None or not bool((cut_level < 0).any()) \
            else torch.where(cut_level < 0, -1, 2).to(torch.int8)
        bounds = unit_bounds(segment_index, prunable, config.chunk_size, cuts=guard)
    if budget > 0 and len(bounds):
        ranks = unit_ranks(
            scores, bounds, segment_index, config.passage_weight, passage_prior, config.retriever_weight
        )
        order = torch.sort(ranks, descending=True, stable=True).indices
        sizes = (bounds[:, 1] - bounds[:, 0])[order]
        # Take units best-first until the budget is met; the last one may overshoot it.
        n_take = int(torch.searchsorted(sizes.cumsum(0), budget).item()) + 1
        if config.keep_mass is not None:
            n_take = min(n_take, _units_for_mass(scores, bounds[order], config))
        for a, b in bounds[order[:n_take]].tolist():
            keep[a:b] = True
    return keep.nonzero().flatten()


def _units_for_mass(scores: torch.Tensor, ordered: torch.Tensor, config: SelectionConfig) -> int:
    """How many of the ``ordered`` units hold ``keep_mass`` of the context's score mass
    (at least enough units for ``min_keep_tokens``, and at least one)."""
    assert config.keep_mass is not None
    mass = unit_sums(scores, ordered).cumsum(0)
    n_mass = int(torch.searchsorted(mass, config.keep_mass * float(mass[-1])).item()) + 1
    sizes = (ordered[:, 1] - ordered[:, 0]).cumsum(0)
    n_min = int(torch.searchsorted(sizes, config.min_keep_tokens).item()) + 1 if config.min_keep_tokens else 1
    return min(max(n_mass, n_min), len(ordered))


def _ranges(indices: list[int]) -> tuple[tuple[int, int], ...]:
    ranges: list[tuple[int, int]] = []
    for i in indices:
        if ranges and ranges[-1][1] == i:
            ranges[-1] = (ranges[-1][0], i + 1)
        else:
            ranges.append((i, i + 1))
    return tuple(ranges)


def plan_from_indices(
    prompt: AssembledPrompt, kept: torch.Tensor, *, contiguous_positions: bool = False
) -> PrefillPlan:
    """Build the plan for prefilling ``prompt.token_ids[kept]``.

    With original positions (the default) kept token i sits at position ``kept[i]`` and
    decoding continues at the full prompt length. ``contiguous_positions`` re-indexes the
    kept tokens 0..k-1 (an ablation that shows why original positions matter).
    """
    n = prompt.n_tokens
    kept = kept.to(torch.int64)
    if kept.numel() == 0:
        raise PlanError("a prefill plan needs at least one kept token")
    if kept.numel() > 1 and not bool((kept[1:] > kept[:-1]).all()):
        raise PlanError("kept indices must be strictly increasing")
    if int(kept[0]) < 0 or int(kept[-1]) >= n:
        raise PlanError(f"kept indices must lie in [0, {n})")
    if contiguous_positions:
        positions = torch.arange(kept.numel(), dtype=torch.int64)
        next_position = kept.numel()
    else:
        positions = kept.clone()
        next_position = n
    # One pass over the tokens, whatever the number of segments (10k passages plan in ms).
    n_segments = len(prompt.segments)
    sizes = torch.bincount(prompt.segment_index + 1, minlength=n_segments + 1)[1:].tolist()
    kept_segments = prompt.segment_index[kept]
    order = torch.argsort(kept_segments, stable=True)
    counts = torch.bincount(kept_segments + 1, minlength=n_segments + 1).tolist()
    grouped = kept[order].tolist()
    at = counts[0]  # kept template tokens (segment -1) come first
    spans = []
    for index, segment in enumerate(prompt.segments):
        mine = grouped[at : at + counts[index + 1]]
        at += counts[index + 1]
        spans.append(
            KeptSpan(
                segment_index=index,
                kind=segment.kind,
                id=segment.id,
                n_tokens=sizes[index],
                n_kept=len(mine),
                ranges=_ranges(mine),
            )
        )
    return PrefillPlan(
        token_ids=prompt.token_ids[kept],
        position_ids=positions,
        next_position=next_position,
        n_prompt=n,
        kept_spans=tuple(spans),
        speculated=kept.numel() < n,
    )


def full_plan(prompt: AssembledPrompt) -> PrefillPlan:
    """The baseline: every prompt token at its own position."""
    return plan_from_indices(prompt, torch.arange(prompt.n_tokens, dtype=torch.int64))


def prefilled_whole(prompt: AssembledPrompt, path: PathChoice, scores: TokenScores | None = None) -> PlannedPrompt:
    """The planned prompt that prefills every token, for the reason ``path`` gives (``scores``:
    the draft's, when it ran)."""
    return PlannedPrompt(prompt, full_plan(prompt), scores, 0.0, None, path)


def plan_scored(prompt: AssembledPrompt, config: SelectionConfig, scores: TokenScores) -> PlannedPrompt:
    """The plan from the draft's ``scores``: the best units within the budget, with the time the
    selection took (``assemble_s`` is left to the caller, 0.0)."""
    began = time.perf_counter()
    prior = retriever_scores(prompt.segments) if config.retriever_weight else None
    kept = select(scores.scores, prompt.protected, prompt.segment_index, config, prompt.sentence_start, prior,
                  prompt.cut_level)
    plan = plan_from_indices(prompt, kept, contiguous_positions=config.positions == "contiguous")
    path = PathChoice("pruned", f"the draft's scores chose {plan.n_kept} of the prompt's {plan.n_prompt} tokens")
    return PlannedPrompt(prompt, plan, scores, 0.0, time.perf_counter() - began, path)
