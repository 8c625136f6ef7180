"""Importance scores → kept token indices → ``PrefillPlan``. Pure: tensors in, tensors out.

Prunable tokens are grouped into chunks of ``chunk_size`` consecutive tokens that never cross
a segment boundary (so a chunk belongs to exactly one passage). A chunk's score is the mean of
its tokens' scores. Protected tokens are always kept; the remaining budget is filled with the
best chunks, whole chunks only.
"""

from __future__ import annotations

import torch

from .config import SelectionConfig
from .types import AssembledPrompt, KeptSpan, PrefillPlan

__all__ = ["chunk_bounds", "select", "plan_from_indices", "full_plan"]


def chunk_bounds(segment_index: torch.Tensor, prunable: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[start, end) bounds of the chunks of prunable tokens, in prompt order.

    segment_index (n,) int64, prunable (n,) bool → (n_chunks, 2) int64. A chunk is cut at
    ``chunk_size`` tokens, at every change of segment and at every non-prunable token.
    """
    bounds: list[tuple[int, int]] = []
    seg = segment_index.tolist()
    ok = prunable.tolist()
    start = -1
    for i, (s, p) in enumerate(zip(seg, ok, strict=True)):
        if start >= 0 and (not p or s != seg[start] or i - start == chunk_size):
            bounds.append((start, i))
            start = -1
        if p and start < 0:
            start = i
    if start >= 0:
        bounds.append((start, len(seg)))
    return torch.tensor(bounds, dtype=torch.int64).reshape(-1, 2)


def select(
    scores: torch.Tensor,
    protected: torch.Tensor,
    segment_index: torch.Tensor,
    config: SelectionConfig,
) -> torch.Tensor:
    """Sorted indices of the tokens to prefill.

    scores (n,) float, protected (n,) bool, segment_index (n,) int64 → (n_kept,) int64.
    Prompts shorter than ``config.min_prompt_tokens`` are kept whole.
    """
    n = scores.numel()
    if protected.numel() != n or segment_index.numel() != n:
        raise ValueError(
            f"scores ({n}), protected ({protected.numel()}) and segment_index "
            f"({segment_index.numel()}) must have one entry per prompt token"
        )
    if n < config.min_prompt_tokens:
        return torch.arange(n, dtype=torch.int64)
    keep = protected.clone()
    remaining = config.budget(n) - int(keep.sum())
    bounds = chunk_bounds(segment_index, ~protected, config.chunk_size)
    if remaining > 0 and len(bounds):
        chunk_scores = torch.stack([scores[a:b].float().mean() for a, b in bounds.tolist()])
        order = torch.sort(chunk_scores, descending=True, stable=True).indices
        sizes = (bounds[:, 1] - bounds[:, 0])[order]
        # Take chunks best-first until the budget is met; the last one may overshoot it.
        n_take = int(torch.searchsorted(sizes.cumsum(0), remaining).item()) + 1
        for a, b in bounds[order[:n_take]].tolist():
            keep[a:b] = True
    return keep.nonzero().flatten()


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
        raise ValueError("a prefill plan needs at least one kept token")
    if kept.numel() > 1 and not bool((kept[1:] > kept[:-1]).all()):
        raise ValueError("kept indices must be strictly increasing")
    if int(kept[0]) < 0 or int(kept[-1]) >= n:
        raise ValueError(f"kept indices must lie in [0, {n})")
    if contiguous_positions:
        positions = torch.arange(kept.numel(), dtype=torch.int64)
        next_position = kept.numel()
    else:
        positions = kept.clone()
        next_position = n
    kept_segments = prompt.segment_index[kept].tolist()
    kept_list = kept.tolist()
    spans = []
    for index, segment in enumerate(prompt.segments):
        n_tokens = int((prompt.segment_index == index).sum())
        mine = [k for k, s in zip(kept_list, kept_segments, strict=True) if s == index]
        spans.append(
            KeptSpan(
                segment_index=index,
                kind=segment.kind,
                id=segment.id,
                n_tokens=n_tokens,
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
