"""The mechanics of reading passages apart (``passage_reading``): keys moved by rotation, prompt
buffers in prompt order, decoder layers run by hand over any set of tokens, and a passage's own
reading after the anchor.

RoPE is a rotation by position, so a key computed at position p becomes the key at p + d by a
rotation by d (``rerotate``; ``rotates_plainly`` checks a draft's keys move so). ``PromptKV`` holds
a prompt's keys and values per layer in prompt order; a decoder layer writes the tokens it runs
over at their prompt indices (``TokenPlaces``) and attends the whole buffer under a mask (``run_layers``).
``read_units`` reads passages, each after the anchor and itself only, batched and right-padded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .batching import length_buckets
from .capture import recording
from .early_exit import DecoderParts
from .passage_store import PassageEntry

__all__ = ["PromptKV", "TokenPlaces", "UnitReading", "read_units", "rerotate", "rotates_plainly", "run_layers"]

UNIT_PAD_LIMIT = 0.25  # padding share a batch of passages read together may hold (``batching.length_buckets``)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rerotate(keys: torch.Tensor, shift: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``keys`` (..., n, head_dim), post-RoPE, each moved ``shift[i]`` positions on (n,) int64:
    rotated by ``shift`` times each frequency of ``inv_freq`` (head_dim / 2,) (the rotate-half
    layout of Llama, Qwen, Mistral). Angles in float64, the product in float32, back in the keys'
    dtype. A rotary scaling factor commutes with the rotation, so it needs no care."""
    angle = shift.to(torch.float64).unsqueeze(-1) * inv_freq.to(device=shift.device, dtype=torch.float64).unsqueeze(0)
    angle = torch.cat([angle, angle], dim=-1)  # (n, head_dim)
    cos, sin = angle.cos().float(), angle.sin().float()
    k = keys.float()
    return (k * cos + _rotate_half(k) * sin).to(keys.dtype)


class _Keys:
    """A cache that keeps the last keys a layer hands it (``rotates_plainly``)."""

    keys = torch.empty(0)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys = key
        return key, value


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


@dataclass(frozen=True)
class TokenPlaces:
    """Where the q tokens a run of decoder layers reads sit (``run_layers``): their indices in the
    ``PromptKV`` buffers, their positions, and the buffer columns each of them may read."""

    tokens: torch.Tensor  # (q,) int64 buffer indices, where their keys and values are written
    positions: torch.Tensor  # (batch, q) int64 positions, what the rotary embedding rotates by
    mask: torch.Tensor  # (batch, 1, q, width) bool, the columns each query reads


def run_layers(parts: DecoderParts, kv: PromptKV, layers: range, h: torch.Tensor, places: TokenPlaces,
               keep: Sequence[int] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """``h`` (batch, q, d_model) of the prompt tokens at ``places.positions`` through decoder
    ``layers``, their keys and values written at ``places.tokens`` of ``kv``, each query reading
    the columns ``places.mask`` allows. Returns the hidden states leaving the last layer and those
    entering each layer of ``keep`` that the run passes (the one after the last layer: what
    leaves it)."""
    kv.slots = places.tokens
    embeddings = parts.rotary(h, places.positions)
    kept: dict[int, torch.Tensor] = {}
    for i in layers:
        if i in keep:
            kept[i] = h
        out = parts.layers[i](h, attention_mask=places.mask, position_ids=places.positions, past_key_values=kv,
                              use_cache=True, position_embeddings=embeddings)
        h = out[0] if isinstance(out, tuple) else out
    if layers.stop in keep:
        kept[layers.stop] = h
    return h, kept


@dataclass(frozen=True)
class UnitReading:
    """What a passage's reading keeps: keys and values of layers 0 … ``depth`` − 1; the hidden
    states leaving the exit layer (when ``depth`` reaches past it); those entering ``start`` and,
    with ``following``, those entering ``start + 1``."""

    depth: int
    exit_layer: int
    start: int
    following: bool


def read_units(parts: DecoderParts, reading: UnitReading, anchor_kv: tuple[list[torch.Tensor], list[torch.Tensor]],
               units: Sequence[torch.Tensor]) -> list[PassageEntry]:
    """Each of ``units`` (token ids (m,) each) read after the anchor (``anchor_kv``: its keys and
    values per layer, (1, kv_heads, a, head_dim)) and itself only, at positions a …, in
    right-padded batches of near-equal lengths: their entries."""
    out: list[PassageEntry | None] = [None] * len(units)
    for group in length_buckets([int(u.numel()) for u in units], UNIT_PAD_LIMIT):
        for i, entry in zip(group, _read_group(parts, reading, anchor_kv, [units[i] for i in group]), strict=True):
            out[i] = entry
    return [e for e in out if e is not None]


def _read_group(parts: DecoderParts, reading: UnitReading,
                anchor_kv: tuple[list[torch.Tensor], list[torch.Tensor]], units: Sequence[torch.Tensor]
                ) -> list[PassageEntry]:
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

    depth = reading.depth
    kv = PromptKV([buffer(k) for k in keys0[:depth]], [buffer(v) for v in values0[:depth]])
    valid = torch.arange(width, device=device).unsqueeze(0) < torch.tensor(lengths, device=device).unsqueeze(1)
    own = torch.ones(width, width, dtype=torch.bool, device=device).tril().unsqueeze(0) & valid.unsqueeze(1)
    own |= torch.eye(width, dtype=torch.bool, device=device)  # a padding row reads itself: no empty row
    mask = torch.cat([torch.ones(batch, width, a, dtype=torch.bool, device=device), own], dim=2).unsqueeze(1)
    positions = (a + torch.arange(width, device=device)).unsqueeze(0).expand(batch, -1)
    places = TokenPlaces(a + torch.arange(width, device=device), positions, mask)
    keep = [reading.start, reading.start + 1] if reading.following else [reading.start]
    with recording(None):
        h, kept = run_layers(parts, kv, range(depth), parts.embed(ids), places, keep=keep)
    leaving = h if depth > reading.exit_layer else None

    def rows(t: torch.Tensor | None, b: int, m: int) -> torch.Tensor | None:
        return None if t is None else t[b, :m].clone()

    return [
        PassageEntry(
            token_ids=units[b].to(torch.int64).cpu(), start=a,
            keys=tuple(k[b, :, a: a + m].clone() for k in kv.keys),
            values=tuple(v[b, :, a: a + m].clone() for v in kv.values),
            hidden=rows(leaving, b, m), entering=rows(kept.get(reading.start), b, m),
            following=rows(kept.get(reading.start + 1), b, m) if reading.following else None,
        )
        for b, m in enumerate(lengths)
    ]
