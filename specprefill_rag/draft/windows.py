"""A prompt longer than the draft's window, read in windows (``DraftConfig.on_overflow="windows"``).

Each window holds every protected token (template, instructions, question) and one run of
consecutive prunable tokens; the runs are of equal size and together cover the context. Each
window is scored on its own; a prunable token gets its window's score, a protected one (in
every window) its highest.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import torch

from ..config import DraftConfig
from ..errors import InputError
from ..types import TokenScores

__all__ = ["MIN_WINDOW_CONTEXT", "read_windows", "score_windowed"]

MIN_WINDOW_CONTEXT = 64  # context tokens a window must hold beside the protected ones (``DraftModel.windows``)

BatchScorer = Callable[..., list[TokenScores]]  # ``DraftModel.score_batch``


def read_windows(n_tokens: int, context: torch.Tensor | None, max_context: int, extra_positions: int = 0
                 ) -> list[torch.Tensor]:
    """The windows of a prompt of ``n_tokens`` that does not fit a window of ``max_context``
    positions with ``extra_positions`` look-ahead positions (``DraftModel.windows``, which
    documents them): (m,) sorted prompt indices each. ``InputError`` when ``context`` marks no
    prunable token, or the protected tokens leave fewer than ``MIN_WINDOW_CONTEXT`` positions."""
    if context is None or not bool(context.any()):
        raise InputError(f"the prompt of {n_tokens} draft tokens exceeds the draft model's window of "
                         f"{max_context} and has no prunable context to read in windows")
    context = context.bool().cpu()
    protected, prunable = (~context).nonzero().flatten(), context.nonzero().flatten()
    room = max_context - extra_positions - int(protected.numel())
    if room < MIN_WINDOW_CONTEXT:
        raise InputError(f"the prompt's {protected.numel()} protected tokens and {extra_positions} look-ahead "
                         f"positions leave {max(room, 0)} of the draft model's window of {max_context} "
                         f"for the context (at least {MIN_WINDOW_CONTEXT} needed to read it in windows)")
    count = -(-int(prunable.numel()) // room)
    return [torch.cat([protected, run]).sort().values for run in prunable.tensor_split(count)]


def score_windowed(score_batch: BatchScorer, token_ids: Sequence[torch.Tensor], questions: list[torch.Tensor | None],
                   contexts: list[torch.Tensor | None], windows: Sequence[Sequence[torch.Tensor] | None],
                   cfg: DraftConfig, namespace: str = "") -> list[TokenScores]:
    """``score_batch`` (a ``DraftModel``'s) when some prompts exceed the window: those that fit are
    scored together, each other one window at a time (``windows``: each prompt's, or None when it
    fits); a prunable token gets its window's score, a protected one (in every window) its highest."""
    start = time.perf_counter()
    fit = [b for b, w in enumerate(windows) if w is None]
    results: dict[int, TokenScores] = {}
    if fit:
        scored = score_batch([token_ids[b] for b in fit], questions=[questions[b] for b in fit],
                             contexts=[contexts[b] for b in fit], config=cfg, namespace=namespace,
                             windows=[None] * len(fit))
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
            (part,) = score_batch([token_ids[b][index]], questions=[local], contexts=[context.cpu()[index]],
                                  config=cfg, namespace=namespace, windows=[None])  # a window fits by construction
            scores[index] = torch.maximum(scores[index], part.scores)
            read.append(part)
        results[b] = TokenScores(scores=scores, lookahead_token_ids=read[0].lookahead_token_ids, seconds=0.0,
                                 cached_tokens=sum(part.cached_tokens for part in read), windows=len(parts))
    seconds = time.perf_counter() - start
    return [dataclasses.replace(results[b], seconds=seconds) for b in range(len(token_ids))]
