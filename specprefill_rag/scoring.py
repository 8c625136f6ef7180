"""Attention rows → per-token importance. Pure torch: no models, no I/O.

For every draft layer ``l``, head ``h`` and look-ahead query ``j`` the draft's attention over
the prompt keys is ``a[l, h, j, :] = softmax(q_j · K_promptᵀ · scale)`` (fp32, prompt keys
only). Each row is smoothed by an average pool along the prompt; a token's importance is the
mean over look-ahead queries of its maximum over layers and heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["attention_rows", "pool_rows", "layer_maxima", "importance"]


def attention_rows(queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """Softmax attention of look-ahead queries over prompt keys, in fp32.

    queries: (heads, lookahead, head_dim), post-RoPE.
    keys: (kv_heads, n_prompt, head_dim), post-RoPE; heads must be a multiple of kv_heads (GQA).
    Returns (heads, lookahead, n_prompt), rows summing to 1.
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
    return logits.softmax(dim=-1).reshape(heads, lookahead, n_prompt)


def pool_rows(rows: torch.Tensor, kernel: int) -> torch.Tensor:
    """Average-pool every row along its last dim (stride 1, zero padding, same length)."""
    if kernel == 1:
        return rows
    flat = rows.reshape(-1, 1, rows.shape[-1])
    pooled = F.avg_pool1d(flat, kernel_size=kernel, stride=1, padding=kernel // 2)
    return pooled.reshape(rows.shape)


def layer_maxima(
    queries: torch.Tensor, keys: torch.Tensor, scaling: float, pool_kernel: int
) -> torch.Tensor:
    """One layer's contribution: pooled attention rows, maximum over heads.

    queries (heads, lookahead, head_dim), keys (kv_heads, n_prompt, head_dim)
    → (lookahead, n_prompt). Computed a layer at a time so memory stays O(L · N).
    """
    return pool_rows(attention_rows(queries, keys, scaling), pool_kernel).amax(dim=0)


def importance(per_layer: torch.Tensor) -> torch.Tensor:
    """(layers, lookahead, n_prompt) layer maxima → (n_prompt,) importance score per token."""
    if per_layer.ndim != 3 or per_layer.shape[0] == 0 or per_layer.shape[1] == 0:
        raise ValueError(
            f"expected (layers, lookahead, n_prompt) with layers, lookahead > 0, got {tuple(per_layer.shape)}"
        )
    return per_layer.amax(dim=0).mean(dim=0)
