"""The draft model: one prefill plus a short greedy look-ahead, with query/key capture.

The draft runs its normal SDPA attention. A function registered in transformers' attention
registry wraps SDPA and, while a capture is active, records each layer's post-RoPE prompt
keys (at prefill), the post-RoPE queries of the question's tokens and of the last prompt
token (at prefill) and the query of each look-ahead token. No N×N matrix is ever built:
scoring needs only those query rows per layer and head.
"""

from __future__ import annotations

import contextvars
import dataclasses
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from . import scoring
from .config import DraftConfig
from .errors import InputError
from .types import TokenScores

__all__ = ["CAPTURE_ATTENTION", "DraftCapture", "DraftModel"]

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


class _EarlyExit(Exception):
    """Raised inside the prefill once the highest recorded layer is captured (look-ahead 1)."""


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
        self.stop_after = stop_after  # layer after whose capture the forward stops
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
                [query[b].index_select(1, rows.to(query.device))] for b, rows in enumerate(self.rows)
            ]
            if layer == self.stop_after:
                raise _EarlyExit
        else:
            for b, pieces in enumerate(self.queries[layer]):
                pieces.append(query[b, :, -1:].clone())

    def captures(self, lookahead_ids: Sequence[list[int]]) -> list[DraftCapture]:
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
                positions=torch.cat([question, torch.full((len(lookahead_ids[b]) + 1,), n - 1)]),
                n_question=int(question.numel()),
                layer_ids=tuple(layers),
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
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(CAPTURE_ATTENTION, _capture_attention)
    AttentionMaskInterface.register(CAPTURE_ATTENTION, sdpa_mask)


@contextmanager
def _recording(recorder: _Recorder) -> Iterator[None]:
    token = _RECORDER.set(recorder)
    try:
        yield
    finally:
        _RECORDER.reset(token)


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

    @classmethod
    def from_pretrained(
        cls, name_or_path: str, config: DraftConfig | None = None, *,
        dtype: torch.dtype = torch.float32, device: str = "cpu",
    ) -> DraftModel:
        """Load a draft by packaged short name, HF directory or GGUF path (see ``loading``)."""
        from .loading import load_model

        model, tokenizer = load_model(name_or_path, dtype=dtype, device=device)
        return cls(model, tokenizer, config)

    @property
    def n_layers(self) -> int:
        config = self.model.config
        return int((getattr(config, "text_config", None) or config).num_hidden_layers)

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 1 << 30))

    def fits(self, n_tokens: int, lookahead: int) -> bool:
        """Whether a prompt of ``n_tokens`` plus ``lookahead - 1`` decoded tokens fits the window."""
        return n_tokens + lookahead - 1 <= self.max_context

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
    ) -> DraftCapture:
        """Prefill ``token_ids`` (n_prompt,) and greedily decode ``lookahead - 1`` tokens,
        recording post-RoPE queries of the ``question`` token indices (m,), of the last prompt
        token and of each look-ahead token.

        ``layers``: record only these layers (default: all). ``early_exit`` with a look-ahead
        of 1: stop the prefill right after the highest recorded layer's attention inputs are
        captured (no upper layers, no LM head); the recorded tensors are exactly those of the
        full forward.
        """
        return self.capture_batch([token_ids], lookahead, [question], layers=layers, early_exit=early_exit)[0]

    @torch.inference_mode()
    def capture_batch(
        self,
        token_ids: Sequence[torch.Tensor],
        lookahead: int | None = None,
        questions: Sequence[torch.Tensor | None] | None = None,
        *,
        layers: Sequence[int] | None = None,
        early_exit: bool = False,
    ) -> list[DraftCapture]:
        """``capture`` for several prompts in one right-padded forward per step.

        Padding sits after each prompt and is masked out of every attention; look-ahead tokens
        of prompt b sit at positions n_b, n_b + 1, ... So each capture equals the prompt's own
        (within floating-point tolerance).
        """
        lookahead = self.config.lookahead if lookahead is None else lookahead
        questions = list(questions) if questions is not None else [None] * len(token_ids)
        if not token_ids or len(questions) != len(token_ids):
            raise InputError("pass one question (or None) per prompt, and at least one prompt")
        lengths = [int(ids.numel()) for ids in token_ids]
        self._check_batch(lengths, questions, lookahead)
        wanted = None if layers is None else frozenset(int(i) for i in layers)
        stop_after = max(wanted) if wanted and early_exit and lookahead == 1 else None
        recorder = _Recorder(
            lengths, [None if q is None else q.to(torch.int64).cpu() for q in questions], wanted, stop_after
        )
        batch = len(lengths)
        ids, mask = self._right_padded(token_ids, lengths)
        last = torch.tensor(lengths, device=self.device) - 1  # (batch,) each prompt's last token
        lookahead_ids: list[list[int]] = [[] for _ in lengths]
        with _recording(recorder):
            try:
                keep = torch.unique(last)  # logits only where some prompt ends
                out = self.model(input_ids=ids, attention_mask=mask, use_cache=lookahead > 1, logits_to_keep=keep)
            except _EarlyExit:
                return recorder.captures(lookahead_ids)
            # (batch, vocab): each prompt's logits at its own last token
            logits = out.logits[torch.arange(batch, device=self.device), torch.searchsorted(keep, last)]
            cache = out.past_key_values
            for step in range(lookahead - 1):
                tokens = logits.argmax(-1)  # (batch,)
                for b, token in enumerate(tokens.tolist()):
                    lookahead_ids[b].append(int(token))
                mask = torch.cat([mask, torch.ones(batch, 1, dtype=mask.dtype, device=self.device)], dim=1)
                out = self.model(
                    input_ids=tokens.reshape(batch, 1),
                    position_ids=(last + 1 + step).reshape(batch, 1),
                    attention_mask=mask,
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
                logits = out.logits[:, -1]
        return recorder.captures(lookahead_ids)

    def _check_batch(self, lengths: list[int], questions: list[torch.Tensor | None], lookahead: int) -> None:
        """``InputError`` for an empty prompt, one over the window, or question indices outside it."""
        for n, question in zip(lengths, questions, strict=True):
            if n == 0:
                raise InputError("cannot score an empty prompt")
            if not self.fits(n, lookahead):
                raise InputError(
                    f"prompt of {n} tokens plus {lookahead - 1} look-ahead tokens exceeds the draft "
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
    ) -> list[TokenScores]:
        """``score`` for several prompts of any lengths in one batched draft run (one padded
        prefill, one batched step per look-ahead token); each result equals the prompt's own
        ``score`` within floating-point tolerance. ``seconds`` is the whole batch's time."""
        cfg = config or self.config
        start = time.perf_counter()
        batch = len(token_ids)
        questions = list(questions) if questions is not None else [None] * batch
        contexts = list(contexts) if contexts is not None else [None] * batch
        if len(questions) != batch or len(contexts) != batch:
            raise InputError("pass one question and one context mask (or None) per prompt")
        lookaheads = [cfg.lookahead_for(0 if q is None else int(q.numel())) for q in questions]
        layers = cfg.layer_indices(self.n_layers)
        caps = self.capture_batch(
            token_ids, max(lookaheads), questions, layers=layers, early_exit=cfg.early_exit
        )
        results = []
        for cap, lookahead, context in zip(caps, lookaheads, contexts, strict=True):
            rows = cap.n_question + lookahead  # a prompt that needs fewer look-ahead rows than the batch
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
            results.append(
                TokenScores(
                    scores=scoring.importance(per_layer, weights).cpu(),
                    lookahead_token_ids=cap.lookahead_token_ids[: lookahead - 1],
                    seconds=0.0,
                )
            )
        seconds = time.perf_counter() - start
        return [dataclasses.replace(r, seconds=seconds) for r in results]
