"""The draft's forward plumbing: the prompt's forward, the KV cache, padding, the prefix store's heads.

``DraftForward`` is what ``DraftModel`` and its look-ahead drivers are built on: the model's
sizes and device, right-padded batches, the prompt's forward (which may stop early inside a
layer, or leave one with its hidden states), and the prompt heads the prefix store serves
(``prefix_store``). It holds no state of its own: ``DraftModel.__init__`` sets every attribute
declared here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..config import DraftConfig, LookaheadTokens
from ..errors import InputError
from .capture import EarlyExit, Recorder, hooked, leaving, recording
from .cuda_graphs import StepGraphs
from .early_exit import DecoderParts
from .lookahead_spec import LookaheadSpec
from .passage_kv import rotates_plainly
from .passage_reading import PromptLayout, ReadingPlan, read_prompts, with_head
from .passage_store import PassageStore
from .prefix_store import MIN_PREFIX_TOKENS, PrefixEntry, PrefixStore

__all__ = ["DraftForward", "LocalRead", "PaddedBatch", "prompt_heads"]

LocalRead = Callable[[], tuple[Any, torch.Tensor]]  # a forward reading passages apart: (cache, hidden states)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PaddedBatch:
    """A batch of prompts laid out for one forward (``DraftForward._right_padded``): what the
    prompt's forward and the look-ahead drivers read together."""

    ids: torch.Tensor  # (batch, longest prompt) int64 token ids, zeros after each prompt, on the device
    mask: torch.Tensor  # (batch, longest prompt) int64 attention mask, 1 = a prompt token
    last: torch.Tensor  # (batch,) int64 each prompt's last token index


def prompt_heads(contexts: Sequence[torch.Tensor | None]) -> list[int]:
    """Each prompt's head for the prefix store: its tokens up to the end of its context (the last
    prunable one, ``contexts`` (n,) bool: the system prompt, earlier turns, the passages), which a
    follow-up over the same context shares; none without a mask or a prunable token. (The store
    stops a head before the question and the last token: ``_shared_head``.)"""
    return [0 if c is None or not bool(c.any()) else int(c.nonzero()[-1]) + 1 for c in contexts]


class DraftForward:
    """The forward plumbing of a draft (``DraftModel``): sizes, device, cache, padding, prompt
    forward and prefix-store heads."""

    model: Any  # a transformers causal LM on the capturing attention (``capture.CAPTURE_ATTENTION``)
    tokenizer: Any
    config: DraftConfig  # the draft's default settings
    prefixes: PrefixStore  # keys and values of prompt heads read before
    passages: PassageStore  # readings of passages read apart (``passage_reading``)
    graphs: StepGraphs | None  # the look-ahead's CUDA graphs (``DraftModel.capture_graphs``)
    end_ids: frozenset[int]  # the ids that end the draft's answer
    _plain_embedding: bool | None  # see _embeds_plainly
    _plain_cache: bool | None  # see _stores_heads
    _plain_rotary: bool | None  # see _reads_apart
    _fingerprint: str | None  # see fingerprint

    @property
    def n_layers(self) -> int:
        config = self.model.config
        return int((getattr(config, "text_config", None) or config).num_hidden_layers)

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 1 << 30))

    def fits(self, n_tokens: int, extra_positions: int = 0) -> bool:
        """Whether a prompt of ``n_tokens`` plus ``extra_positions`` look-ahead positions after it
        (``DraftConfig.extra_positions``) fits the window."""
        return n_tokens + extra_positions <= self.max_context

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype: with the device, what decides verified guesses (``DraftConfig.guesses_on``)."""
        return next(self.model.parameters()).dtype

    # -- the prefix store: prompt heads read once (``prefix_store``) ----------------------------

    def _shared_head(self, token_ids: Sequence[torch.Tensor], lengths: list[int], questions: list[torch.Tensor],
                     heads: Sequence[int] | None) -> int:
        """How many first tokens of the batch the prefix store may serve: the shortest of
        ``heads``, before every question token and each prompt's last token (their queries are
        recorded), as far as every prompt begins with the same tokens; 0 when that is under
        ``MIN_PREFIX_TOKENS``, the store is off, or this draft's cache is not plain."""
        if not heads or self.prefixes.entries == 0:
            return 0
        if len(heads) != len(lengths):
            raise InputError("pass one head length per prompt")
        starts = [int(q.min()) for q in questions if q.numel()]
        p = min(min(int(h) for h in heads), min(lengths) - 1, *starts)
        first = token_ids[0][:p].to(torch.int64).cpu()
        for t in token_ids[1:]:  # a batch shares the start all its prompts begin with
            same = (t[:p].to(torch.int64).cpu() != first[:p]).nonzero()
            p = int(same[0]) if same.numel() else p
        return 0 if p < MIN_PREFIX_TOKENS or not self._stores_heads() else p

    def _exit_layer(self, lookahead: int, tokens: LookaheadTokens, early_exit: bool, top: int, ids: torch.Tensor
                    ) -> int:
        """The last layer the prompt's forward runs (what a stored head must hold for it)."""
        last = self.n_layers - 1
        if not early_exit or top >= last:
            return last
        if lookahead == 1:
            return top
        parts = DecoderParts.of(self.model)
        if parts is None or (tokens == "greedy" and not self._embeds_plainly(parts, ids)):
            return last
        return top

    def _read_head(self, head_ids: torch.Tensor, exit_layer: int, namespace: str, keep: bool = True) -> PrefixEntry:
        """The store's entry for ``head_ids`` (p,) in ``namespace``: stored, or read on from the
        longest start stored there that it shares (a chat's previous turn, the same system prompt
        before other passages), or from nothing, and then stored. ``keep=False``: read from
        nothing, and not stored (a call with the store off)."""
        head_ids = head_ids.to(torch.int64).cpu()
        found = self.prefixes.longest(head_ids, exit_layer, namespace) if keep else None
        if found is not None and found.n_tokens == head_ids.numel():
            return found
        done = 0 if found is None else found.n_tokens
        cache = self._cache(found, 1)
        with leaving(self.model.get_decoder().layers[exit_layer]) as left, recording(None), \
                contextlib.suppress(EarlyExit):
            self.model(input_ids=head_ids[done:].unsqueeze(0).to(self.device), past_key_values=cache, use_cache=True)
        hidden = left[0] if found is None else torch.cat([found.hidden, left[0]], dim=1)
        layers = cache.layers[: exit_layer + 1]
        entry = PrefixEntry(head_ids, exit_layer, tuple(layer.keys for layer in layers),
                            tuple(layer.values for layer in layers), hidden, namespace)
        if keep:
            self.prefixes.add(entry)
        return entry

    # -- passages read apart (``passage_reading``) -----------------------------------------------

    @property
    def fingerprint(self) -> str:
        """What the passage store's keys name this draft by: its path, precision, sizes and a
        checksum of its first layer's weights (two drafts of one name with other weights differ)."""
        if self._fingerprint is None:
            config = self.model.config
            first = next(iter(self.model.get_decoder().layers[0].parameters()))
            self._fingerprint = (f"{getattr(config, '_name_or_path', '')}|{self.dtype}|{self.n_layers}|"
                                 f"{float(first.detach().float().sum()):.6e}|{float(first.detach().float().abs().sum()):.6e}")
        return self._fingerprint

    def _reads_apart(self, spec: LookaheadSpec, ids: torch.Tensor, layouts: Sequence[PromptLayout | None] | None,
                     pool_kernel: int) -> ReadingPlan | None:
        """How this batch reads its passages apart, or None when it reads them jointly: no
        ``spec.passages``, a prompt without a layout, passages or anchor, no early exit below the
        last layer, a draft whose layers or rotary keys cannot be run and moved by hand.
        ``pool_kernel``: the scoring's (``ScoringConfig.pool_kernel``)."""
        reading, top = spec.passages, spec.top(self.n_layers)
        if reading is None or not layouts or any(lay is None or not lay.units or not lay.anchor.numel()
                                                 for lay in layouts):
            return None
        parts = DecoderParts.of(self.model)
        if parts is None or not spec.early_exit or top >= self.n_layers - 1 or (
                spec.lookahead > 1 and spec.tokens == "greedy" and not self._embeds_plainly(parts, ids)):
            return None
        if self._plain_rotary is None:
            self._plain_rotary = rotates_plainly(self.model, parts)
            if not self._plain_rotary:
                logger.warning("this draft's rotary keys cannot be moved by rotation: it reads passages jointly")
        if not self._plain_rotary:
            return None
        start = reading.start_layer(list(spec.layers or range(self.n_layers)))
        if start > top:
            raise InputError(f"recompute_from={start} lies above the draft's exit layer {top}")
        return ReadingPlan(reading, top, start, self.passages, self.fingerprint, parts.rotary.inv_freq, pool_kernel)

    def _local_read(self, recorder: Recorder, token_ids: Sequence[torch.Tensor], layouts: Sequence[Any],
                    plan: ReadingPlan, namespace: str, keep: bool) -> LocalRead:
        """The prompts' forward with their passages read apart (``passage_reading.read_prompts``),
        each head served by the prefix store (``keep``: the store is on for the call), and each
        reading up to the question stored there: a (cache, hidden states leaving the exit) maker."""

        # A prompt's reading with its passages read apart is stored apart from joint readings (the
        # same tokens, other states): a start found is always one read the way this call reads.
        apart = f"{namespace}\x00apart:{plan.reading}:{plan.unit}"

        def read() -> tuple[Any, torch.Tensor]:
            heads, laid = [], []
            for b, (ids, layout) in enumerate(zip(token_ids, layouts, strict=True)):
                end = int(recorder.rows[b].min())  # the question (or the last token) is read every time
                stored = self.prefixes.longest(ids[:end], plan.exit_layer, apart) if keep else None
                m = 0 if stored is None else stored.n_tokens
                laid.append(with_head(layout, m))
                if stored is not None and m >= laid[-1].head:  # the store holds the whole head
                    head = stored.start(laid[-1].head)
                else:
                    head = self._read_head(ids[: layout.head], plan.exit_layer, namespace, keep)
                heads.append((head, self._anchor(layout, ids, head, plan.exit_layer, namespace, keep), m))
            parts = DecoderParts.of(self.model)
            assert parts is not None
            cache, hidden, starts = read_prompts(parts, plan, recorder, token_ids, laid, heads, namespace)
            for entry in starts:  # a follow-up over the same passages reads its question only
                if entry is not None and keep:
                    self.prefixes.add(dataclasses.replace(entry, namespace=apart))
            return cache, hidden

        return read

    def _anchor(self, layout: PromptLayout, ids: torch.Tensor, head: PrefixEntry, exit_layer: int, namespace: str,
                keep: bool = True) -> PrefixEntry:
        """The prefix-store entry of ``layout.anchor``: a start of ``head`` when the prompt begins
        with it (a RAG prompt), else read (or found) in the store (``keep``: the store is on)."""
        a = layout.anchor.numel()
        if a <= head.n_tokens and torch.equal(head.token_ids[:a], layout.anchor):
            return head.start(a)
        return self._read_head(layout.anchor, exit_layer, namespace, keep)

    def _read_prompt(self, recorder: Recorder, batch: PaddedBatch, *, stop_after: int | None, leave: Any,
                     head: PrefixEntry | None, local: LocalRead | None) -> tuple[Any, torch.Tensor | None]:
        """(the KV cache, ``_prompt_forward``'s result) of the prompts' forward: joint, or with
        their passages read apart (``local``: the hidden states leaving the exit layer)."""
        if local is not None:
            return local()
        cache = self._cache(head, len(batch.last))
        return cache, self._prompt_forward(recorder, batch, stop_after=stop_after, cache=cache, leave=leave,
                                           head=head)

    def _cache(self, head: PrefixEntry | None, batch: int) -> Any:
        """A new KV cache for ``batch`` prompts, holding ``head``'s keys and values when given."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        if head is not None:
            for i, (keys, values) in enumerate(zip(head.keys, head.values, strict=True)):
                cache.update(keys.expand(batch, -1, -1, -1), values.expand(batch, -1, -1, -1), i)
        return cache

    def _stores_heads(self) -> bool:
        """Whether this draft can resume from a stored head: a decoder whose KV cache is plain
        (every layer a growing full-attention one); checked once."""
        if self._plain_cache is None:
            from transformers import DynamicCache
            from transformers.cache_utils import DynamicLayer

            decoder = self.model.get_decoder() if hasattr(self.model, "get_decoder") else None
            layers = DynamicCache(config=self.model.config).layers
            self._plain_cache = (getattr(decoder, "layers", None) is not None and len(layers) == self.n_layers
                                 and all(type(layer) is DynamicLayer for layer in layers))
        return self._plain_cache

    def _guesses(self, value: int | None, lookahead: int) -> int:
        """Guesses verified per greedy forward: ``value``, or for None (auto) what
        ``DraftConfig.guesses_on`` gives on this draft's device and dtype."""
        return DraftConfig(lookahead_guesses=value).guesses_on(self.device.type, lookahead, self.dtype)

    def _embeds_plainly(self, parts: DecoderParts, ids: torch.Tensor) -> bool:
        """Whether the first decoder layer receives exactly the input embedding's output (checked
        once on one token): what running greedy steps layer by hand assumes. Not so for a model
        whose forward scales or mixes the embeddings itself; it then decodes with full forwards."""
        if self._plain_embedding is None:
            seen: list[torch.Tensor] = []

            def entering(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                seen.append(args[0] if args else kwargs["hidden_states"])
                raise EarlyExit

            with hooked(parts.layers[0], entering, pre=True), recording(None), contextlib.suppress(EarlyExit):
                self.model(input_ids=ids[:1, :1], use_cache=False)
            self._plain_embedding = bool(seen) and torch.equal(seen[0], parts.embed(ids[:1, :1]))
        return self._plain_embedding

    def _check_batch(
        self, lengths: list[int], questions: list[torch.Tensor | None], lookahead: int, extra: int
    ) -> None:
        """``InputError`` for an empty prompt, one over the window, or question indices outside it."""
        for n, question in zip(lengths, questions, strict=True):
            if n == 0:
                raise InputError("cannot score an empty prompt")
            if not self.fits(n, extra):
                raise InputError(
                    f"prompt of {n} tokens plus {extra} look-ahead positions exceeds the draft "
                    f"model's window of {self.max_context}: shorten the context or use a draft "
                    "with a longer window"
                )
            if question is not None and question.numel() and (int(question.min()) < 0 or int(question.max()) >= n):
                raise InputError(f"question token indices must lie in [0, {n})")

    def _right_padded(self, token_ids: Sequence[torch.Tensor], lengths: list[int]) -> PaddedBatch:
        """The prompts padded after each one (ids and attention mask, each (batch, longest prompt)),
        with each prompt's last token index, on the device."""
        ids = torch.zeros(len(lengths), max(lengths), dtype=torch.int64)
        mask = torch.zeros(len(lengths), max(lengths), dtype=torch.int64)
        for b, row in enumerate(token_ids):
            ids[b, : lengths[b]] = row.to(torch.int64).cpu()
            mask[b, : lengths[b]] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        return PaddedBatch(ids, mask, torch.tensor(lengths, device=self.device) - 1)

    def _prompt_forward(
        self, recorder: Recorder, batch: PaddedBatch, *,
        stop_after: int | None, cache: Any = None, leave: Any = None, head: PrefixEntry | None = None,
    ) -> torch.Tensor | None:
        """The prompt's forward: (batch, vocab) logits at each prompt's last token; or None when it
        stopped inside layer ``stop_after``; or, with ``leave`` (a decoder layer), the hidden
        states (batch, width, d_model) leaving that layer, where the forward then stops.

        ``head``: the prompts' shared first tokens, already in ``cache``: the forward reads the
        tokens after them, and the hidden states returned begin with the head's."""
        ids, mask, last = batch.ids, batch.mask, batch.last
        start = 0 if head is None else head.n_tokens
        recorder.stop_after, recorder.offset = stop_after, start
        keep = torch.unique(last)  # logits only where some prompt ends
        with leaving(leave) as left:
            try:
                out = self.model(
                    input_ids=ids[:, start:], attention_mask=mask, past_key_values=cache,
                    use_cache=cache is not None, logits_to_keep=keep - start,
                )
            except EarlyExit:
                if not left or head is None:
                    return left[0] if left else None
                return torch.cat([head.hidden.expand(len(last), -1, -1), left[0]], dim=1)
        return out.logits[torch.arange(len(last), device=self.device), torch.searchsorted(keep, last)]
