"""Passage-local reading: the draft reads each passage once, and a request costs it only the rest.

Joint reading runs the draft's layers 0 … exit over every prompt token on every request. Here a
prompt is cut into its head (the tokens before its first passage, or the longest start the
prefix store holds: read before, jointly or as here), its passages (``PromptLayout.units``) and
the rest (separators, the question, the template's tail: the *fresh* tokens). Each passage is
read against an *anchor* (the tokens a RAG prompt of the same system part holds before its first
passage: the prompt's own head, or for a chat with earlier turns or tool messages the canonical
layout ``DraftScorer.anchor`` renders) and itself only, at positions right after the anchor; that
reading depends on nothing else, so the passage store (``passage_store``) keeps it and any later prompt holding the
same passage after the same anchor reuses it. At request time the passages' keys are re-rotated to
where they sit (``passage_kv.rerotate``), and only the fresh tokens run through layers 0 … exit,
attending to the head, the passages and each other in prompt order. The question's and the last
token's queries, the keys every layer records and the hidden states leaving the exit are those of
this reading, in prompt order, so scoring, the reading set and the look-ahead run on them
unchanged. The reading of the prompt up to its question then goes to the prefix store: a
follow-up over the same passages reads its question only.

A passage read alone misses what its neighbours say. ``PassageReading.recompute`` picks passage
tokens read again jointly from layer ``recompute_from`` on: none, all of them (the passages then
keep only the layers below it), each passage's first tokens, the share a first pass scores
highest, or the share whose hidden states a joint pass of that one layer moves most (CacheBlend).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..config import PassageReading
from ..types import SegmentKind
from . import scoring
from .capture import Recorder, recording
from .early_exit import DecoderParts
from .passage_kv import PromptKV, TokenPlaces, UnitReading, read_units, rerotate, run_layers
from .passage_store import PassageEntry, PassageStore, passage_key
from .prefix_store import MIN_PREFIX_TOKENS, PrefixEntry

__all__ = [
    "ANCHOR_KINDS", "PromptLayout", "ReadingPlan", "canonical_anchor", "prompt_layout", "read_prompts",
    "store_passages", "with_head",
]

UNIT_KINDS = (SegmentKind.PASSAGE, SegmentKind.CONTEXT, SegmentKind.TOOL_RESULT)  # read apart
ANCHOR_KINDS = (SegmentKind.INSTRUCTIONS, SegmentKind.TOOL_SCHEMA)  # the system part passages are read after


@dataclass(frozen=True)
class PromptLayout:
    """Where a prompt's passages sit: every passage is read after the token ids ``anchor`` (the
    prompt's own tokens before its first passage, or the system part's canonical layout: see
    ``DraftScorer``); ``units`` are the passages' [start, end) token ranges, in order; ``head``:
    the tokens before them that are read as one (the first passage's start unless set)."""

    anchor: torch.Tensor  # (a,) int64 token ids, on the CPU
    units: tuple[tuple[int, int], ...]
    head: int = -1

    def __post_init__(self) -> None:
        object.__setattr__(self, "anchor", self.anchor.to(torch.int64).cpu())
        if self.head < 0:
            object.__setattr__(self, "head", self.units[0][0] if self.units else 0)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, PromptLayout) and torch.equal(self.anchor, other.anchor)
                and (self.units, self.head) == (other.units, other.head))

    __hash__ = None  # type: ignore[assignment]

    def after(self, m: int) -> PromptLayout:
        """This layout with its first ``m`` tokens read already: the passages that end after them
        (a passage ``m`` cuts through is read whole, so the head stops where it begins)."""
        units = tuple(u for u in self.units if u[1] > m)
        head = min(m, units[0][0]) if units else m
        return PromptLayout(self.anchor, units, max(head, self.head))


def prompt_layout(token_ids: torch.Tensor, segment_index: torch.Tensor, kinds: Sequence[SegmentKind]
                  ) -> PromptLayout | None:
    """The layout of a prompt (``token_ids`` (n,)) whose token i belongs to segment
    ``segment_index[i]`` (-1: template) of kind ``kinds[...]``: each maximal run of one passage,
    context or tool-result segment's tokens is a unit; the anchor is every token before the first
    unit. None when the prompt holds no unit."""
    index = segment_index.to(torch.int64).cpu()
    n = index.numel()
    if n == 0:
        return None
    is_unit = torch.tensor([k in UNIT_KINDS for k in kinds] + [False], dtype=torch.bool)
    in_unit = is_unit[index.clamp(min=-1)] & (index >= 0)  # index -1 reads the trailing False
    change = torch.ones(n, dtype=torch.bool)
    change[1:] = index[1:] != index[:-1]
    starts = (change & in_unit).nonzero().flatten().tolist()
    if not starts:
        return None
    bounds = change.nonzero().flatten().tolist() + [n]
    units = tuple((start, next(b for b in bounds if b > start)) for start in starts)
    return PromptLayout(token_ids[: units[0][0]], units)


def canonical_anchor(token_ids: torch.Tensor, segment_index: torch.Tensor, kinds: Sequence[SegmentKind]
                     ) -> torch.Tensor | None:
    """A canonical prompt's anchor (``token_ids``, ``segment_index``: a prompt of the system part's
    segments, one passage and a question, as ``DraftScorer.anchor`` renders it): its tokens
    before the passage. None when it holds no passage."""
    layout = prompt_layout(token_ids, segment_index, kinds)
    return None if layout is None else layout.anchor


@dataclass(frozen=True)
class ReadingPlan:
    """One call's passage reading: the settings, the draft's exit layer and the layer recomputed
    tokens read jointly from, the store and the draft's fingerprint (part of every store key)."""

    reading: PassageReading
    exit_layer: int
    start_layer: int  # recompute_from, resolved
    store: PassageStore
    draft: str  # the draft's fingerprint (``DraftModel.fingerprint``)
    inv_freq: torch.Tensor
    pool_kernel: int  # the scoring's average pool (a scored recompute's first pass)

    @property
    def unit(self) -> UnitReading:
        """What a passage's reading keeps: under ``"all"`` the layers below the start layer and the
        states entering it (every later layer is recomputed); under any other rule every layer to
        the exit and the states entering and leaving the start layer, so that the rules other
        than ``"all"`` share one reading of each passage."""
        if self.reading.recompute == "all":
            return UnitReading(self.start_layer, self.exit_layer, self.start_layer, False)
        return UnitReading(self.exit_layer + 1, self.exit_layer, self.start_layer, self.start_layer < self.exit_layer)

    def key(self, anchor: torch.Tensor, passage: torch.Tensor, namespace: str) -> bytes:
        return passage_key(self.draft, ("passages-v2", self.unit), anchor, passage, namespace)


def _entries(parts: DecoderParts, plan: ReadingPlan, ids: torch.Tensor, layout: PromptLayout,
             anchor_kv: tuple[list[torch.Tensor], list[torch.Tensor]], namespace: str
             ) -> tuple[list[PassageEntry], int]:
    """Each unit's entry: from the store, or read now (misses of the same passage once) and
    stored; and how many passages were read now. ``anchor_kv``: the anchor's keys and values."""
    keys = [plan.key(layout.anchor, ids[s:e], namespace) for s, e in layout.units]
    found: dict[bytes, PassageEntry] = {}
    missing: dict[bytes, torch.Tensor] = {}
    for key, (s, e) in zip(keys, layout.units, strict=True):
        if key in found or key in missing:
            continue
        entry = plan.store.find(key, ids[s:e])
        if entry is None:
            missing[key] = ids[s:e]
        else:
            found[key] = entry
    if missing:
        for key, entry in zip(missing, read_units(parts, plan.unit, anchor_kv, list(missing.values())), strict=True):
            plan.store.add(key, entry)
            found[key] = entry
    return [found[key] for key in keys], len(missing)


def _anchor_kv(anchor: PrefixEntry) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return list(anchor.keys), list(anchor.values)


def store_passages(parts: DecoderParts, plan: ReadingPlan, ids: torch.Tensor, layout: PromptLayout,
                   anchor: PrefixEntry, namespace: str) -> tuple[int, int]:
    """Read the passages of a prompt (``ids``, its ``layout``; ``anchor``: the prefix-store entry of
    ``layout.anchor``) that the store does not hold yet, and keep them, with no question and no
    scores: what reading a corpus at indexing time does. Returns (passages found, passages read)."""
    _, read = _entries(parts, plan, ids.to(anchor.hidden.device), layout, _anchor_kv(anchor), namespace)
    return len(layout.units) - read, read


@dataclass
class _Prompt:
    """One prompt's reading in progress: its buffers in prompt order, its hidden states (n,
    d_model) leaving the exit layer, entering the start layer and leaving it (passage tokens'),
    and its fresh tokens (sorted prompt indices read on every request)."""

    kv: PromptKV
    hidden: torch.Tensor
    entering: torch.Tensor
    following: torch.Tensor
    fresh: torch.Tensor


def _assemble(plan: ReadingPlan, ids: torch.Tensor, layout: PromptLayout, head: PrefixEntry,
              entries: list[PassageEntry]) -> _Prompt:
    """The prompt's buffers: the head's keys and values, each passage's re-rotated to where it
    sits (the layers its entry holds; the rest are recomputed)."""
    n, h = ids.numel(), layout.head
    device = head.keys[0].device
    shift = torch.zeros(n, dtype=torch.int64, device=device)
    keys, values = [], []
    for i in range(plan.exit_layer + 1):
        k = head.keys[i].new_zeros(1, head.keys[i].shape[1], n, head.keys[i].shape[3])
        v = torch.zeros_like(k)
        k[:, :, :h], v[:, :, :h] = head.keys[i][:1], head.values[i][:1]
        for (s, e), entry in zip(layout.units, entries, strict=True):
            if i < len(entry.keys):
                k[0, :, s:e], v[0, :, s:e] = entry.keys[i], entry.values[i]
        keys.append(k)
        values.append(v)
    hidden = head.hidden.new_zeros(n, head.hidden.shape[-1])
    entering, following = torch.zeros_like(hidden), torch.zeros_like(hidden)
    hidden[:h] = head.hidden[0, :h]
    covered = torch.zeros(n, dtype=torch.bool)
    covered[:h] = True
    for (s, e), entry in zip(layout.units, entries, strict=True):
        shift[s:e] = s - entry.start
        for states, kept in ((hidden, entry.hidden), (entering, entry.entering), (following, entry.following)):
            if kept is not None:
                states[s:e] = kept
        covered[s:e] = True
    moved = (shift != 0).nonzero().flatten()
    if moved.numel():
        for k in keys:
            k[:, :, moved] = rerotate(k[:, :, moved], shift[moved], plan.inv_freq)
    return _Prompt(PromptKV(keys, values), hidden, entering, following, (~covered).nonzero().flatten().to(device))


def _forward(parts: DecoderParts, prompt: _Prompt, tokens: torch.Tensor, h: torch.Tensor, layers: range,
             recorder: Recorder) -> torch.Tensor:
    """``tokens`` (sorted prompt indices; hidden states ``h`` (1, q, d_model) entering the first of
    ``layers``) through ``layers``, each reading every column up to its own; ``recorder`` records
    the question's and the last token's queries among them."""
    n = prompt.hidden.shape[0]
    recorder.query_index = [torch.searchsorted(tokens, recorder.rows[0].to(tokens.device))]
    mask = (torch.arange(n, device=tokens.device).unsqueeze(0) <= tokens.unsqueeze(1)).reshape(1, 1, -1, n)
    with recording(recorder):
        out, _ = run_layers(parts, prompt.kv, layers, h, TokenPlaces(tokens, tokens.unsqueeze(0), mask))
    return out


def _joined(prompt: _Prompt, tokens: torch.Tensor, fresh_h: torch.Tensor) -> torch.Tensor:
    """(1, q, d_model) entering the start layer for ``tokens``: the fresh ones' ``fresh_h``, the
    passages' kept states."""
    h = prompt.entering[tokens].unsqueeze(0)
    h[0, torch.searchsorted(tokens, prompt.fresh)] = fresh_h[0]
    return h


def _units(layout: PromptLayout) -> list[torch.Tensor]:
    return [torch.arange(s, e) for s, e in layout.units]


def _top(values: torch.Tensor, tokens: torch.Tensor, share: float) -> torch.Tensor:
    """The ``share`` of ``tokens`` (prompt indices) with the highest ``values`` (per token), sorted."""
    count = min(tokens.numel(), math.ceil(share * tokens.numel()))
    return tokens[values.topk(count).indices.cpu()].sort().values


def _recomputed(parts: DecoderParts, plan: ReadingPlan, prompt: _Prompt, layout: PromptLayout, h: torch.Tensor,
                recorder: Recorder) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The tokens read jointly from the start layer on and the hidden states entering the layer
    they start at (fresh tokens and the recomputed passage tokens), and that layer: the start
    layer, or the one after it when a joint pass of the start layer chose them (deviation)."""
    kind, start, share, fresh = plan.reading.recompute, plan.start_layer, plan.reading.recompute_share, prompt.fresh
    spans = _units(layout)
    passage = torch.cat(spans) if spans else torch.empty(0, dtype=torch.int64)
    if kind == "deviation":  # every token through the start layer jointly; the most moved go on
        every = torch.cat([fresh, passage.to(fresh.device)]).sort().values
        out = _forward(parts, prompt, every, _joined(prompt, every, h), range(start, start + 1), recorder)
        at = torch.searchsorted(every, passage.to(every.device))
        local = prompt.following[passage]
        moved = (out[0, at] - local).float().norm(dim=-1) / local.float().norm(dim=-1).clamp_min(1e-6)
        tokens = torch.cat([fresh, _top(moved, passage, share).to(fresh.device)]).sort().values
        return tokens, out[:, torch.searchsorted(every, tokens)], start + 1
    if kind == "scored":  # a first pass of the fresh tokens; the passage tokens they attend most go on
        probe = Recorder([prompt.hidden.shape[0]], [recorder.questions[0]], recorder.layers)
        _forward(parts, prompt, fresh, h, range(start, plan.exit_layer + 1), probe)
        again = _top(_first_scores(probe, plan.pool_kernel).cpu()[passage], passage, share)
    elif kind == "first" and spans:
        again = torch.cat([span[: plan.reading.first_tokens] for span in spans])
    else:
        again = passage if kind == "all" else passage[:0]
    tokens = torch.cat([fresh, again.to(fresh.device)]).sort().values
    return tokens, _joined(prompt, tokens, h), start


def read_prompt(parts: DecoderParts, plan: ReadingPlan, ids: torch.Tensor, layout: PromptLayout,
                states: tuple[PrefixEntry, PrefixEntry], namespace: str, recorder: Recorder
                ) -> tuple[PromptKV, torch.Tensor]:
    """One prompt read with its passages apart: (its keys and values of layers 0 … exit in prompt
    order; the hidden states (n, d_model) leaving the exit layer). ``states``: the prefix store's
    entries of its first ``layout.head`` tokens and of ``layout.anchor``; ``recorder``: the
    prompt's own (its question, the recorded layers), which receives the rows a joint reading
    records and in ``stores`` the passages found and read."""
    head, anchor = states
    entries, read = _entries(parts, plan, ids, layout, _anchor_kv(anchor), namespace)
    prompt = _assemble(plan, ids, layout, head, entries)
    recorder.stores[0] = (0, len(layout.units) - read, read)
    fresh = prompt.fresh
    if not bool(torch.isin(recorder.rows[0].to(fresh.device), fresh).all()):
        raise ValueError("the question and the last token must lie outside the passages")
    h = _forward(parts, prompt, fresh, parts.embed(ids[fresh].unsqueeze(0)), range(plan.start_layer), recorder)
    tokens, entering, first = _recomputed(parts, plan, prompt, layout, h, recorder)
    out = _forward(parts, prompt, tokens, entering, range(first, plan.exit_layer + 1), recorder)
    prompt.hidden[tokens] = out[0]
    return prompt.kv, prompt.hidden


def _first_scores(recorder: Recorder, pool_kernel: int) -> torch.Tensor:
    """(n,) importance from a first pass's rows (the question's and the last token's queries)."""
    positions = recorder.rows[0]
    rows = torch.stack([
        scoring.layer_rows(recorder.queries[layer][0][0], recorder.keys[layer][0], recorder.scaling[layer],
                           pool_kernel, positions=positions.to(recorder.keys[layer][0].device))
        for layer in sorted(recorder.keys)
    ])
    return scoring.importance(rows)


def _kept_start(ids: torch.Tensor, recorder: Recorder, kv: PromptKV, hidden: torch.Tensor, exit_layer: int,
                namespace: str) -> PrefixEntry | None:
    """The prompt's reading up to its question (or last token), for the prefix store: a follow-up
    over the same passages then reads its question only. None when that start is too short."""
    rows = recorder.rows[0]
    end = int(rows.min())
    if end < MIN_PREFIX_TOKENS:
        return None
    return PrefixEntry(ids[:end].to(torch.int64).cpu(), exit_layer, tuple(k[:, :, :end].clone() for k in kv.keys),
                       tuple(v[:, :, :end].clone() for v in kv.values), hidden[:end].unsqueeze(0).clone(), namespace)


def read_prompts(parts: DecoderParts, plan: ReadingPlan, batch: Recorder, token_ids: Sequence[torch.Tensor],
                 layouts: Sequence[PromptLayout], heads: Sequence[tuple[PrefixEntry, PrefixEntry, int]],
                 namespace: str) -> tuple[Any, torch.Tensor, list[PrefixEntry | None]]:
    """``read_prompt`` for each prompt of a right-padded batch, their rows into ``batch``: (a KV
    cache of layers 0 … exit, (batch, kv_heads, width, head_dim) each, zeros after each prompt;
    the hidden states (batch, width, d_model) leaving the exit layer; each prompt's reading up to
    its question, for the prefix store). ``heads``: each prompt's head (a prefix-store entry of
    ``layout.head`` tokens), its anchor's entry, and how many head tokens the store already held."""
    from transformers import DynamicCache

    width = max(int(t.numel()) for t in token_ids)
    caches, hiddens, starts = [], [], []
    for b, (ids, layout, (head, anchor, cached)) in enumerate(zip(token_ids, layouts, heads, strict=True)):
        question = batch.questions[b] if batch.questions[b].numel() else None
        ids = ids.to(head.hidden.device)
        recorder = Recorder([ids.numel()], [question], batch.layers)
        kv, hidden = read_prompt(parts, plan, ids, layout, (head, anchor), namespace, recorder)
        batch.adopt(b, recorder)
        _, found, read = recorder.stores[0] or (0, 0, 0)
        batch.stores[b] = (cached, found, read)
        caches.append(kv)
        hiddens.append(torch.nn.functional.pad(hidden, (0, 0, 0, width - hidden.shape[0])))
        starts.append(_kept_start(ids, recorder, kv, hidden, plan.exit_layer, namespace))
    cache = DynamicCache()
    for i in range(plan.exit_layer + 1):
        pad = [(0, 0, 0, width - kv.keys[i].shape[2]) for kv in caches]
        cache.update(torch.cat([torch.nn.functional.pad(kv.keys[i], p) for kv, p in zip(caches, pad, strict=True)]),
                     torch.cat([torch.nn.functional.pad(kv.values[i], p) for kv, p in zip(caches, pad, strict=True)]),
                     i)
    return cache, torch.stack(hiddens), starts


def with_head(layout: PromptLayout, stored: int) -> PromptLayout:
    """``layout`` after a stored start of ``stored`` tokens (``PromptLayout.after``); unchanged when
    the store holds less than the tokens before its first passage."""
    return layout.after(stored) if stored > layout.head else layout
