"""Passage-local reading: the draft reads each passage once, and a request costs it only the rest.

Joint reading runs the draft's layers 0 … exit over every prompt token on every request. Here a
prompt is cut into its head (the tokens before its first passage: the prefix store's, read as
jointly as ever), its passages (``PromptLayout.units``) and the rest (separators, the question,
the template's tail: the *fresh* tokens). Each passage is read against the prompt's *anchor* (its
first tokens, up to the first segment that is not the system part) and itself only, at positions
right after the anchor; that reading depends on nothing else, so the passage store
(``passage_store``) keeps it and any later prompt holding the same passage after the same anchor
reuses it. At request time the passages' keys are re-rotated to where they sit (``rerotate``: RoPE
is a rotation by position, so a key computed at p becomes the key at p + d by a rotation by d),
and only the fresh tokens run through layers 0 … exit, attending to the head, the passages and
each other in prompt order (``PromptKV``). The question's and the last token's queries, the keys
every layer records and the hidden states leaving the exit are those of this reading, in prompt
order, so scoring, the reading set and the look-ahead run on them unchanged.

A passage read alone misses what its neighbours say. ``PassageReading.recompute`` picks passage
tokens that are read again jointly from layer ``recompute_from`` on (their hidden states entering
that layer are kept in the store too): none, all of them, each passage's first tokens, or the
share a first pass scores highest.
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
from .batching import length_buckets
from .capture import Recorder, recording
from .early_exit import DecoderParts
from .passage_store import PassageEntry, PassageStore, passage_key

__all__ = [
    "PromptKV", "PromptLayout", "ReadingPlan", "prompt_layout", "read_prompts", "rerotate", "rotates_plainly",
    "store_passages",
]

UNIT_KINDS = (SegmentKind.PASSAGE, SegmentKind.CONTEXT, SegmentKind.TOOL_RESULT)  # read apart
ANCHOR_KINDS = (SegmentKind.INSTRUCTIONS, SegmentKind.TOOL_SCHEMA)  # the system part passages are read after
UNIT_PAD_LIMIT = 0.25  # padding share a batch of passages read together may hold (``batching.length_buckets``)


@dataclass(frozen=True)
class PromptLayout:
    """Where a prompt's passages sit: every passage is read after its first ``anchor`` tokens;
    ``units`` are the passages' [start, end) token ranges, in order, after the anchor."""

    anchor: int
    units: tuple[tuple[int, int], ...]

    @property
    def head(self) -> int:
        """The tokens before the first passage (read jointly, as the prefix store's head)."""
        return self.units[0][0] if self.units else 0


def prompt_layout(segment_index: torch.Tensor, kinds: Sequence[SegmentKind]) -> PromptLayout | None:
    """The layout of a prompt whose token i belongs to segment ``segment_index[i]`` (-1: template)
    of kind ``kinds[...]``: each maximal run of one passage, context or tool-result segment's
    tokens is a unit; the anchor ends at the first token of a segment outside the system part
    (instructions, tool schemas), or at the first unit. None when the prompt holds no unit."""
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
    ends = [*(s for s in (change.nonzero().flatten().tolist() + [n]) if s > starts[0])]
    units = []
    for start in starts:
        end = next(e for e in ends if e > start)
        units.append((start, end))
    system = torch.tensor([k in ANCHOR_KINDS for k in kinds] + [True], dtype=torch.bool)
    other = ((index >= 0) & ~system[index.clamp(min=-1)]).nonzero().flatten()
    anchor = min(units[0][0], int(other[0]) if other.numel() else n)
    return PromptLayout(anchor, tuple(units))


# -- rotary keys ----------------------------------------------------------------------------------


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rerotate(keys: torch.Tensor, shift: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``keys`` (..., n, head_dim), post-RoPE, each moved ``shift[i]`` positions on (n,) int64:
    rotated by ``shift`` times each frequency of ``inv_freq`` (head_dim / 2,) (the rotate-half
    layout of Llama, Qwen, Mistral). Angles in float64, the product in float32, back in the keys'
    dtype. A rotary scaling factor commutes with the rotation, so it needs no care."""
    angle = shift.to(torch.float64).unsqueeze(-1) * inv_freq.to(torch.float64, ).cpu().to(shift.device).unsqueeze(0)
    angle = torch.cat([angle, angle], dim=-1)  # (n, head_dim)
    cos, sin = angle.cos().float(), angle.sin().float()
    k = keys.float()
    return (k * cos + _rotate_half(k) * sin).to(keys.dtype)


@torch.inference_mode()
def rotates_plainly(model: Any, parts: DecoderParts) -> bool:
    """Whether ``model``'s keys move with ``rerotate``: the keys of a few tokens computed at
    positions 0 … and at 7 … equal each other re-rotated (a rotate-half RoPE with fixed
    frequencies; not so for dynamic scaling or another layout). Checked on layer 0."""
    inv_freq = getattr(parts.rotary, "inv_freq", None)
    if inv_freq is None or getattr(parts.rotary, "rope_type", "default") in ("dynamic", "longrope"):
        return False
    ids = torch.arange(1, 5, device=inv_freq.device).unsqueeze(0) % model.config.vocab_size
    found = []
    with recording(None):
        for first in (0, 7):
            kept = _Keys()
            positions = torch.arange(first, first + 4, device=ids.device).unsqueeze(0)
            embeddings = parts.rotary(parts.embed(ids), positions)
            parts.layers[0](parts.embed(ids), attention_mask=None, position_ids=positions, past_key_values=kept,
                            use_cache=True, position_embeddings=embeddings)
            found.append(kept.keys.float())
    if found[0].shape[-1] != 2 * inv_freq.numel():
        return False
    moved = rerotate(found[0], torch.full((4,), 7, device=found[0].device), inv_freq)
    return bool(torch.allclose(moved, found[1], rtol=2e-2, atol=2e-2 * float(found[1].abs().max())))


class _Keys:
    """A cache that keeps the last keys a layer hands it (``rotates_plainly``)."""

    keys = torch.empty(0)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys = key
        return key, value


# -- the prompt's keys and values in prompt order --------------------------------------------------


class PromptKV:
    """Keys and values of layers 0 … exit of prompts in buffers (batch, kv_heads, n, head_dim) in
    prompt order. ``update`` (what a decoder layer calls on its cache) writes the forward's
    tokens at the prompt indices ``slots`` and returns the whole buffer, which the layer's
    attention reads under the forward's mask."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.keys, self.values = keys, values
        self.slots = torch.empty(0, dtype=torch.int64)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys[layer_idx].index_copy_(2, self.slots, key.to(self.keys[layer_idx].dtype))
        self.values[layer_idx].index_copy_(2, self.slots, value.to(self.values[layer_idx].dtype))
        return self.keys[layer_idx], self.values[layer_idx]


def _run(parts: DecoderParts, kv: PromptKV, layers: range, h: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor,
         positions: torch.Tensor, entering: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``h`` (batch, q, d_model) of the prompt tokens at ``positions`` (batch, q) through decoder
    ``layers``, their keys and values written at ``tokens`` (q,) of ``kv``, each query reading the
    columns ``mask`` (batch, 1, q, width) allows. Returns the hidden states leaving the last layer
    and, when ``entering`` is one of ``layers``, those entering it."""
    kv.slots = tokens
    embeddings = parts.rotary(h, positions)
    before = None
    for i in layers:
        if i == entering:
            before = h
        out = parts.layers[i](h, attention_mask=mask, position_ids=positions, past_key_values=kv, use_cache=True,
                              position_embeddings=embeddings)
        h = out[0] if isinstance(out, tuple) else out
    return h, before


# -- reading passages apart -----------------------------------------------------------------------


@dataclass(frozen=True)
class ReadingPlan:
    """One call's passage reading: the settings, the draft's exit layer and the layer recomputed
    tokens read jointly from, the store and the draft's fingerprint (part of every store key)."""

    reading: PassageReading
    exit_layer: int
    start_layer: int  # recompute_from, resolved: hidden states entering it are kept per passage
    store: PassageStore
    draft: str  # the draft's fingerprint (``DraftModel.fingerprint``)
    inv_freq: torch.Tensor
    pool_kernel: int  # the scoring's average pool (a scored recompute's first pass)

    def key(self, anchor: torch.Tensor, passage: torch.Tensor, namespace: str) -> bytes:
        return passage_key(self.draft, ("passages-v1", self.exit_layer, self.start_layer), anchor, passage, namespace)


def read_units(parts: DecoderParts, plan: ReadingPlan, anchor_kv: tuple[list[torch.Tensor], list[torch.Tensor]],
               units: Sequence[torch.Tensor]) -> list[PassageEntry]:
    """Each of ``units`` (token ids (m,) each) read after the anchor (``anchor_kv``: its keys and
    values per layer 0 … exit, (1, kv_heads, a, head_dim)) and itself only, at positions a …, in
    right-padded batches of near-equal lengths: their entries."""
    out: list[PassageEntry | None] = [None] * len(units)
    for group in length_buckets([int(u.numel()) for u in units], UNIT_PAD_LIMIT):
        for i, entry in zip(group, _read_group(parts, plan, anchor_kv, [units[i] for i in group]), strict=True):
            out[i] = entry
    return [e for e in out if e is not None]


def _read_group(parts: DecoderParts, plan: ReadingPlan, anchor_kv: tuple[list[torch.Tensor], list[torch.Tensor]],
                units: Sequence[torch.Tensor]) -> list[PassageEntry]:
    keys0, values0 = anchor_kv
    a, device = keys0[0].shape[2], keys0[0].device
    lengths = [int(u.numel()) for u in units]
    batch, width = len(units), max(lengths)
    ids = torch.zeros(batch, width, dtype=torch.int64, device=device)
    for b, u in enumerate(units):
        ids[b, : lengths[b]] = u.to(device)

    def buffer(anchor: torch.Tensor) -> torch.Tensor:
        out = anchor.new_zeros(batch, anchor.shape[1], a + width, anchor.shape[3])
        out[:, :, :a] = anchor
        return out

    kv = PromptKV([buffer(k) for k in keys0], [buffer(v) for v in values0])
    valid = torch.arange(width, device=device).unsqueeze(0) < torch.tensor(lengths, device=device).unsqueeze(1)
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    own = causal.unsqueeze(0) & valid.unsqueeze(1)  # (batch, width, width)
    own |= torch.eye(width, dtype=torch.bool, device=device)  # a padding row reads itself: no empty row
    mask = torch.cat([torch.ones(batch, width, a, dtype=torch.bool, device=device), own], dim=2).unsqueeze(1)
    positions = (a + torch.arange(width, device=device)).unsqueeze(0).expand(batch, -1)
    with recording(None):
        h, entering = _run(parts, kv, range(plan.exit_layer + 1), parts.embed(ids),
                           a + torch.arange(width, device=device), mask, positions, entering=plan.start_layer)
    if entering is None:  # the start layer is the first one: the embeddings enter it
        entering = parts.embed(ids)
    return [
        PassageEntry(
            token_ids=units[b].to(torch.int64).cpu(), start=a,
            keys=tuple(k[b, :, a: a + m].clone() for k in kv.keys[: plan.exit_layer + 1]),
            values=tuple(v[b, :, a: a + m].clone() for v in kv.values[: plan.exit_layer + 1]),
            hidden=h[b, :m].clone(), entering=entering[b, :m].clone(),
        )
        for b, m in enumerate(lengths)
    ]


def _entries(parts: DecoderParts, plan: ReadingPlan, ids: torch.Tensor, layout: PromptLayout,
             head_kv: tuple[list[torch.Tensor], list[torch.Tensor]], namespace: str
             ) -> tuple[list[PassageEntry], int]:
    """Each unit's entry: from the store, or read now (misses of the same passage once) and
    stored; and how many passages were read now."""
    a = layout.anchor
    anchor_ids = ids[:a]
    keys = [plan.key(anchor_ids, ids[s:e], namespace) for s, e in layout.units]
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
        anchor_kv = ([k[:, :, :a] for k in head_kv[0]], [v[:, :, :a] for v in head_kv[1]])
        for key, entry in zip(missing, read_units(parts, plan, anchor_kv, list(missing.values())), strict=True):
            plan.store.add(key, entry)
            found[key] = entry
    return [found[key] for key in keys], len(missing)


def store_passages(parts: DecoderParts, plan: ReadingPlan, ids: torch.Tensor, layout: PromptLayout, head: Any,
                   namespace: str) -> tuple[int, int]:
    """Read the passages of a prompt (``ids``, its ``layout``, its ``head``'s prefix-store entry)
    that the store does not hold yet, and keep them, with no question and no scores: what reading
    a corpus at indexing time does. Returns (passages found, passages read)."""
    ids = ids.to(head.hidden.device)
    _, read = _entries(parts, plan, ids, layout, (list(head.keys), list(head.values)), namespace)
    return len(layout.units) - read, read


def _recompute_set(plan: ReadingPlan, layout: PromptLayout, first_scores: torch.Tensor | None) -> torch.Tensor:
    """The passage tokens (sorted prompt indices) read jointly from the start layer on."""
    kind = plan.reading.recompute
    spans = [torch.arange(s, e) for s, e in layout.units]
    if kind == "none":
        return torch.empty(0, dtype=torch.int64)
    if kind == "all":
        return torch.cat(spans)
    if kind == "first":
        return torch.cat([span[: plan.reading.first_tokens] for span in spans])
    assert first_scores is not None, "a scored recompute needs a first pass's scores"
    tokens = torch.cat(spans)
    count = min(tokens.numel(), math.ceil(plan.reading.recompute_share * tokens.numel()))
    best = first_scores.cpu()[tokens].topk(count).indices
    return tokens[best].sort().values


@dataclass
class _Prompt:
    """One prompt's reading in progress: its buffers in prompt order and the hidden states leaving
    the exit layer, the fresh tokens and where each unit's entry goes."""

    kv: PromptKV
    hidden: torch.Tensor  # (n, d_model) leaving the exit layer
    entering: torch.Tensor  # (n, d_model) entering the start layer (passage tokens only)
    fresh: torch.Tensor  # (f,) sorted prompt indices read on every request


def _assemble(plan: ReadingPlan, ids: torch.Tensor, layout: PromptLayout, head: Any, entries: list[PassageEntry]
              ) -> _Prompt:
    """The prompt's buffers: the head's keys and values, each passage's re-rotated to where it sits."""
    n, h, layers = ids.numel(), layout.head, plan.exit_layer + 1
    device = head.keys[0].device
    shift = torch.zeros(n, dtype=torch.int64, device=device)
    keys, values = [], []
    for i in range(layers):
        k = head.keys[i].new_zeros(1, head.keys[i].shape[1], n, head.keys[i].shape[3])
        v = torch.zeros_like(k)
        k[:, :, :h], v[:, :, :h] = head.keys[i][:1], head.values[i][:1]
        for (s, e), entry in zip(layout.units, entries, strict=True):
            k[0, :, s:e], v[0, :, s:e] = entry.keys[i], entry.values[i]
        keys.append(k)
        values.append(v)
    hidden = head.hidden.new_zeros(n, head.hidden.shape[-1])
    entering = torch.zeros_like(hidden)
    hidden[:h] = head.hidden[0, :h]
    covered = torch.zeros(n, dtype=torch.bool)
    covered[:h] = True
    for (s, e), entry in zip(layout.units, entries, strict=True):
        shift[s:e] = s - entry.start
        hidden[s:e] = entry.hidden
        if entry.entering is not None:
            entering[s:e] = entry.entering
        covered[s:e] = True
    moved = (shift != 0).nonzero().flatten()
    if moved.numel():
        for k in keys:
            k[:, :, moved] = rerotate(k[:, :, moved], shift[moved], plan.inv_freq)
    return _Prompt(PromptKV(keys, values), hidden, entering, (~covered).nonzero().flatten().to(device))


def _causal(tokens: torch.Tensor, n: int) -> torch.Tensor:
    """(1, 1, q, n) bool: the tokens (q,) at those prompt indices each read the columns up to their own."""
    return (torch.arange(n, device=tokens.device).unsqueeze(0) <= tokens.unsqueeze(1)).reshape(1, 1, -1, n)


def _forward(parts: DecoderParts, prompt: _Prompt, ids: torch.Tensor, tokens: torch.Tensor, h: torch.Tensor,
             layers: range, recorder: Recorder) -> torch.Tensor:
    """``tokens`` (sorted prompt indices; hidden states ``h`` (1, q, d_model) entering the first of
    ``layers``) through ``layers``, reading every column up to their own; ``recorder`` records
    the question's and the last token's queries among them."""
    recorder.query_index = [torch.searchsorted(tokens, recorder.rows[0].to(tokens.device))]
    with recording(recorder):
        out, _ = _run(parts, prompt.kv, layers, h, tokens, _causal(tokens, ids.numel()), tokens.unsqueeze(0))
    return out


def read_prompt(parts: DecoderParts, plan: ReadingPlan, ids: torch.Tensor, question: torch.Tensor | None,
                layout: PromptLayout, head: Any, namespace: str, layers: frozenset[int] | None
                ) -> tuple[Recorder, PromptKV, torch.Tensor]:
    """One prompt read with its passages apart: (its recorder, with the rows a joint reading
    records and in ``stores`` the passages found and read; its keys and values of layers 0 …
    exit in prompt order; the hidden states (n, d_model) leaving the exit layer). ``head``: the
    prefix store's entry of its first ``layout.head`` tokens; ``layers``: the recorded layers."""
    n, device = ids.numel(), head.hidden.device
    entries, read = _entries(parts, plan, ids, layout, (list(head.keys), list(head.values)), namespace)
    prompt = _assemble(plan, ids, layout, head, entries)
    recorder = Recorder([n], [question], layers)
    recorder.stores[0] = (0, len(layout.units) - read, read)
    fresh, start = prompt.fresh, plan.start_layer
    if not bool(torch.isin(recorder.rows[0].to(device), fresh).all()):
        raise ValueError("the question and the last token must lie outside the passages")
    h = _forward(parts, prompt, ids, fresh, parts.embed(ids[fresh].unsqueeze(0)), range(start), recorder)
    first = None
    if plan.reading.recompute == "scored":
        probe = Recorder([n], [question], layers)
        _forward(parts, prompt, ids, fresh, h, range(start, plan.exit_layer + 1), probe)
        first = _first_scores(probe, plan.pool_kernel)
    again = _recompute_set(plan, layout, first).to(device)
    tokens = torch.cat([fresh, again]).sort().values
    entering = prompt.entering[tokens].unsqueeze(0)
    entering[0, torch.searchsorted(tokens, fresh)] = h[0]
    out = _forward(parts, prompt, ids, tokens, entering, range(start, plan.exit_layer + 1), recorder)
    prompt.hidden[tokens] = out[0]
    return recorder, prompt.kv, prompt.hidden


def _first_scores(recorder: Recorder, pool_kernel: int) -> torch.Tensor:
    """(n,) importance from a first pass's rows (the question's and the last token's queries)."""
    positions = recorder.rows[0]
    rows = torch.stack([
        scoring.layer_rows(recorder.queries[layer][0][0], recorder.keys[layer][0], recorder.scaling[layer],
                           pool_kernel, positions=positions.to(recorder.keys[layer][0].device))
        for layer in sorted(recorder.keys)
    ])
    return scoring.importance(rows)


def read_prompts(parts: DecoderParts, plan: ReadingPlan, batch: Recorder, token_ids: Sequence[torch.Tensor],
                 layouts: Sequence[PromptLayout], heads: Sequence[tuple[Any, int]], namespace: str
                 ) -> tuple[Any, torch.Tensor]:
    """``read_prompt`` for each prompt of a right-padded batch, their rows into ``batch``: (a KV
    cache of layers 0 … exit, (batch, kv_heads, width, head_dim) each, zeros after each prompt;
    the hidden states (batch, width, d_model) leaving the exit layer). ``heads``: each prompt's
    head (the prefix store's entry) and how many of its tokens the store already held."""
    from transformers import DynamicCache

    width = max(int(t.numel()) for t in token_ids)
    caches, hiddens = [], []
    for b, (ids, layout, (head, cached)) in enumerate(zip(token_ids, layouts, heads, strict=True)):
        question = batch.questions[b] if batch.questions[b].numel() else None
        recorder, kv, hidden = read_prompt(parts, plan, ids.to(head.hidden.device), question, layout, head,
                                           namespace, batch.layers)
        batch.adopt(b, recorder)
        _, found, read = recorder.stores[0] or (0, 0, 0)
        batch.stores[b] = (cached, found, read)
        caches.append(kv)
        hiddens.append(torch.nn.functional.pad(hidden, (0, 0, 0, width - hidden.shape[0])))
    cache = DynamicCache()
    for i in range(plan.exit_layer + 1):
        pad = [(0, 0, 0, width - kv.keys[i].shape[2]) for kv in caches]
        cache.update(torch.cat([torch.nn.functional.pad(kv.keys[i], p) for kv, p in zip(caches, pad, strict=True)]),
                     torch.cat([torch.nn.functional.pad(kv.values[i], p) for kv, p in zip(caches, pad, strict=True)]),
                     i)
    return cache, torch.stack(hiddens)
