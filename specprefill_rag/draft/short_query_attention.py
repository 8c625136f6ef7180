"""Attention of a few queries over a long cache: the look-ahead's forwards on a GPU.

Each look-ahead forward feeds 1–8 tokens that attend to the whole prompt's keys under an
explicit mask (``early_exit.FixedKV.mask``, ``early_exit.tree_mask``). Given a mask and grouped
key/value heads, transformers' SDPA path first copies every key and value head ``heads //
kv_heads`` times (``repeat_kv``) and then runs a fused kernel that parallelises over query
blocks, so with 7 queries a few dozen of an H200's 132 multiprocessors each read all the keys.

``attend_short_queries`` computes the same attention without copying the cache: the logits as
one batched product over the grouped heads, a float32 softmax, and the product with the values
split over blocks of ``VALUE_BLOCK`` keys (as one product it ran on 8 blocks of threads, one per
key/value head, each reading every value: 145 µs at 8k, 861 µs at 32k). One layer's attention
of a 7-token forward on an H200 (Llama-3.2-1B shapes, replayed from a CUDA graph): SDPA 178 /
332 / 641 / 1257 µs at 4k / 8k / 16k / 32k keys, this path 64 / 100 / 155 / 273 µs; the whole
default scoring 0.74–0.94× its time through SDPA over two runs (2026-12-04, ``gpu_attention.json``
and ``gpu_ttft.json``; ``docs/algorithm.md``). It serves CUDA calls of at most ``SHORT_QUERY_TOKENS`` queries
with a 4-d mask (``applies``); everything else, and every call on a CPU, goes to SDPA unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["SHORT_QUERY_TOKENS", "VALUE_BLOCK", "applies", "attend_short_queries", "fits", "short_query_limit"]

SHORT_QUERY_TOKENS = 16  # at most this many queries per forward take the short path (0: never)
VALUE_BLOCK = 512  # keys per block of the values product (256–2048 timed the same on an H200)

# Keyword arguments this path reproduces; any other (a position bias, attention sinks, a
# soft cap, dropout) sends the call to SDPA, which knows them or ignores them as before.
_KNOWN = frozenset({"scaling", "dropout", "position_ids", "use_cache", "cache_position", "is_causal",
                    "sliding_window"})  # the mask already holds causality and a window


def applies(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, kwargs: dict[str, Any]) -> bool:
    """Whether ``attend_short_queries`` serves this call: on CUDA (where SDPA is the slow one
    for it; a CPU's SDPA reads a decode step's cache well) and where it ``fits``."""
    return query.device.type == "cuda" and fits(query, key, mask, kwargs)


def fits(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, kwargs: dict[str, Any]) -> bool:
    """At most ``SHORT_QUERY_TOKENS`` queries (batch, heads, q, head_dim) with a 4-d mask,
    grouped heads that divide evenly, no dropout and no argument this path does not reproduce."""
    return (
        0 < query.shape[2] <= SHORT_QUERY_TOKENS
        and mask is not None
        and mask.dim() == 4
        and query.shape[1] % key.shape[1] == 0
        and not kwargs.get("dropout")
        and all(name in _KNOWN or value is None for name, value in kwargs.items())
    )


@contextlib.contextmanager
def short_query_limit(tokens: int) -> Iterator[None]:
    """While open, calls of at most ``tokens`` queries take the short path (0: none, every call
    goes to SDPA): what a benchmark that compares both paths sets. Not thread-safe."""
    global SHORT_QUERY_TOKENS
    saved, SHORT_QUERY_TOKENS = SHORT_QUERY_TOKENS, tokens
    try:
        yield
    finally:
        SHORT_QUERY_TOKENS = saved


def attend_short_queries(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scaling: float | None = None,
    block: int | None = None,
) -> torch.Tensor:
    """(batch, q, heads, head_dim): ``query`` (batch, heads, q, head_dim) attending to ``key`` and
    ``value`` (batch, kv_heads, k, head_dim) under ``mask`` (batch or 1, 1, q, k; bool: True =
    may attend, or added to the logits), head ``i`` reading key/value head ``i // (heads //
    kv_heads)`` as ``repeat_kv`` pairs them. Logits and softmax in float32, the values product
    in blocks of ``block`` keys (default ``VALUE_BLOCK``) summed in float32. A row that may
    attend to nothing averages every value instead of returning NaN (it never occurs in a
    look-ahead: each token sees itself)."""
    batch, heads, q, dim = query.shape
    kv_heads, k = key.shape[1], key.shape[2]
    rows = heads // kv_heads * q  # the query rows of one key/value head
    scale = dim**-0.5 if scaling is None else scaling
    grouped = query.reshape(batch, kv_heads, rows, dim).float()
    logits = torch.matmul(grouped, key.float().transpose(-1, -2)).mul_(scale)  # (batch, kv_heads, rows, k)
    logits = logits.view(batch, kv_heads, heads // kv_heads, q, k)
    bias = mask.unsqueeze(2)  # (batch or 1, 1, 1, q, k)
    if bias.dtype == torch.bool:
        logits.masked_fill_(~bias, torch.finfo(torch.float32).min)
    else:
        logits.add_(bias.float())
    probs = logits.softmax(-1).view(batch, kv_heads, rows, k).to(value.dtype)
    out = _values(probs, value, block or VALUE_BLOCK)  # (batch, kv_heads, rows, dim) float32
    return out.to(value.dtype).view(batch, heads, q, dim).transpose(1, 2).contiguous()


def _values(probs: torch.Tensor, value: torch.Tensor, block: int) -> torch.Tensor:
    """(batch, kv_heads, rows, dim) float32: ``probs`` (batch, kv_heads, rows, k) times ``value``
    (batch, kv_heads, k, dim), one product per block of ``block`` keys (they run side by side)
    and one for the remainder, summed."""
    k = probs.shape[-1]
    whole = k // block * block
    out = torch.matmul(probs[..., whole:], value[:, :, whole:]).float()  # the remainder (all of a short cache)
    if whole:
        blocks = probs[..., :whole].unflatten(-1, (whole // block, block)).transpose(2, 3)  # (b, kv, s, rows, block)
        out += torch.matmul(blocks, value[:, :, :whole].unflatten(2, (whole // block, block))).float().sum(2)
    return out
