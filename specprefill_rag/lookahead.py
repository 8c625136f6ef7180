"""Look-ahead tokens without sequential decode steps: the siblings, and where they come from.

The look-ahead queries are those of tokens the draft would write next. The reference decodes
them greedily, one forward each. Here the ``k`` likeliest next tokens ("siblings") are scored
together in one forward, all at position n, each attending to the prompt and itself
(``tree_mask``). Which tokens are likeliest needs the draft's upper layers, which early exit
skips over the prompt; so they run over a small reading set only (``reading_set``: the prompt
tokens the aggregated layers already score highest, plus the question, the first tokens and the
tail), at their original positions (``upper_logits``), the way SpecPrefill itself runs the main
model on the kept tokens. On the RAG prompts measured, evidence recall from these candidates
stays within the noise of the full forward's (docs/configuration.md, ``upper_keep``); reading
them off the exit layer directly (the logit lens) loses evidence. ``DraftConfig.lookahead_tokens``
chooses siblings; the default stays greedy (docs/algorithm.md says why).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DecoderParts", "reading_set", "tree_mask", "upper_logits"]

SINK_TOKENS = 4  # first prompt tokens always read (attention sinks)
TAIL_TOKENS = 16  # last prompt tokens always read (the generation prompt, the question's end)


@dataclass(frozen=True)
class DecoderParts:
    """What running a decoder's upper layers by hand needs: its layers, final norm, LM head and
    rotary embedding. ``of(model)`` is None for a model that keeps them elsewhere."""

    layers: Any
    norm: Any
    head: Any
    rotary: Any

    @classmethod
    def of(cls, model: Any) -> DecoderParts | None:
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        parts = (getattr(decoder, name, None) for name in ("layers", "norm", "rotary_emb"))
        layers, norm, rotary = parts
        head = model.get_output_embeddings()
        if layers is None or norm is None or rotary is None or head is None:
            return None
        return cls(layers, norm, head, rotary)


def tree_mask(prompt_mask: torch.Tensor, k: int) -> torch.Tensor:
    """(batch, 1, k, width + k) bool: ``k`` tokens appended after right-padded prompts
    (``prompt_mask`` (batch, width), 1 = a prompt token), each seeing its prompt and itself."""
    batch, width = prompt_mask.shape
    mask = torch.zeros(batch, 1, k, width + k, dtype=torch.bool, device=prompt_mask.device)
    mask[:, 0, :, :width] = prompt_mask.bool().unsqueeze(1)
    mask[:, 0, torch.arange(k), width + torch.arange(k)] = True
    return mask


def reading_set(scores: torch.Tensor, question: torch.Tensor, share: float) -> torch.Tensor:
    """(m,) sorted int64 prompt indices the upper layers read: the best-scoring ``share`` of the
    prompt's tokens (``scores`` (n,)), the ``question`` indices, the first and the last tokens."""
    n = scores.numel()
    best = scores.topk(min(n, math.ceil(share * n))).indices.cpu()
    always = torch.cat([torch.arange(min(n, SINK_TOKENS)), torch.arange(max(0, n - TAIL_TOKENS), n)])
    return torch.unique(torch.cat([best, question.to(torch.int64).cpu(), always]))  # sorted


@torch.inference_mode()
def upper_logits(parts: DecoderParts, hidden: torch.Tensor, keep: torch.Tensor, start: int) -> torch.Tensor:
    """(vocab,) next-token logits after the last prompt token, from layers ``start`` … last run
    over the prompt tokens ``keep`` (m,) only, at their original positions, causally among
    themselves. ``hidden`` (n, d_model): the hidden states leaving layer ``start - 1``."""
    keep = keep.to(hidden.device)
    h = hidden[keep].unsqueeze(0)  # (1, m, d_model)
    positions = keep.unsqueeze(0)
    m = keep.numel()
    causal = torch.ones(m, m, dtype=torch.bool, device=hidden.device).tril().reshape(1, 1, m, m)
    embeddings = parts.rotary(h, positions)
    for layer in parts.layers[start:]:
        out = layer(h, attention_mask=causal, position_ids=positions, position_embeddings=embeddings)
        h = out[0] if isinstance(out, tuple) else out
    return parts.head(parts.norm(h[0, -1]))
