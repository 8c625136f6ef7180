"""Attention rows → per-token importance. Pure torch: no models, no I/O.

For every draft layer ``l``, head ``h`` and query ``j`` the draft's attention over the prompt
keys is ``a[l, h, j, :] = softmax(q_j · K_promptᵀ · scale)`` (fp32, prompt keys only, causal
for queries inside the prompt). The queries are the question's own tokens and/or the look-ahead
(the last prompt token and the draft's greedy continuation). Each row is optionally
renormalised over the context tokens (so attention sinks and the question's attention to itself
do not decide which head speaks loudest), smoothed by an average pool along the prompt, and
reduced over heads (max or mean); a token's importance is the weighted mean over queries of its
maximum over layers.
"""

from __future__ import annotations

from typing import get_args

import torch
import torch.nn.functional as F

from ..types import HeadReduction

__all__ = [
    "HeadReduction",
    "attention_rows",
    "importance",
    "layer_rows",
    "normalize_rows",
    "pool_rows",
    "query_weights",
]


def attention_rows(
    queries: torch.Tensor, keys: torch.Tensor, scaling: float, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """Softmax attention of the queries over prompt keys, in fp32.

    queries: (heads, n_queries, head_dim), post-RoPE.
    keys: (kv_heads, n_prompt, head_dim), post-RoPE; heads must be a multiple of kv_heads (GQA).
    positions: (n_queries,) int64 prompt index of each query, or None. A query at index p sees
    keys 0..p only (causal, as in the draft's own forward); look-ahead queries come after the
    prompt and see every prompt key (pass an index >= n_prompt - 1, or None for all).
    Returns (heads, n_queries, n_prompt), rows summing to 1.
    """
    heads, lookahead, head_dim = queries.shape
    kv_heads, n_prompt, key_dim = keys.shape
    if key_dim != head_dim or heads % kv_heads:
        raise ValueError(
            f"query heads/dim {heads}/{head_dim} do not fit key heads/dim {kv_heads}/{key_dim}"
        )
    group = heads // kv_heads
    q = queries.float().reshape(kv_heads, group * lookahead, head_dim)
    logits = torch.bmm(q, keys.float().transpose(1, 2)) * scaling  # (kv_heads, group*L, N)
    if positions is not None:
        if positions.numel() != lookahead:
            raise ValueError(f"{positions.numel()} query positions for {lookahead} queries")
        future = torch.arange(n_prompt, device=keys.device) > positions.to(keys.device).unsqueeze(1)  # (L, N)
        logits = logits.masked_fill(future.repeat(group, 1).unsqueeze(0), float("-inf"))
    return logits.softmax(dim=-1).reshape(heads, lookahead, n_prompt)


def normalize_rows(rows: torch.Tensor, context: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Each row's attention restricted to the context tokens and rescaled to sum to 1.

    rows (..., n_prompt), context (n_prompt,) bool → (..., n_prompt), zero outside the context.
    A head that spends most of its attention on a sink token still ranks the context tokens; its
    ranking then weighs as much as any other head's.
    """
    masked = rows * context.to(rows.device, rows.dtype)
    return masked / masked.sum(dim=-1, keepdim=True).clamp_min(eps)


def pool_rows(rows: torch.Tensor, kernel: int) -> torch.Tensor:
    """Average-pool every row along its last dim (stride 1, zero padding, same length)."""
    if kernel == 1:
        return rows
    flat = rows.reshape(-1, 1, rows.shape[-1])
    pooled = F.avg_pool1d(flat, kernel_size=kernel, stride=1, padding=kernel // 2)
    return pooled.reshape(rows.shape)


def layer_rows(
    queries: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    pool_kernel: int,
    *,
    positions: torch.Tensor | None = None,
    context: torch.Tensor | None = None,
    heads: HeadReduction = "max",
) -> torch.Tensor:
    """One layer's contribution: attention rows, renormalised over ``context`` when given,
    pooled, then reduced over heads (``"max"`` or ``"mean"``).

    queries (heads, n_queries, head_dim), keys (kv_heads, n_prompt, head_dim)
    → (n_queries, n_prompt). Computed a layer at a time so memory stays O(n_queries · N).
    """
    if heads not in get_args(HeadReduction):
        raise ValueError(f"heads must be one of {get_args(HeadReduction)}, got {heads!r}")
    rows = attention_rows(queries, keys, scaling, positions)
    if context is None:
        rows = pool_rows(rows, pool_kernel)
    else:
        # Pool over context tokens only, so a sentence next to a passage header or the
        # question is not diluted by the zeros of the tokens outside the context.
        mask = context.to(rows.device, rows.dtype)
        share = pool_rows(mask.reshape(1, 1, -1), pool_kernel).reshape(-1).clamp_min(1e-12)
        rows = pool_rows(normalize_rows(rows, context), pool_kernel) / share * mask
    return rows.amax(dim=0) if heads == "max" else rows.mean(dim=0)


def query_weights(n_question: int, n_lookahead: int, lookahead_weight: float) -> torch.Tensor:
    """Weights (n_question + n_lookahead,) of the question queries then the look-ahead ones.

    The look-ahead group gets ``lookahead_weight`` of the total, the question group the rest,
    spread evenly inside each group; a group that is empty gives its share to the other, so a
    prompt without a question segment falls back to the look-ahead alone.
    """
    if not 0.0 <= lookahead_weight <= 1.0:
        raise ValueError(f"lookahead_weight must be in [0, 1], got {lookahead_weight}")
    if n_question + n_lookahead == 0:
        raise ValueError("no queries to weigh")
    if not n_question:
        lookahead_weight = 1.0
    elif not n_lookahead:
        lookahead_weight = 0.0
    weights = torch.cat(
        [
            torch.full((n_question,), (1.0 - lookahead_weight) / max(n_question, 1)),
            torch.full((n_lookahead,), lookahead_weight / max(n_lookahead, 1)),
        ]
    )
    return weights / weights.sum()


def importance(per_layer: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """(layers, n_queries, n_prompt) per-layer rows → (n_prompt,) importance score per token:
    the maximum over layers, then the mean over queries (weighted by ``weights`` (n_queries,),
    which sum to 1, when given)."""
    if per_layer.ndim != 3 or per_layer.shape[0] == 0 or per_layer.shape[1] == 0:
        raise ValueError(
            f"expected (layers, lookahead, n_prompt) with layers, lookahead > 0, got {tuple(per_layer.shape)}"
        )
    best = per_layer.amax(dim=0)  # (n_queries, n_prompt)
    if weights is None:
        return best.mean(dim=0)
    if weights.numel() != best.shape[0]:
        raise ValueError(f"{weights.numel()} query weights for {best.shape[0]} queries")
    return (weights.to(best.device, best.dtype).unsqueeze(1) * best).sum(dim=0)
