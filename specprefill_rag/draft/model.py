"""The draft model: one forward over the prompt plus a look-ahead, with query/key capture.

The draft runs its normal SDPA attention. A function registered in transformers' attention
registry wraps SDPA and, while a capture is active, records each layer's post-RoPE prompt
keys (at prefill), the post-RoPE queries of the question's tokens and of the last prompt
token (at prefill) and the query of each look-ahead token. No N×N matrix is ever built:
scoring needs only those query rows per layer and head.

The look-ahead is either the reference's L − 1 greedy decode steps or the L − 1 likeliest next
tokens ("siblings", ``lookahead``), scored together in one more forward at position n (each
sees the prompt and itself). With early exit the prompt's forward stops after the highest layer
whose attention is aggregated, and the layers above it read a reading set of the prompt to
choose the look-ahead tokens (``lookahead``); the last look-ahead forward always stops there.

A prompt's protected start (template, system prompt, a chat's earlier turns) is read once: its
keys and values go to the draft's prefix store (``prefixkv``), and a later prompt that begins
with it runs its forward over the rest only.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..config import DraftConfig, LookaheadTokens
from ..errors import InputError
from ..loading import eos_ids
from ..types import TokenScores
from . import scoring, short_query_attention
from .cuda_graphs import MIN_GRAPH_WIDTH, StepGraphs
from .early_exit import DecoderParts, LoopShape, reading_set, tree_mask, upper_greedy, upper_logits
from .prefix_store import MIN_PREFIX_TOKENS, PrefixEntry, PrefixStore

MIN_WINDOW_CONTEXT = 64  # context tokens a window must hold beside the protected ones (``DraftModel.windows``)

__all__ = ["CAPTURE_ATTENTION", "DraftCapture", "DraftModel"]

CAPTURE_ATTENTION = "specprefill_sdpa"  # name of our entry in transformers' attention registry

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftCapture:
    """Post-RoPE tensors recorded during one draft run, one entry per layer."""

    queries: tuple[torch.Tensor, ...]  # per layer (heads, n_question + lookahead, head_dim)
    keys: tuple[torch.Tensor, ...]  # per layer (kv_heads, n_prompt, head_dim)
    scaling: tuple[float, ...]  # per layer softmax scale
    lookahead_token_ids: tuple[int, ...]  # the L - 1 greedy tokens the draft produced
    positions: torch.Tensor  # (n_question + lookahead,) int64 prompt index each query sits at (causal mask)
    n_question: int = 0  # the first n_question queries are the question's tokens; the rest the look-ahead
    layer_ids: tuple[int, ...] = ()  # the draft layer of each entry (all layers unless a subset was asked)
    cached_tokens: int = 0  # the prompt's first tokens, read from the draft's prefix store (``prefixkv``)


class _EarlyExit(Exception):
    """Raised inside a forward once the layer it stops after is captured (``_Recorder.stop_after``)."""


class _Recorder:
    """Collects one capture per sequence of a (right-padded) batch."""

    def __init__(
        self,
        lengths: Sequence[int],
        questions: Sequence[torch.Tensor | None],
        layers: frozenset[int] | None = None,
        stop_after: int | None = None,
    ) -> None:
        self.lengths = list(lengths)
        self.layers = layers  # None: every layer
        self.stop_after = stop_after  # layer after whose capture the current forward stops
        self.offset = 0  # prompt tokens before the current forward's first one (a stored head)
        empty = torch.empty(0, dtype=torch.int64)
        self.questions = [q if q is not None else empty for q in questions]
        # Prompt rows whose queries the prefill keeps: the question's tokens, then the last token.
        self.rows = [torch.cat([q, torch.tensor([n - 1])]) for q, n in zip(self.questions, self.lengths, strict=True)]
        self.queries: dict[int, list[list[torch.Tensor]]] = {}  # layer → sequence → pieces
        self.keys: dict[int, list[torch.Tensor]] = {}
        self.scaling: dict[int, float] = {}

    def record(self, module: Any, query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> None:
        # query (batch, heads, q_len, head_dim); key (batch, kv_heads, cached + q_len, head_dim)
        layer = int(module.layer_idx)
        if self.layers is not None and layer not in self.layers:
            return
        if layer not in self.keys:
            self.keys[layer] = [key[b, :, :n].detach() for b, n in enumerate(self.lengths)]
            self.scaling[layer] = float(scaling if scaling is not None else module.scaling)
            # index_select copies: a view would keep the whole prefill query tensor alive
            # (heads × n_prompt × head_dim per layer) until scoring ends.
            self.queries[layer] = [
                [query[b].index_select(1, (rows - self.offset).to(query.device))] for b, rows in enumerate(self.rows)
            ]
        else:  # a look-ahead forward: every query row of it (one greedy token, or all siblings)
            self.lookahead_rows(layer, query)
        if layer == self.stop_after:
            raise _EarlyExit

    def lookahead_rows(self, layer: int, query: torch.Tensor) -> None:
        """Keep a look-ahead forward's query rows of ``layer`` (batch, heads, q_len, head_dim),
        copied (a replayed CUDA graph overwrites its tensors: ``stepgraphs``)."""
        if self.layers is not None and layer not in self.layers:
            return
        for b, pieces in enumerate(self.queries[layer]):
            pieces.append(query[b].clone())

    def keep_lookahead(self, kept: torch.Tensor) -> None:
        """Keep only the look-ahead query rows ``kept`` (batch, rows recorded after the prompt)
        marks: the rows of rejected guesses go (``lookahead.upper_greedy``)."""
        if bool(kept.all()):
            return
        for per_sequence in self.queries.values():
            for b, pieces in enumerate(per_sequence):
                rows = kept[b].nonzero().flatten().to(pieces[0].device)
                pieces[1:] = [torch.cat(pieces[1:], dim=1).index_select(1, rows)]

    def captures(self, lookahead_ids: Sequence[list[int]], cached: int = 0) -> list[DraftCapture]:
        layers = sorted(self.keys)
        if not layers:
            raise RuntimeError(
                f"no attention was captured: the draft must use attn_implementation={CAPTURE_ATTENTION!r}"
            )
        return [
            DraftCapture(
                queries=tuple(torch.cat(self.queries[i][b], dim=1) for i in layers),
                keys=tuple(self.keys[i][b] for i in layers),
                scaling=tuple(self.scaling[i] for i in layers),
                lookahead_token_ids=tuple(lookahead_ids[b]),
                # look-ahead queries see every prompt key: they sit at the last prompt index or after it
                positions=torch.cat([question, torch.full((len(lookahead_ids[b]) + 1,), n - 1)]),
                n_question=int(question.numel()),
                layer_ids=tuple(layers),
                cached_tokens=cached,
            )
            for b, (question, n) in enumerate(zip(self.questions, self.lengths, strict=True))
        ]


_RECORDER: contextvars.ContextVar[_Recorder | None] = contextvars.ContextVar(
    "specprefill_recorder", default=None
)


def _capture_attention(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    recorder = _RECORDER.get()
    if recorder is not None:
        recorder.record(module, query, key, kwargs.get("scaling"))
    if attention_mask is not None and short_query_attention.applies(query, key, attention_mask, kwargs):
        # a look-ahead forward on a GPU
        scaling = kwargs.get("scaling")
        return short_query_attention.attend_short_queries(query, key, value, attention_mask, scaling), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(CAPTURE_ATTENTION, _capture_attention)
    AttentionMaskInterface.register(CAPTURE_ATTENTION, sdpa_mask)


@contextmanager
def _recording(recorder: _Recorder | None) -> Iterator[None]:
    token = _RECORDER.set(recorder)
    try:
        yield
    finally:
        _RECORDER.reset(token)


_HOOKS: contextvars.ContextVar[frozenset[object]] = contextvars.ContextVar("specprefill_hooks", default=frozenset())


@contextmanager
def _hooked(module: Any, hook: Any, *, pre: bool = False) -> Iterator[None]:
    """While open, ``hook`` runs as ``module``'s forward hook (``pre``: forward pre-hook, with
    kwargs) for forwards of the calling context only. A module's hooks are shared by every
    thread, and the gateway runs concurrent requests' draft forwards in threads of one
    process: another request's forward must neither stop at nor be read by this one's hook."""
    marker = object()
    token = _HOOKS.set(_HOOKS.get() | {marker})

    def mine(*args: Any, **kwargs: Any) -> Any:
        return hook(*args, **kwargs) if marker in _HOOKS.get() else None

    handle = module.register_forward_pre_hook(mine, with_kwargs=True) if pre else module.register_forward_hook(mine)
    try:
        yield
    finally:
        handle.remove()
        _HOOKS.reset(token)


@contextmanager
def _leaving(layer: Any) -> Iterator[list[torch.Tensor]]:
    """While open, a forward of this context through ``layer`` (a decoder layer; None: none)
    appends the hidden states leaving it to the list yielded and stops there (``_EarlyExit``)."""
    left: list[torch.Tensor] = []

    def stop(module: Any, args: Any, output: Any) -> None:
        left.append(output[0] if isinstance(output, tuple) else output)
        raise _EarlyExit

    with _hooked(layer, stop) if layer is not None else contextlib.nullcontext():
        yield left


def _heads(contexts: Sequence[torch.Tensor | None]) -> list[int]:
    """Each prompt's protected start: its tokens before the first prunable one (``contexts``
    (n,) bool); none without a mask or a prunable token."""
    return [0 if c is None or not bool(c.any()) else int(c.to(torch.int8).argmax()) for c in contexts]


class DraftModel:
    """A small causal LM that scores prompt tokens for SpecPrefill.

    Works with any transformers decoder whose attention modules carry ``layer_idx`` and go
    through the attention registry (Llama, Qwen2, Mistral, ... families). The model is switched
    to the capturing SDPA wrapper, which behaves exactly like SDPA outside a capture.
    """

    def __init__(self, model: Any, tokenizer: Any, config: DraftConfig | None = None) -> None:
        """``config`` is this draft's default; an engine passes its own to ``score`` instead of
        changing it, so several engines can share one draft."""
        _register()
        model.set_attn_implementation(CAPTURE_ATTENTION)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config or DraftConfig()
        self._plain_embedding: bool | None = None  # see _embeds_plainly
        self._plain_cache: bool | None = None  # see _stores_heads
        # Keys and values of prompt heads read before (``prefixkv``; DraftConfig.prefix_cache_entries).
        self.prefixes = PrefixStore(self.config.prefix_cache_entries, self.config.prefix_cache_bytes)
        self.graphs: StepGraphs | None = None  # the look-ahead's CUDA graphs (``capture_graphs``)
        # The ids that end the draft's answer (``DraftConfig.lookahead_stop_at_eos``).
        self.end_ids = eos_ids(getattr(getattr(model, "generation_config", None), "eos_token_id", None), tokenizer)

    @classmethod
    def from_pretrained(
        cls, name_or_path: str, config: DraftConfig | None = None, *,
        dtype: str | torch.dtype = "auto", device: str | torch.device = "auto",
    ) -> DraftModel:
        """Load a draft by packaged short name, HF directory or GGUF path (see ``loading``);
        ``"auto"``: CUDA + bfloat16 when torch sees a GPU, else the CPU, in bfloat16 where it
        multiplies bf16 natively and float32 otherwise: the main model's rule
        (``loading.resolve_dtype``), so both run at the precision the device is fastest in."""
        from ..loading import load_model

        model, tokenizer = load_model(name_or_path, dtype=dtype, device=device)
        return cls(model, tokenizer, config)

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

    def windows(self, n_tokens: int, context: torch.Tensor | None, extra_positions: int = 0
                ) -> list[torch.Tensor] | None:
        """How a prompt too long for the window is read (``score_batch``): None when it fits;
        else windows, (m,) sorted prompt indices each, that hold every protected token (template,
        instructions, question: ``context`` (n,) bool marks the prunable ones) and one run of
        consecutive prunable tokens, the runs of equal size and together all of them. Each
        window fits with its look-ahead. ``InputError`` when the protected tokens alone leave
        fewer than ``MIN_WINDOW_CONTEXT`` positions."""
        if self.fits(n_tokens, extra_positions):
            return None
        if context is None or not bool(context.any()):
            raise InputError(f"the prompt of {n_tokens} draft tokens exceeds the draft model's window of "
                             f"{self.max_context} and has no prunable context to read in windows")
        context = context.bool().cpu()
        protected, prunable = (~context).nonzero().flatten(), context.nonzero().flatten()
        room = self.max_context - extra_positions - int(protected.numel())
        if room < MIN_WINDOW_CONTEXT:
            raise InputError(f"the prompt's {protected.numel()} protected tokens and {extra_positions} look-ahead "
                             f"positions leave {max(room, 0)} of the draft model's window of {self.max_context} "
                             f"for the context (at least {MIN_WINDOW_CONTEXT} needed to read it in windows)")
        count = -(-int(prunable.numel()) // room)
        return [torch.cat([protected, run]).sort().values for run in prunable.tensor_split(count)]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def capture(
        self,
        token_ids: torch.Tensor,
        lookahead: int | None = None,
        question: torch.Tensor | None = None,
        *,
        layers: Sequence[int] | None = None,
        early_exit: bool = False,
        tokens: LookaheadTokens | None = None,
        upper_keep: float | None = None,
        guesses: int | None = None,
        head: int = 0,
        stop_at_eos: bool | None = None,
    ) -> DraftCapture:
        """Prefill ``token_ids`` (n_prompt,) and run the look-ahead, recording post-RoPE queries
        of the ``question`` token indices (m,), of the last prompt token and of each of the
        ``lookahead - 1`` look-ahead tokens.

        ``tokens`` (default: the draft's ``DraftConfig.lookahead_tokens``): ``"siblings"`` = the
        ``lookahead - 1`` likeliest next tokens, in one more forward, all at position n_prompt,
        each attending to the prompt and itself; ``"greedy"`` = that many greedy decode steps.
        ``layers``: record only these layers (default: all); the last look-ahead forward stops
        after the highest of them. ``early_exit``: the prompt's forward stops there too; the
        look-ahead tokens then come from the upper layers run over the ``upper_keep`` share of
        the prompt (default: the draft's ``DraftConfig.upper_keep``) that the recorded rows
        score highest (``lookahead.upper_greedy``, ``lookahead.upper_logits``), and greedy steps
        read that share in their upper layers too. The recorded prompt tensors are exactly those
        of the full forward. ``guesses`` (default: the draft's ``DraftConfig.lookahead_guesses``;
        None: ``lookahead - 2`` on CUDA, else 0): with early exit, greedy tokens are verified
        that many guesses per forward (``lookahead.upper_greedy``): the same tokens and queries
        in fewer forwards. ``head``: the prompt's first tokens that later prompts may share (its
        protected start): read from the draft's prefix store (``prefixkv``) when it holds them, and
        stored once read; the prompt's forward then runs over the rest only. ``stop_at_eos``
        (default: the draft's ``DraftConfig.lookahead_stop_at_eos``): greedy tokens stop where
        the draft's answer ends (before its first ``end_ids`` token), so a capture may hold fewer
        than ``lookahead - 1`` look-ahead tokens and rows.
        """
        return self.capture_batch(
            [token_ids], lookahead, [question], layers=layers, early_exit=early_exit, tokens=tokens,
            upper_keep=upper_keep, guesses=guesses, heads=[head], stop_at_eos=stop_at_eos,
        )[0]

    @torch.inference_mode()
    def capture_batch(
        self,
        token_ids: Sequence[torch.Tensor],
        lookahead: int | None = None,
        questions: Sequence[torch.Tensor | None] | None = None,
        *,
        layers: Sequence[int] | None = None,
        early_exit: bool = False,
        tokens: LookaheadTokens | None = None,
        upper_keep: float | None = None,
        guesses: int | None = None,
        heads: Sequence[int] | None = None,
        graphs: bool = True,
        stop_at_eos: bool | None = None,
        namespace: str = "",
    ) -> list[DraftCapture]:
        """``capture`` for several prompts in one right-padded forward per step.

        Padding sits after each prompt and is masked out of every attention; look-ahead tokens
        of prompt b sit at positions n_b, n_b + 1, ... (greedy) or all at n_b (siblings). So
        each capture equals the prompt's own (within floating-point tolerance). ``heads``: one
        ``capture`` head per prompt; the prefix store serves the batch when all prompts begin
        with the same tokens (``_shared_head``). ``graphs``: replay the look-ahead's CUDA
        graphs where ``capture_graphs`` captured one for this shape (False: run it eagerly).
        ``namespace``: the requests' cache salt; the prefix store is read and written under it.
        """
        lookahead = self.config.lookahead if lookahead is None else lookahead
        tokens = self.config.lookahead_tokens if tokens is None else tokens
        upper_keep = self.config.upper_keep if upper_keep is None else upper_keep
        guesses = self._guesses(self.config.lookahead_guesses if guesses is None else guesses, lookahead)
        stop_at_eos = self.config.lookahead_stop_at_eos if stop_at_eos is None else stop_at_eos
        questions = list(questions) if questions is not None else [None] * len(token_ids)
        if not token_ids or len(questions) != len(token_ids):
            raise InputError("pass one question (or None) per prompt, and at least one prompt")
        lengths = [int(ids.numel()) for ids in token_ids]
        extra = self.config.extra_positions(lookahead, tokens)
        self._check_batch(lengths, questions, lookahead, extra)
        wanted = None if layers is None else frozenset(int(i) for i in layers)
        top = max(wanted) if wanted else self.n_layers - 1  # the highest recorded layer
        recorder = _Recorder(lengths, [None if q is None else q.to(torch.int64).cpu() for q in questions], wanted)
        ids, mask = self._right_padded(token_ids, lengths)
        last = torch.tensor(lengths, device=self.device) - 1  # (batch,) each prompt's last token
        cached = self._shared_head(token_ids, lengths, recorder.questions, heads)
        head = self._read_head(token_ids[0][:cached], self._exit_layer(lookahead, tokens, early_exit, top, ids),
                               namespace) if cached else None
        with _recording(recorder):
            if lookahead == 1:
                cache = self._cache(head, len(lengths)) if head is not None else None
                self._prompt_forward(recorder, ids, mask, last, stop_after=top if early_exit else None, cache=cache,
                                     head=head)
                return recorder.captures([[] for _ in lengths], cached)
            upper = upper_keep if early_exit else None
            if tokens == "siblings":
                siblings = self._siblings(recorder, ids, mask, last, lookahead - 1, top, upper, head)
                return recorder.captures(siblings.tolist(), cached)
            found = self._greedy(recorder, ids, mask, last, lookahead - 1, top, upper, guesses, head,
                                 self.graphs if graphs else None, self.end_ids if stop_at_eos else frozenset())
            return recorder.captures(found, cached)

    def _prompt_forward(
        self, recorder: _Recorder, ids: torch.Tensor, mask: torch.Tensor, last: torch.Tensor, *,
        stop_after: int | None, cache: Any = None, leave: Any = None, head: PrefixEntry | None = None,
    ) -> torch.Tensor | None:
        """The prompt's forward: (batch, vocab) logits at each prompt's last token; or None when it
        stopped inside layer ``stop_after``; or, with ``leave`` (a decoder layer), the hidden
        states (batch, width, d_model) leaving that layer, where the forward then stops.

        ``head``: the prompts' shared first tokens, already in ``cache``: the forward reads the
        tokens after them, and the hidden states returned begin with the head's."""
        start = 0 if head is None else head.n_tokens
        recorder.stop_after, recorder.offset = stop_after, start
        keep = torch.unique(last)  # logits only where some prompt ends
        with _leaving(leave) as left:
            try:
                out = self.model(
                    input_ids=ids[:, start:], attention_mask=mask, past_key_values=cache,
                    use_cache=cache is not None, logits_to_keep=keep - start,
                )
            except _EarlyExit:
                if not left or head is None:
                    return left[0] if left else None
                return torch.cat([head.hidden.expand(len(last), -1, -1), left[0]], dim=1)
        return out.logits[torch.arange(len(last), device=self.device), torch.searchsorted(keep, last)]

    def _siblings(
        self, recorder: _Recorder, ids: torch.Tensor, mask: torch.Tensor, last: torch.Tensor, k: int, top: int,
        upper_keep: float | None, head: PrefixEntry | None = None,
    ) -> torch.Tensor:
        """Two forwards: the prompt's, then the ``k`` likeliest next tokens of each prompt together,
        each at position n_b seeing its prompt and itself (``lookahead.tree_mask``). (batch, k).

        ``upper_keep``: the prompt's forward stops after layer ``top``; the layers above it read
        that share of each prompt's tokens only, the best by the recorded rows (question and last
        token), to find the likeliest next tokens (``lookahead.upper_logits``). None: the full
        forward's logits. ``head``: the prompts' shared start, read from the prefix store.
        """
        cache = self._cache(head, len(last))
        parts = DecoderParts.of(self.model) if upper_keep is not None and top < self.n_layers - 1 else None
        if parts is None or upper_keep is None:
            logits = self._prompt_forward(recorder, ids, mask, last, stop_after=None, cache=cache, head=head)
        else:
            leaving = self._prompt_forward(recorder, ids, mask, last, stop_after=None, cache=cache,
                                           leave=parts.layers[top], head=head)
            assert leaving is not None
            logits = self._upper_logits(recorder, parts, leaving, last, top, upper_keep)
        assert logits is not None
        siblings = logits.topk(k, dim=-1).indices  # (batch, k), likeliest first
        recorder.stop_after = top
        with contextlib.suppress(_EarlyExit):
            self.model(
                input_ids=siblings, position_ids=(last + 1).unsqueeze(1).expand(-1, k),
                attention_mask=tree_mask(mask, k), past_key_values=cache, use_cache=True, logits_to_keep=1,
            )
        return siblings

    def _upper_logits(
        self, recorder: _Recorder, parts: DecoderParts, leaving: torch.Tensor, last: torch.Tensor, top: int,
        share: float, layers: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """(batch, vocab): each prompt's next-token logits from the layers above ``top`` over its
        reading set (``leaving`` (batch, width, d_model): the hidden states leaving ``top``),
        chosen by the rows of ``layers`` (default: every recorded layer)."""
        with _recording(None):  # the upper layers' rows are not the prompt's
            keeps = self._reading_sets(recorder, share, layers)
            return torch.stack([
                upper_logits(parts, leaving[b, : end + 1], keep, top + 1)
                for b, (keep, end) in enumerate(zip(keeps, last.tolist(), strict=True))
            ])

    def _reading_sets(self, recorder: _Recorder, share: float, layers: Sequence[int] | None = None
                      ) -> list[torch.Tensor]:
        """Each prompt's reading set (``lookahead.reading_set``), chosen by its recorded rows in
        ``layers`` (default every recorded one), on the device."""
        return [
            reading_set(self._first_scores(recorder, b, layers), question, share).to(self.device)
            for b, question in enumerate(recorder.questions)
        ]

    def _first_scores(self, recorder: _Recorder, b: int, layers: Sequence[int] | None = None) -> torch.Tensor:
        """(n_b,) prompt b's importance from the rows recorded at the prompt (its question's and
        last token's queries, in ``layers``, default every recorded one): what chooses the upper
        layers' reading set."""
        positions = recorder.rows[b]
        rows = torch.stack([
            scoring.layer_rows(recorder.queries[layer][b][0], recorder.keys[layer][b], recorder.scaling[layer],
                               self.config.pool_kernel, positions=positions.to(self.device))
            for layer in (sorted(recorder.keys) if layers is None else layers)
        ])  # (layers, n_question + 1, n_b)
        return scoring.importance(rows)

    def _greedy(
        self, recorder: _Recorder, ids: torch.Tensor, mask: torch.Tensor, last: torch.Tensor, steps: int, top: int,
        upper_keep: float | None = None, guesses: int = 0, head: PrefixEntry | None = None,
        loops: StepGraphs | None = None, end_ids: frozenset[int] = frozenset(),
    ) -> list[list[int]]:
        """The reference's look-ahead: ``steps`` greedy decode steps after the prompt's forward,
        with no host synchronisation inside the loop (verified guesses, or ``end_ids``: one per
        forward). Each prompt's tokens fed: ``steps``, or with ``end_ids`` those before the first
        of them (their recorded rows only: the rest are dropped).

        ``upper_keep``: the prompt's forward stops after layer ``top``, and the layers above it
        read that share of each prompt (its reading set, as for siblings) in every step
        (``lookahead.upper_greedy``, which verifies ``guesses`` guessed tokens per forward); the
        recorded layers see the whole prompt. None: full forwards, one per step. ``head``: the
        prompts' shared start, read from the prefix store. ``loops``: captured CUDA graphs of
        the steps (``stepgraphs``).
        """
        from transformers import DynamicCache

        cache = self._cache(head, len(last))
        parts = DecoderParts.of(self.model) if upper_keep is not None and top < self.n_layers - 1 else None
        if parts is not None and upper_keep is not None and self._embeds_plainly(parts, ids):
            leaving = self._prompt_forward(recorder, ids, mask, last, stop_after=None, cache=cache,
                                           leave=parts.layers[top], head=head)
            assert leaving is not None
            # Only the steps' queries are recorded: the layers above ``top`` never are.
            upper = DynamicCache(config=self.model.config)
            keeps = self._reading_sets(recorder, upper_keep)
            found, kept = upper_greedy(parts, cache, upper, leaving, ids, mask, keeps, top + 1, steps, guesses,
                                       loops=loops, end_ids=sorted(end_ids))
            recorder.keep_lookahead(kept)
            return [row[:n] for row, n in zip(found.tolist(), kept.sum(1).tolist(), strict=True)]
        logits = self._prompt_forward(recorder, ids, mask, last, stop_after=None, cache=cache, head=head)
        assert logits is not None
        return self._decode_steps(recorder, cache, logits, mask, last, steps, top, end_ids)

    def _decode_steps(self, recorder: _Recorder, cache: Any, logits: torch.Tensor, mask: torch.Tensor,
                      last: torch.Tensor, steps: int, top: int, end_ids: frozenset[int]) -> list[list[int]]:
        """Greedy decode steps over full forwards from the prompt's next-token ``logits``
        (``_greedy`` without early exit); with ``end_ids`` a row's tokens end before the first
        of them, its later rows are dropped and the loop ends once every row's answer has."""
        batch = len(last)
        ends = torch.tensor(sorted(end_ids), dtype=torch.int64, device=self.device)
        tokens: list[torch.Tensor] = []
        ended = torch.zeros(batch, dtype=torch.bool, device=self.device)
        fed: list[torch.Tensor] = []  # (batch,) per step: which rows' tokens count
        for step in range(steps):
            tokens.append(logits.argmax(-1))  # (batch,)
            if end_ids:
                ended |= torch.isin(tokens[-1], ends)
                if bool(ended.all()):
                    break
            fed.append(~ended)
            mask = torch.cat([mask, torch.ones(batch, 1, dtype=mask.dtype, device=self.device)], dim=1)
            recorder.stop_after = top if step == steps - 1 else None  # the last step's logits go unused
            try:
                out = self.model(
                    input_ids=tokens[-1].reshape(batch, 1), position_ids=(last + 1 + step).reshape(batch, 1),
                    attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=1,
                )
            except _EarlyExit:
                break
            logits = out.logits[:, -1]
        kept = torch.stack(fed, dim=1) if fed else torch.zeros(batch, 0, dtype=torch.bool, device=self.device)
        recorder.keep_lookahead(kept)
        return [row[:n] for row, n in zip(torch.stack(tokens, dim=1).tolist(), kept.sum(1).tolist(), strict=True)]

    # -- CUDA graphs of the look-ahead (``stepgraphs``) ---------------------------------------

    @torch.inference_mode()
    def capture_graphs(self, config: DraftConfig | None = None, batches: Sequence[int] = (1,)) -> int:
        """Capture the greedy look-ahead's forwards as CUDA graphs for what ``config`` (default:
        the draft's own) runs: each batch size of ``batches`` and every padded prompt width from
        512 up to ``graph_max_tokens`` and the window. What an engine's warm-up calls, so that no
        request pays for a capture. Returns how many loop shapes were captured now: 0 where
        nothing is to capture (a CPU draft, ``cuda_graphs=False``, a look-ahead that is not
        greedy steps after an early exit). A capture that fails is logged and ends the capturing:
        the widths not captured run eagerly (the draft still serves)."""
        cfg = config or self.config
        shapes = self._graph_shapes(cfg, batches)
        if not shapes:
            return 0
        if self.graphs is None:
            parts = DecoderParts.of(self.model)
            assert parts is not None
            self.graphs = StepGraphs(parts, self.device, _recording, _RECORDER.get)
        captured = 0
        for shape in shapes:
            try:
                captured += self.graphs.capture(shape)
            except Exception as error:  # a kernel that cannot be captured: serve eagerly, never fail to start
                logger.warning("could not capture the draft's look-ahead as a CUDA graph for batch %d, width %d "
                               "(%s: %s): the look-ahead of the shapes not captured runs eagerly",
                               shape.batch, shape.width, type(error).__name__, error)
                break
        return captured

    def _graph_shapes(self, cfg: DraftConfig, batches: Sequence[int]) -> list[LoopShape]:
        """The loop shapes ``capture_graphs`` captures for ``cfg``: none unless the draft runs
        ``lookahead.upper_greedy`` on a CUDA device with graphs on."""
        lookahead, top = cfg.lookahead, max(cfg.layer_indices(self.n_layers))
        probe = torch.zeros(1, 1, dtype=torch.int64, device=self.device)
        if (not cfg.graphs_on(self.device.type) or lookahead < 2 or cfg.lookahead_tokens != "greedy"
                or not cfg.early_exit or top >= self.n_layers - 1
                or self._exit_layer(lookahead, "greedy", True, top, probe) != top):
            return []  # no upper_greedy loop: siblings, full forwards, no layer above the aggregated ones
        cache = self._cache(None, 1)
        with _recording(None):
            self.model(input_ids=probe, past_key_values=cache, use_cache=True)  # the cache's sizes
        limit = min(cfg.graph_max_tokens, self.max_context - cfg.extra_positions(lookahead, "greedy"))
        feed = 1 + min(self._guesses(cfg.lookahead_guesses, lookahead), lookahead - 2)
        widths = [MIN_GRAPH_WIDTH]
        while widths[-1] < limit:
            widths.append(2 * widths[-1])
        one = [LoopShape.of(cache, top + 1, self.n_layers, lookahead - 1, feed, width, width) for width in widths]
        return [dataclasses.replace(shape, batch=b) for b in sorted(set(batches)) for shape in one]

    # -- the prefix store: prompt heads read once (``prefixkv``) ----------------------------

    def _shared_head(self, token_ids: Sequence[torch.Tensor], lengths: list[int], questions: list[torch.Tensor],
                     heads: Sequence[int] | None) -> int:
        """How many first tokens of the batch the prefix store may serve: the shortest of
        ``heads`` when every prompt begins with the same tokens, before every question token and
        each prompt's last token (their queries are recorded); 0 when that is under
        ``MIN_PREFIX_TOKENS``, the store is off, or this draft's cache is not plain."""
        if not heads or self.prefixes.entries == 0:
            return 0
        if len(heads) != len(lengths):
            raise InputError("pass one head length per prompt")
        starts = [int(q.min()) for q in questions if q.numel()]
        p = min(min(int(h) for h in heads), min(lengths) - 1, *starts)
        if p < MIN_PREFIX_TOKENS or not self._stores_heads():
            return 0
        first = token_ids[0][:p].to(torch.int64).cpu()
        return p if all(torch.equal(t[:p].to(torch.int64).cpu(), first) for t in token_ids[1:]) else 0

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

    def _read_head(self, head_ids: torch.Tensor, exit_layer: int, namespace: str) -> PrefixEntry:
        """The store's entry for ``head_ids`` (p,) in ``namespace``: stored, or read on from the
        longest head stored there that it begins with (a chat's previous turn), or from nothing,
        and then stored."""
        head_ids = head_ids.to(torch.int64).cpu()
        found = self.prefixes.longest(head_ids, exit_layer, namespace)
        if found is not None and found.n_tokens == head_ids.numel():
            return found
        done = 0 if found is None else found.n_tokens
        cache = self._cache(found, 1)
        with _leaving(self.model.get_decoder().layers[exit_layer]) as left, _recording(None), \
                contextlib.suppress(_EarlyExit):
            self.model(input_ids=head_ids[done:].unsqueeze(0).to(self.device), past_key_values=cache, use_cache=True)
        hidden = left[0] if found is None else torch.cat([found.hidden, left[0]], dim=1)
        layers = cache.layers[: exit_layer + 1]
        entry = PrefixEntry(head_ids, exit_layer, tuple(layer.keys for layer in layers),
                            tuple(layer.values for layer in layers), hidden, namespace)
        self.prefixes.add(entry)
        return entry

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
        dtype = next(self.model.parameters()).dtype
        return DraftConfig(lookahead_guesses=value).guesses_on(self.device.type, lookahead, dtype)

    def _embeds_plainly(self, parts: DecoderParts, ids: torch.Tensor) -> bool:
        """Whether the first decoder layer receives exactly the input embedding's output (checked
        once on one token): what running greedy steps layer by hand assumes. Not so for a model
        whose forward scales or mixes the embeddings itself; it then decodes with full forwards."""
        if self._plain_embedding is None:
            seen: list[torch.Tensor] = []

            def entering(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                seen.append(args[0] if args else kwargs["hidden_states"])
                raise _EarlyExit

            with _hooked(parts.layers[0], entering, pre=True), _recording(None), contextlib.suppress(_EarlyExit):
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

    def _right_padded(self, token_ids: Sequence[torch.Tensor], lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, attention mask), each (batch, longest prompt), padded after each prompt, on the device."""
        ids = torch.zeros(len(lengths), max(lengths), dtype=torch.int64)
        mask = torch.zeros(len(lengths), max(lengths), dtype=torch.int64)
        for b, row in enumerate(token_ids):
            ids[b, : lengths[b]] = row.to(torch.int64).cpu()
            mask[b, : lengths[b]] = 1
        return ids.to(self.device), mask.to(self.device)

    def score(
        self,
        token_ids: torch.Tensor,
        *,
        question: torch.Tensor | None = None,
        context: torch.Tensor | None = None,
        config: DraftConfig | None = None,
    ) -> TokenScores:
        """Importance of every prompt token, (n_prompt,) float32 on the CPU.

        question: (m,) int64 indices of the question's tokens, whose queries join the look-ahead
        ones (``DraftConfig.lookahead_weight`` splits the vote); None scores with the look-ahead
        alone. context: (n_prompt,) bool, the prunable tokens, over which each attention row is
        renormalised when ``config.normalize``. config: this call's settings (default: the
        draft's own).
        """
        return self.score_batch([token_ids], questions=[question], contexts=[context], config=config)[0]

    @torch.inference_mode()
    def score_batch(
        self,
        token_ids: Sequence[torch.Tensor],
        *,
        questions: Sequence[torch.Tensor | None] | None = None,
        contexts: Sequence[torch.Tensor | None] | None = None,
        config: DraftConfig | None = None,
        namespace: str = "",
    ) -> list[TokenScores]:
        """``score`` for several prompts of any lengths in one batched draft run (one padded
        prefill, one batched step per look-ahead token); each result equals the prompt's own
        ``score`` within floating-point tolerance. ``seconds`` is the whole batch's time.

        Each prompt's protected start (its tokens before the first one ``contexts`` marks
        prunable) is its head (``capture``): an application's system prompt, a chat's earlier
        turns are read once and then served from the prefix store (``DraftConfig.prefix_cache_entries``),
        under ``namespace`` (the requests' cache salt: prompts of other namespaces never share a head)."""
        cfg = config or self.config
        start = time.perf_counter()
        batch = len(token_ids)
        questions = list(questions) if questions is not None else [None] * batch
        contexts = list(contexts) if contexts is not None else [None] * batch
        if len(questions) != batch or len(contexts) != batch:
            raise InputError("pass one question and one context mask (or None) per prompt")
        lookaheads = [cfg.lookahead_for(0 if q is None else int(q.numel())) for q in questions]
        windows = [self.windows(int(ids.numel()), c, cfg.extra_positions(n))
                   for ids, c, n in zip(token_ids, contexts, lookaheads, strict=True)]
        if any(w is not None for w in windows):
            return self._score_windowed(token_ids, questions, contexts, windows, cfg, namespace)
        layers = cfg.layer_indices(self.n_layers)
        if cfg.prefix_cache_entries:  # 0: this call neither reads nor changes the store
            self.prefixes.resize(cfg.prefix_cache_entries, cfg.prefix_cache_bytes)
        caps = self.capture_batch(
            token_ids, max(lookaheads), questions, layers=layers, early_exit=cfg.early_exit,
            tokens=cfg.lookahead_tokens, upper_keep=cfg.upper_keep,
            guesses=self._guesses(cfg.lookahead_guesses, max(lookaheads)),
            heads=_heads(contexts) if cfg.prefix_cache_entries else None, graphs=cfg.cuda_graphs,
            stop_at_eos=cfg.lookahead_stop_at_eos, namespace=namespace,
        )
        results = [self._scores(cap, lookahead, context, cfg)
                   for cap, lookahead, context in zip(caps, lookaheads, contexts, strict=True)]
        seconds = time.perf_counter() - start
        return [dataclasses.replace(r, seconds=seconds) for r in results]

    def _scores(self, cap: DraftCapture, lookahead: int, context: torch.Tensor | None, cfg: DraftConfig
                ) -> TokenScores:
        """One prompt's scores from its capture (``lookahead``: the rows it needs)."""
        # A prompt that needs fewer look-ahead rows than the batch, or whose answer ended sooner.
        lookahead = min(lookahead, 1 + len(cap.lookahead_token_ids))
        rows = cap.n_question + lookahead
        mask = context.to(self.device) if context is not None and cfg.normalize else None
        positions = cap.positions[:rows].to(self.device)
        per_layer = torch.stack(
            [
                scoring.layer_rows(
                    cap.queries[i][:, :rows], cap.keys[i], cap.scaling[i], cfg.pool_kernel,
                    positions=positions, context=mask, heads=cfg.heads,
                )
                for i in range(len(cap.keys))
            ]
        )  # (layers, n_question + lookahead, n_prompt)
        weights = scoring.query_weights(cap.n_question, lookahead, cfg.lookahead_weight)
        return TokenScores(scores=scoring.importance(per_layer, weights).cpu(),
                           lookahead_token_ids=cap.lookahead_token_ids[: lookahead - 1], seconds=0.0,
                           cached_tokens=cap.cached_tokens)

    def _score_windowed(self, token_ids: Sequence[torch.Tensor], questions: list[torch.Tensor | None],
                        contexts: list[torch.Tensor | None], windows: list[list[torch.Tensor] | None],
                        cfg: DraftConfig, namespace: str = "") -> list[TokenScores]:
        """``score_batch`` when some prompts exceed the window: those that fit are scored
        together, each other one window at a time (``windows``); a prunable token gets its
        window's score, a protected one (in every window) its highest."""
        start = time.perf_counter()
        fit = [b for b, w in enumerate(windows) if w is None]
        results: dict[int, TokenScores] = {}
        if fit:
            scored = self.score_batch([token_ids[b] for b in fit], questions=[questions[b] for b in fit],
                                      contexts=[contexts[b] for b in fit], config=cfg, namespace=namespace)
            results.update(zip(fit, scored, strict=True))
        for b, parts in enumerate(windows):
            if parts is None:
                continue
            question, context = questions[b], contexts[b]
            assert context is not None  # ``windows`` needs it
            scores = torch.full((int(token_ids[b].numel()),), -math.inf)
            read: list[TokenScores] = []
            for index in parts:
                local = None if question is None else torch.searchsorted(index, question[torch.isin(question, index)])
                (part,) = self.score_batch([token_ids[b][index]], questions=[local], contexts=[context.cpu()[index]],
                                           config=cfg, namespace=namespace)
                scores[index] = torch.maximum(scores[index], part.scores)
                read.append(part)
            results[b] = TokenScores(scores=scores, lookahead_token_ids=read[0].lookahead_token_ids, seconds=0.0,
                                     cached_tokens=sum(part.cached_tokens for part in read), windows=len(parts))
        seconds = time.perf_counter() - start
        return [dataclasses.replace(results[b], seconds=seconds) for b in range(len(token_ids))]
