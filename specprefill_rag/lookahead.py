"""The look-ahead's tokens when the prompt's forward exits early, and sibling tokens.

The look-ahead queries are those of tokens the draft would write next. Which tokens those are
needs the draft's upper layers, which early exit skips over the prompt (the prompt's forward
stops after the highest aggregated layer). So the upper layers run over a small reading set
only (``reading_set``: the prompt tokens the aggregated layers already score highest, plus the
question, the first tokens and the tail), at their original positions, the way SpecPrefill
itself runs the main model on the kept tokens:

- greedy (the default, ``upper_greedy``): L − 1 decode steps whose lower layers read the whole
  prompt and whose upper layers read the reading set;
- siblings (``upper_logits`` + ``tree_mask``): the L − 1 likeliest next tokens, scored together
  in one forward, all at position n, each attending to the prompt and itself.

Reading the whole prompt (``upper_keep=1``) gives the full forward's tokens exactly (tested);
reading the tokens off the exit layer directly (the logit lens) loses evidence. What was
measured is in docs/configuration.md (``early_exit``, ``upper_keep``, ``lookahead_tokens``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DecoderParts", "reading_set", "tree_mask", "upper_greedy", "upper_logits"]

SINK_TOKENS = 4  # first prompt tokens always read (attention sinks)
TAIL_TOKENS = 16  # last prompt tokens always read (the generation prompt, the question's end)


@dataclass(frozen=True)
class DecoderParts:
    """What running a decoder's layers by hand needs: its layers, final norm, LM head, rotary
    embedding and input embedding. ``of(model)`` is None for a model that keeps them elsewhere,
    or whose layers do not all attend to the whole context (sliding windows, linear attention)."""

    layers: Any
    norm: Any
    head: Any
    rotary: Any
    embed: Any

    @classmethod
    def of(cls, model: Any) -> DecoderParts | None:
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        parts = (getattr(decoder, name, None) for name in ("layers", "norm", "rotary_emb"))
        layers, norm, rotary = parts
        head, embed = model.get_output_embeddings(), model.get_input_embeddings()
        if layers is None or norm is None or rotary is None or head is None or embed is None:
            return None
        config = getattr(model.config, "text_config", None) or model.config
        if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
            return None
        return cls(layers, norm, head, rotary, embed)


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
    m = keep.numel()
    causal = torch.ones(m, m, dtype=torch.bool, device=hidden.device).tril().reshape(1, 1, m, m)
    h = _run_layers(parts, range(start, len(parts.layers)), h, causal, keep.unsqueeze(0), None)
    return parts.head(parts.norm(h[0, -1]))


def _run_layers(parts: DecoderParts, layers: range, h: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                cache: Any) -> torch.Tensor:
    """``h`` through the decoder ``layers`` by hand, under ``mask``, at ``positions``; their keys
    and values appended to ``cache`` (None: kept nowhere)."""
    embeddings = parts.rotary(h, positions)
    for i in layers:
        out = parts.layers[i](h, attention_mask=mask, position_ids=positions, past_key_values=cache,
                              use_cache=cache is not None, position_embeddings=embeddings)
        h = out[0] if isinstance(out, tuple) else out
    return h


@torch.inference_mode()
def upper_greedy(
    parts: DecoderParts, cache: Any, upper_cache: Any, hidden: torch.Tensor, prompt_mask: torch.Tensor,
    keeps: list[torch.Tensor], start: int, steps: int,
) -> torch.Tensor:
    """(batch, steps) greedy look-ahead tokens of right-padded prompts whose forward stopped
    before layer ``start``: layers below ``start`` read each whole prompt, the layers from
    ``start`` on read its reading set ``keeps[b]`` (sorted prompt indices, ending with the last
    prompt token) only, at their original positions, the way ``upper_logits`` finds siblings.

    ``cache`` holds the prompts' keys and values of the layers below ``start`` (``prompt_mask``
    (batch, width), 1 = a prompt token); ``hidden`` (batch, width, d_model) the hidden states
    entering ``start``. The upper layers' keys go into ``upper_cache``. Step j's token sits at
    position n_b + j and sees its prompt (lower layers) or reading set (upper layers) and the
    steps before it, as in a full greedy decode; the last step runs the layers below ``start``
    only (its logits go unused). No host synchronisation inside the loop.
    """
    batch, device = len(keeps), hidden.device
    width = max(int(k.numel()) for k in keeps)
    lengths = torch.tensor([int(k.numel()) for k in keeps], device=device)
    index = torch.zeros(batch, width, dtype=torch.int64, device=device)
    for b, keep in enumerate(keeps):  # padding repeats the last prompt token, masked out below
        index[b] = keep[-1]
        index[b, : keep.numel()] = keep
    valid = torch.arange(width, device=device) < lengths.unsqueeze(1)  # (batch, width)
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    square = (causal & valid.unsqueeze(1)) | torch.eye(width, dtype=torch.bool, device=device)  # no empty row
    h = hidden.gather(1, index.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
    h = _run_layers(parts, range(start, len(parts.layers)), h, square.unsqueeze(1), index, upper_cache)
    logits = parts.head(parts.norm(h[torch.arange(batch, device=device), lengths - 1]))  # (batch, vocab)
    last = prompt_mask.sum(1) - 1  # (batch,) each prompt's last index
    lower, upper = prompt_mask.bool(), valid
    tokens: list[torch.Tensor] = []
    for step in range(steps):
        tokens.append(logits.argmax(-1))
        one = torch.ones(batch, 1, dtype=torch.bool, device=device)
        lower, upper = torch.cat([lower, one], dim=1), torch.cat([upper, one], dim=1)
        h = parts.embed(tokens[-1]).unsqueeze(1)  # (batch, 1, d_model)
        positions = (last + 1 + step).unsqueeze(1)
        h = _run_layers(parts, range(start), h, lower[:, None, None], positions, cache)
        if step == steps - 1:
            break
        h = _run_layers(parts, range(start, len(parts.layers)), h, upper[:, None, None], positions, upper_cache)
        logits = parts.head(parts.norm(h[:, -1]))
    return torch.stack(tokens, dim=1)
