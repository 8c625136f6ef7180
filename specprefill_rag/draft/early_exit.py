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

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .lookahead_spec import LookaheadSpec

__all__ = [
    "DecoderParts", "ExitedPrompts", "FixedKV", "LoopShape", "StepLoop", "reading_set", "tree_mask", "upper_greedy",
    "upper_logits",
]

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


@dataclass(frozen=True)
class ExitedPrompts:
    """Right-padded prompts whose forward stopped before the first upper layer, and what it left
    there: the lower layers' keys and values and the hidden states entering the upper ones."""

    ids: torch.Tensor  # (batch, width) int64 prompt token ids, right-padded
    mask: torch.Tensor  # (batch, width) 1 = a prompt token
    cache: Any  # the KV cache of the layers below the first upper one (each whole prompt)
    hidden: torch.Tensor  # (batch, width, d_model) entering the first upper layer


@torch.inference_mode()
def upper_greedy(
    parts: DecoderParts, prompts: ExitedPrompts, upper_cache: Any, keeps: list[torch.Tensor], spec: LookaheadSpec,
    loops: Any = None, end_ids: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy look-ahead tokens of right-padded ``prompts`` whose forward stopped before layer
    ``start`` (one above ``spec``'s highest recorded layer): layers below ``start`` read each
    whole prompt (``prompts.cache``), the layers from ``start`` on its reading set ``keeps[b]``
    (sorted prompt indices ending with its last token; ``prompts.hidden`` entering ``start``;
    their keys into ``upper_cache``). Token j sits at position n_b + j and sees what a full
    greedy decode shows it, but in the upper layers the reading set instead of the prompt.
    ``spec.steps`` tokens per row.

    ``spec.guesses`` = 0 (None, auto, counts as 0 here: the draft resolves it): one step per
    token, no host synchronisation; the last step runs the lower layers only. g > 0: each
    forward feeds the next token and g guesses (``prompt_lookup``) and keeps those the draft's
    argmax confirms: the same tokens and queries (tested) in fewer forwards, one host
    synchronisation each; rejected guesses stay in the caches, masked out.

    The loop runs on a ``StepLoop``: fixed-size buffers copied from the two caches once (the
    caches themselves are left as they were). ``loops`` (a ``cuda_graphs.StepGraphs``): where a
    loop of this shape was captured as CUDA graphs at warm-up, its forwards are replayed.

    ``end_ids``: a row stops where its answer ends: a token one of these ids would follow is its
    last one fed (a first token among them: none fed). The loop ends when every row has (one host
    synchronisation per forward to ask). Empty: ``steps`` tokens per row.

    Returns (tokens (batch, steps), kept (batch, rows) bool): which of the look-ahead query rows
    the layers below ``start`` recorded, in order, belong to the tokens fed (``steps`` per row,
    or the tokens before its end; ``tokens[b, :kept[b].sum()]`` are those tokens).
    """
    start, steps, hidden = spec.top(len(parts.layers)) + 1, spec.steps, prompts.hidden
    logits, upper = _reading_pass(parts, upper_cache, hidden, keeps, start)
    feed = 1 + max(0, min(spec.guesses or 0, steps - 1))  # tokens per forward
    shape = LoopShape.of(prompts.cache, start, len(parts.layers), steps, feed, prompts.mask.shape[1], upper.shape[1])
    with loops.claim(shape) if loops is not None else contextlib.nullcontext() as captured:
        loop = captured.loop if captured is not None else StepLoop(parts, shape, hidden.device)
        loop.load(prompts.cache, upper_cache, prompts.ids, prompts.mask, upper, logits.argmax(-1), end_ids)
        run = captured.run if captured is not None else loop.run
        kept = [torch.zeros(len(keeps), 0, dtype=torch.bool, device=hidden.device)]
        for step in range(steps):
            if feed == 1 and not end_ids:  # every row feeds token ``step``: nothing to ask the device
                predict = step < steps - 1
            else:
                remaining, predict = torch.stack([(loop.fed < loop.limit).any(),
                                                  (loop.fed + 1 < loop.limit).any()]).tolist()
                if not remaining:
                    break
            kept.append(run(predict).clone())  # a graph's output is overwritten by its next replay
        return loop.tokens[:, :steps].clone(), torch.cat(kept, dim=1)


@dataclass(frozen=True)
class LoopShape:
    """What fixes the size of a look-ahead loop's buffers (and so of a captured graph)."""

    batch: int
    start: int  # the first upper layer
    n_layers: int
    steps: int
    feed: int  # tokens per forward
    width: int  # prompt columns of the lower layers' buffers (at least the padded prompt's)
    reading: int  # reading-set columns of the upper layers' buffers
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, cache: Any, start: int, n_layers: int, steps: int, feed: int, width: int, reading: int
           ) -> LoopShape:
        """The shape of a loop over ``cache`` (a prompt forward's, its first layer read for sizes)."""
        batch, kv_heads, _, head_dim = cache.layers[0].keys.shape
        return cls(int(batch), start, n_layers, steps, feed, width, reading, int(kv_heads), int(head_dim),
                   cache.layers[0].keys.dtype)


class FixedKV:
    """Keys and values of decoder layers ``first`` … in buffers of fixed size (batch, kv_heads,
    columns, head_dim), which the layers' attention reads whole under ``mask()``. ``update``
    (what a decoder layer calls on its cache) writes the forward's tokens at ``slots``, device
    tensors: no shape changes and no host synchronisation from one forward to the next."""

    def __init__(self, first: int, count: int, base: int, shape: LoopShape, device: torch.device) -> None:
        columns = base + shape.steps * shape.feed  # at most one forward per token
        size = (shape.batch, shape.kv_heads, columns, shape.head_dim)
        self.first, self.base, self.feed = first, base, shape.feed
        self.keys = [torch.zeros(size, dtype=shape.dtype, device=device) for _ in range(count)]
        self.values = [torch.zeros(size, dtype=shape.dtype, device=device) for _ in range(count)]
        self.valid = torch.zeros(shape.batch, columns, dtype=torch.bool, device=device)  # columns a token may read
        self.slots = torch.zeros(shape.feed, dtype=torch.int64, device=device)  # where this forward writes
        self.causal = torch.ones(shape.feed, shape.feed, dtype=torch.bool, device=device).tril()

    def load(self, cache: Any, valid: torch.Tensor) -> None:
        """The cached keys and values of ``cache``'s layers, ``valid`` (batch, w ≤ base) their
        readable entries."""
        w = valid.shape[1]
        for i, (keys, values) in enumerate(zip(self.keys, self.values, strict=True)):
            layer = cache.layers[self.first + i]
            keys[:, :, :w].copy_(layer.keys)
            values[:, :, :w].copy_(layer.values)
        self.reset()
        self.valid[:, :w].copy_(valid.bool())

    def reset(self) -> None:
        """Nothing readable; the next forward writes at column ``base``."""
        self.valid.zero_()
        self.slots.copy_(torch.arange(self.base, self.base + self.feed, device=self.slots.device))

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        i = layer_idx - self.first
        self.keys[i].index_copy_(2, self.slots, key.to(self.keys[i].dtype))
        self.values[i].index_copy_(2, self.slots, value.to(self.values[i].dtype))
        return self.keys[i], self.values[i]

    def mask(self) -> torch.Tensor:
        """(batch, 1, feed, columns) bool: the forward's tokens see the valid columns and, causally,
        one another."""
        own = torch.zeros(self.feed, self.valid.shape[1], dtype=torch.bool, device=self.valid.device)
        own.index_copy_(1, self.slots, self.causal)
        return (self.valid.unsqueeze(1) | own.unsqueeze(0)).unsqueeze(1)

    def keep(self, take: torch.Tensor) -> None:
        """After a forward: its tokens ``take`` (batch, feed) marks stay readable; the next one
        writes after them."""
        self.valid.index_copy_(1, self.slots, take)
        self.slots.add_(self.feed)


END_SLOTS = 8  # end-of-answer ids a loop checks (``StepLoop.end_ids``)


class StepLoop:
    """The state of one greedy look-ahead (``upper_greedy``) in tensors of fixed size: the lower
    and upper layers' keys and values (``FixedKV``), the tokens, how many each row has fed and
    may feed (``limit``: fewer once its answer ends).
    ``run`` is one forward; it changes only these tensors, in place, so the same forward can be
    captured once as a CUDA graph and replayed (``cuda_graphs``)."""

    def __init__(self, parts: DecoderParts, shape: LoopShape, device: torch.device) -> None:
        self.parts, self.shape = parts, shape
        self.lower = FixedKV(0, shape.start, shape.width, shape, device)
        self.upper = FixedKV(shape.start, shape.n_layers - shape.start, shape.reading, shape, device)
        self.prompt_ids = torch.zeros(shape.batch, shape.width, dtype=torch.int64, device=device)
        self.n = torch.zeros(shape.batch, dtype=torch.int64, device=device)
        self.tokens = torch.zeros(shape.batch, shape.steps + 1, dtype=torch.int64, device=device)  # last: a bin
        self.fed = torch.zeros(shape.batch, dtype=torch.int64, device=device)  # tokens 0 … fed are known
        self.limit = torch.full((shape.batch,), shape.steps, dtype=torch.int64, device=device)  # tokens it feeds
        self.end_ids = torch.full((END_SLOTS,), -1, dtype=torch.int64, device=device)  # -1: no id
        self.slot = torch.arange(shape.feed, device=device)

    def load(self, cache: Any, upper_cache: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
             upper: torch.Tensor, first: torch.Tensor, end_ids: Sequence[int] = ()) -> None:
        """A request's prompts (``prompt_ids``, ``prompt_mask`` (batch, w)), their caches, the
        reading sets' entries ``upper`` (batch, m), each row's ``first`` look-ahead token and the
        ids that end an answer (``upper_greedy``)."""
        if len(end_ids) > END_SLOTS:
            raise ValueError(f"a look-ahead checks at most {END_SLOTS} end ids, got {len(end_ids)}")
        self.reset()
        self.lower.load(cache, prompt_mask)
        self.upper.load(upper_cache, upper)
        self.prompt_ids[:, : prompt_ids.shape[1]].copy_(prompt_ids)
        self.n.copy_(prompt_mask.sum(1))
        self.tokens[:, 0].copy_(first)
        self.end_ids[: len(end_ids)].copy_(torch.tensor(list(end_ids), dtype=torch.int64))
        self.limit.masked_fill_(self._ends(first), 0)  # an answer that ends at once: nothing to feed

    def _ends(self, tokens: torch.Tensor) -> torch.Tensor:
        """Which of ``tokens`` end an answer."""
        return (tokens.unsqueeze(-1) == self.end_ids).any(-1)

    def reset(self) -> None:
        """No prompt, no token fed (what a graph is captured from)."""
        for part in (self.lower, self.upper):
            part.reset()
        for tensor in (self.prompt_ids, self.n, self.tokens, self.fed):
            tensor.zero_()
        self.limit.fill_(self.shape.steps)
        self.end_ids.fill_(-1)

    def run(self, predict: bool) -> torch.Tensor:
        """One forward: each row's next unfed token (and guesses); ``predict`` also runs the
        upper layers and records the tokens found. (batch, feed) which slots hold kept tokens."""
        parts, steps, feed, slot = self.parts, self.shape.steps, self.shape.feed, self.slot
        index = self.fed.unsqueeze(1) + slot  # (batch, feed) the token index each slot holds
        live = index < self.limit.unsqueeze(1)  # slots holding a token to feed (a done row's hold none)
        x = self.tokens.gather(1, index[:, :1].clamp(max=steps - 1))  # the next unfed token
        if feed > 1:
            x = torch.cat([x, prompt_lookup(self.prompt_ids, self.n, self.tokens[:, :steps],
                                          (self.fed + 1).clamp(max=steps), feed - 1)],
                          dim=1)
        positions = self.n.unsqueeze(1) + index.clamp(max=steps - 1)
        h = _run_layers(parts, range(self.shape.start), parts.embed(x), self.lower.mask(), positions, self.lower)
        if predict:
            h = _run_layers(parts, range(self.shape.start, len(parts.layers)), h, self.upper.mask(), positions,
                            self.upper)
            predicted = parts.head(parts.norm(h)).argmax(-1)  # (batch, feed): the token after each slot
            accepted = _confirmed(x, predicted, self.fed, steps)
            take = live & (slot <= accepted.unsqueeze(1))  # the fed token and the kept guesses
            # A kept slot that predicts an end token is its row's last one fed.
            ends = torch.where(take & self._ends(predicted), index + 1, steps).amin(1)
            self.limit.copy_(torch.minimum(self.limit, ends))
            take &= index < self.limit.unsqueeze(1)
            # Each kept slot's prediction is the next token (the bin takes the rest: no host sync).
            self.tokens.scatter_(1, torch.where(take & (index + 1 < steps), index + 1, steps), predicted)
            self.upper.keep(take)
        else:  # only last tokens are left: their queries, no more predictions
            accepted = torch.zeros_like(self.fed)
            take = live & (slot == 0)
        self.lower.keep(take)
        self.fed.copy_(torch.where(self.fed < steps, self.fed + 1 + accepted, self.fed))
        return take


def _reading_pass(parts: DecoderParts, upper_cache: Any, hidden: torch.Tensor, keeps: list[torch.Tensor],
                  start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layers from ``start`` over each row's reading set ``keeps[b]`` (``hidden`` (batch,
    width, d_model) entering ``start``), their keys into ``upper_cache``: (batch, vocab) the
    next-token logits after each prompt, and (batch, m) which cached entries are a reading set's."""
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
    return parts.head(parts.norm(h[torch.arange(batch, device=device), lengths - 1])), valid


def _confirmed(x: torch.Tensor, predicted: torch.Tensor, fed: torch.Tensor, steps: int) -> torch.Tensor:
    """(batch,) guesses kept of a forward that fed ``x`` (batch, feed: the next token, then
    guesses) and predicted ``predicted`` after each slot: guess i is kept while the guesses
    before it are and it is what slot i − 1 predicts, up to the tokens still missing."""
    right = torch.cumprod((x[:, 1:] == predicted[:, :-1]).long(), dim=1).sum(1)
    return torch.minimum(right, (steps - 1 - fed).clamp(min=0))


def prompt_lookup(prompt_ids: torch.Tensor, n: torch.Tensor, tokens: torch.Tensor, known: torch.Tensor,
                  count: int) -> torch.Tensor:
    """(batch, count) guesses of the look-ahead tokens ``known`` … ``known + count - 1`` of each
    row: what followed the latest earlier occurrence of its last two tokens (else of its last
    token) in its prompt (``prompt_ids`` (batch, width), ``n`` (batch,) lengths) followed by its
    ``known`` first ``tokens`` (batch, steps) — the answer a RAG draft writes is mostly copied.
    Any guess is safe: a wrong one is only not kept. On the device, no host synchronisation."""
    batch, steps, device = prompt_ids.shape[0], tokens.shape[1], tokens.device
    seq = torch.cat([prompt_ids, torch.zeros(batch, steps, dtype=prompt_ids.dtype, device=device)], dim=1)
    seq = seq.scatter(1, n.unsqueeze(1) + torch.arange(steps, device=device), tokens.to(seq.dtype))
    end = (n + known).unsqueeze(1)  # (batch, 1) the sequence's length
    rows = torch.arange(batch, device=device).unsqueeze(1)
    one, two = seq.gather(1, end - 1), seq.gather(1, (end - 2).clamp(min=0))  # its last and second-last tokens
    at = torch.arange(seq.shape[1], device=device).unsqueeze(0)  # where a continuation would start
    before = torch.cat([seq.new_full((batch, 1), -1), seq[:, :-1]], dim=1)  # the token before each
    twice = torch.cat([seq.new_full((batch, 2), -1), seq[:, :-2]], dim=1)
    inside = (at >= 1) & (at < end)
    single = torch.where(inside & (before == one), at, -1).amax(1)
    double = torch.where(inside & (at >= 2) & (before == one) & (twice == two), at, -1).amax(1)
    start = torch.where(double >= 0, double, single).clamp(min=0)  # no match: any guess will do
    where = (start.unsqueeze(1) + torch.arange(count, device=device)).clamp(max=seq.shape[1] - 1)
    return seq[rows, where].to(tokens.dtype)
