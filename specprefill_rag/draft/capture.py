"""Query/key capture: the draft's attention records the rows scoring needs, and nothing more.

The draft runs its normal SDPA attention. A function registered in transformers' attention
registry (``CAPTURE_ATTENTION``) wraps SDPA and, while a ``Recorder`` is active in the calling
context (``recording``), records each layer's post-RoPE prompt keys (at prefill), the post-RoPE
queries of the question's tokens and of the last prompt token (at prefill) and the query of each
look-ahead token. No N×N matrix is ever built: scoring needs only those query rows per layer and
head. ``hooked`` and ``leaving`` stop a forward after a given layer for the calling context only.

Public, through ``draft.probe``, for benchmarks that drive the draft's forwards themselves
(``benchmarks/lib/evidence_capture.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from . import short_query_attention

__all__ = [
    "CAPTURE_ATTENTION", "DraftCapture", "EarlyExit", "Recorder", "capture_attention", "current_recorder", "hooked",
    "leaving", "recording", "register",
]

CAPTURE_ATTENTION = "specprefill_sdpa"  # name of our entry in transformers' attention registry

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
    cached_tokens: int = 0  # the prompt's first tokens, read from the draft's prefix store (``prefix_store``)
    passages_cached: int = 0  # its passages found in the draft's passage store (``passage_reading``)
    passages_read: int = 0  # its passages the draft read now (and stored)


class EarlyExit(Exception):
    """Raised inside a forward once the layer it stops after is captured (``Recorder.stop_after``)."""


class Recorder:
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
        # Where each sequence's rows sit among the current forward's queries when it reads tokens
        # that are not one run (``passage_reading``); None: at their prompt index less ``offset``.
        self.query_index: list[torch.Tensor] | None = None
        # Per sequence, when its passages were read apart: (head tokens from the prefix store,
        # passages found in the passage store, passages read now); None: read jointly.
        self.stores: list[tuple[int, int, int] | None] = [None] * len(self.lengths)
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
            index = self.query_index or [rows - self.offset for rows in self.rows]
            self.queries[layer] = [[query[b].index_select(1, at.to(query.device))] for b, at in enumerate(index)]
        else:  # a look-ahead forward: every query row of it (one greedy token, or all siblings)
            self.lookahead_rows(layer, query)
        if layer == self.stop_after:
            raise EarlyExit

    def lookahead_rows(self, layer: int, query: torch.Tensor) -> None:
        """Keep a look-ahead forward's query rows of ``layer`` (batch, heads, q_len, head_dim),
        copied (a replayed CUDA graph overwrites its tensors: ``cuda_graphs``)."""
        if self.layers is not None and layer not in self.layers:
            return
        for b, pieces in enumerate(self.queries[layer]):
            pieces.append(query[b].clone())

    def adopt(self, b: int, other: Recorder) -> None:
        """Take sequence ``b``'s rows from ``other``, a recorder of that prompt alone (a prompt read
        on its own, ``passage_reading``): the look-ahead then records into this batch as usual."""
        for layer, keys in other.keys.items():
            self.keys.setdefault(layer, [torch.empty(0)] * len(self.lengths))[b] = keys[0]
            self.queries.setdefault(layer, [[] for _ in self.lengths])[b] = other.queries[layer][0]
            self.scaling[layer] = other.scaling[layer]

    def keep_lookahead(self, kept: torch.Tensor) -> None:
        """Keep only the look-ahead query rows ``kept`` (batch, rows recorded after the prompt)
        marks: the rows of rejected guesses go (``early_exit.upper_greedy``)."""
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
                cached_tokens=cached if stores is None else stores[0],
                passages_cached=0 if stores is None else stores[1],
                passages_read=0 if stores is None else stores[2],
            )
            for b, (question, n, stores) in enumerate(zip(self.questions, self.lengths, self.stores, strict=True))
        ]


_RECORDER: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar(
    "specprefill_recorder", default=None
)


def capture_attention(
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


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(CAPTURE_ATTENTION, capture_attention)
    AttentionMaskInterface.register(CAPTURE_ATTENTION, sdpa_mask)


@contextmanager
def recording(recorder: Recorder | None) -> Iterator[None]:
    token = _RECORDER.set(recorder)
    try:
        yield
    finally:
        _RECORDER.reset(token)


_HOOKS: contextvars.ContextVar[frozenset[object]] = contextvars.ContextVar("specprefill_hooks", default=frozenset())


@contextmanager
def hooked(module: Any, hook: Any, *, pre: bool = False) -> Iterator[None]:
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
def leaving(layer: Any) -> Iterator[list[torch.Tensor]]:
    """While open, a forward of this context through ``layer`` (a decoder layer; None: none)
    appends the hidden states leaving it to the list yielded and stops there (``EarlyExit``)."""
    left: list[torch.Tensor] = []

    def stop(module: Any, args: Any, output: Any) -> None:
        left.append(output[0] if isinstance(output, tuple) else output)
        raise EarlyExit

    with hooked(layer, stop) if layer is not None else contextlib.nullcontext():
        yield left


def current_recorder() -> Recorder | None:
    """The recorder of the calling context (``recording``), or None."""
    return _RECORDER.get()
