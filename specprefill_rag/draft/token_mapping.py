"""Draft token scores → main token scores through character offsets. Pure torch, no models.

A draft from another model family tokenizes (and chat-templates) the prompt its own way, so
its scores cannot be read index by index. Both prompts are rendered from the same segments,
and every segment's text appears verbatim in both rendered texts. Each segment's characters
are laid out on one shared *content axis* (segment after segment, in segment order, with a
wide gap between segments), and both tokenizations are placed on it through their character
offsets, relative to the segment's start in their own text. Template text (role markers,
special tokens, passage headers) is never mapped: the main prompt protects it anyway.

Rule, for every main token inside a segment:

- its score is the **maximum** score of the draft tokens whose character spans overlap its
  span (a main token that straddles two draft tokens takes the higher; a draft token that
  straddles two main tokens gives its score to both). Draft tokens that cross a segment
  boundary are clipped to the segment, so they count for the text they share with it;
- when it overlaps no draft token (e.g. whitespace one tokenizer merges into a token and the
  other leaves out of every span), it takes the score of the **nearest** draft token on the
  content axis, the higher one on a tie; a segment with no draft token at all borrows from
  the nearest segment;
- main template tokens (segment index -1) get 0: they are always kept, selection never reads them.

Offsets are in characters (as fast tokenizers report them), so multi-byte characters need no
care: byte-level pieces of one character share that character's span. Cost: O(N log N) —
a sparse table answers the range maxima, ``searchsorted`` finds the ranges. Whether a draft's
scores need mapping at all is ``needs_mapping``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import ConfigError, InputError
from ..types import AssembledPrompt

__all__ = ["SegmentSpan", "content_intervals", "map_scores", "needs_mapping", "overlap_max"]

SegmentSpan = tuple[int, int, int]  # (segment index, start, end) characters in the rendered text
_GAP = 1 << 20  # characters between segments on the content axis: a neighbour in the same segment always wins


def overlap_max(src: torch.Tensor, src_scores: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Per destination interval, the max score of the source intervals overlapping it.

    src (n_src, 2) int64 [start, end) with start sorted ascending and end > start;
    src_scores (n_src,) float; dst (n_dst, 2) int64 → (n_dst,) float32. Intervals overlap when
    they share a character. A destination overlapping none takes the nearest source interval's
    score (smallest character gap; the higher score on a tie).
    """
    if src.numel() == 0:
        raise ValueError("no source intervals to map scores from")
    if src.shape[0] != src_scores.numel():
        raise ValueError(f"{src.shape[0]} source intervals but {src_scores.numel()} scores")
    scores = src_scores.float()
    starts = src[:, 0].contiguous()
    # Ends sorted for searchsorted; for well-formed offsets this is the ends themselves.
    ends = torch.cummax(src[:, 1], dim=0).values.contiguous()
    d_start, d_end = dst[:, 0].contiguous(), dst[:, 1].contiguous()
    lo = torch.searchsorted(ends, d_start, right=True)  # first source ending after d_start
    hi = torch.searchsorted(starts, d_end, right=False) - 1  # last source starting before d_end
    out = torch.empty(dst.shape[0], dtype=torch.float32)
    hit = lo <= hi
    if bool(hit.any()):
        out[hit] = _range_max(scores, lo[hit], hi[hit])
    miss = ~hit
    if bool(miss.any()):
        n = starts.numel()
        left = hi[miss].clamp(min=0)  # the last source starting before the destination's end
        right = lo[miss].clamp(max=n - 1)  # the first source ending after its start
        far = torch.iinfo(torch.int64).max
        gap_left = torch.where(hi[miss] >= 0, d_start[miss] - src[left, 1], far)
        gap_right = torch.where(lo[miss] < n, starts[right] - d_end[miss], far)
        s_left, s_right = scores[left], scores[right]
        out[miss] = torch.where(
            gap_left < gap_right, s_left, torch.where(gap_right < gap_left, s_right, torch.maximum(s_left, s_right))
        )
    return out


def _range_max(values: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """max(values[lo[q] : hi[q] + 1]) for every query q, by a sparse table (O(N log N) to build)."""
    n = values.numel()
    levels = [values]
    width = 1
    while 2 * width <= n:
        prev = levels[-1]
        levels.append(torch.maximum(prev[:-width], prev[width:]))
        width *= 2
    table = torch.full((len(levels), n), float("-inf"))
    for level_index, level in enumerate(levels):
        table[level_index, : level.numel()] = level
    length = hi - lo + 1
    k = torch.floor(torch.log2(length.double())).long()  # the level whose two windows cover [lo, hi]
    # Guard against log2 rounding at exact powers of two.
    k = torch.where((1 << (k + 1)) <= length, k + 1, k)
    k = torch.where((1 << k) > length, k - 1, k)
    return torch.maximum(table[k, lo], table[k, hi - (1 << k) + 1])


def content_intervals(
    offsets: torch.Tensor, spans: Sequence[SegmentSpan], bases: dict[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens overlapping each segment span, clipped to it and moved onto the content axis.

    offsets (n, 2) int64; spans of the rendered text; ``bases[segment]`` the segment's start on
    the content axis. Returns (intervals (m, 2) int64 sorted by start, token index (m,) int64);
    a token crossing a segment boundary appears once per segment it touches.
    """
    starts, ends = offsets[:, 0], offsets[:, 1]
    parts, owners = [], []
    for segment, a, b in spans:  # a loop over segments, not tokens
        inside = ((starts < b) & (ends > a) & (ends > starts)).nonzero().flatten()
        clipped = torch.stack([starts[inside].clamp(min=a), ends[inside].clamp(max=b)], dim=1)
        parts.append(clipped - a + bases[segment])
        owners.append(inside)
    if not parts:
        return torch.empty(0, 2, dtype=torch.int64), torch.empty(0, dtype=torch.int64)
    intervals, owner = torch.cat(parts), torch.cat(owners)
    order = torch.argsort(intervals[:, 0], stable=True)
    return intervals[order], owner[order]


def _check_aligned(draft: AssembledPrompt, main: AssembledPrompt) -> None:
    d = {s: (a, b) for s, a, b in draft.segment_spans}
    m = {s: (a, b) for s, a, b in main.segment_spans}
    extra = d.keys() - m.keys()  # what the draft alone reads (the echoed question) comes after them all
    if not m.keys() <= d.keys() or any(s < len(main.segments) for s in extra):
        raise ValueError(
            f"cannot align the draft and main prompts: segments {sorted(d)} in the draft's text, "
            f"{sorted(m)} in the main model's"
        )
    for segment, (a, b) in m.items():
        da, db = d[segment]
        if draft.text[da:db] != main.text[a:b]:
            raise ValueError(
                f"cannot align the draft and main prompts: segment {segment} reads differently in the "
                f"two rendered texts ({draft.text[da:db][:40]!r}… vs {main.text[a:b][:40]!r}…); "
                "a chat template rewrote the content"
            )


def map_scores(draft_scores: torch.Tensor, draft: AssembledPrompt, main: AssembledPrompt) -> torch.Tensor:
    """Scores of the draft's tokens (n_draft,) → scores of the main prompt's tokens (n_main,).

    ``draft`` and ``main`` are the same segments assembled with each tokenizer (or each its own
    way: the draft may read the question echoed, ``prompt.echoed_question``); each carries its
    segments' character spans (``AssembledPrompt.segment_spans``). Segments only the draft reads,
    past the main prompt's, give no score. The rule is in the module docstring. Raises
    ``ValueError`` when a segment's text differs between the two renderings.
    """
    if draft_scores.numel() != draft.n_tokens:
        raise ValueError(f"{draft_scores.numel()} draft scores for a draft prompt of {draft.n_tokens} tokens")
    _check_aligned(draft, main)
    bases: dict[int, int] = {}
    position = 0
    for segment, a, b in sorted(main.segment_spans):
        bases[segment] = position
        position += (b - a) + _GAP
    src, owner = content_intervals(draft.offsets, [span for span in draft.segment_spans if span[0] in bases], bases)
    out = torch.zeros(main.n_tokens, dtype=torch.float32)
    index = main.segment_index
    mapped = (index >= 0).nonzero().flatten()
    if mapped.numel() == 0:
        return out
    if src.numel() == 0:
        raise ValueError(
            "cannot align the draft and main prompts: no draft token overlaps the segments' text "
            "(does the draft tokenizer report character offsets?)"
        )
    shift = torch.zeros(int(index.max()) + 1, dtype=torch.int64)
    for segment, a, _ in main.segment_spans:
        if segment < shift.numel():
            shift[segment] = bases[segment] - a
    dst = main.offsets[mapped] + shift[index[mapped]].unsqueeze(1)  # (n_mapped, 2) content axis
    out[mapped] = overlap_max(src, draft_scores.float().cpu()[owner], dst)
    return out


def _same_tokenizer(draft: Any, main: Any) -> bool:
    if draft is main:
        return True
    same = type(draft).__name__ == type(main).__name__ and len(draft) == len(main)
    return same and draft.get_vocab() == main.get_vocab()


def _tokenizer_error(draft: Any, main: Any) -> ConfigError:
    return ConfigError(
        f"the draft tokenizer ({type(draft).__name__}, {len(draft)} tokens) differs from the "
        f"main model's ({type(main).__name__}, {len(main)} tokens). With "
        "DraftConfig(tokenizer_mapping='same') the draft must share the main model's tokenizer: use a "
        "draft of the same family (e.g. qwen2.5-coder-0.5b-instruct for qwen2.5-coder-1.5b-instruct), "
        "or tokenizer_mapping='auto' to map scores through character offsets"
    )


def needs_mapping(draft: Any, main: Any, mode: str) -> bool:
    """Whether the scores of a draft with tokenizer ``draft`` must be mapped onto the tokens of
    ``main`` under ``DraftConfig.tokenizer_mapping`` ``mode``; ``ConfigError`` when "same" is asked
    of two tokenizers, ``InputError`` when mapping needs offsets a slow tokenizer lacks."""
    same = _same_tokenizer(draft, main)
    if mode == "same" or (mode == "auto" and same):
        if not same:
            raise _tokenizer_error(draft, main)
        return False
    for role, tok in (("draft", draft), ("main", main)):
        if not getattr(tok, "is_fast", False):
            raise InputError(
                f"the {role} tokenizer ({type(tok).__name__}) is a slow tokenizer without character "
                "offsets, which mapping scores between two tokenizers needs: load the fast one "
                "(AutoTokenizer.from_pretrained(..., use_fast=True)) or use a draft with the main "
                "model's tokenizer"
            )
    return True
