"""What the GPU suites time a SpecPrefill request with: the main model's prefill up to its first
token, the draft's phases marked on the device's timeline, and one pruned request phase by phase
(``pruned_ttft``: the draft's scores, the selection, the pruned prefill). ``gpu_ttft`` times
its cold cells with it and ``warm_ttft`` the cells whose passages the draft read before."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Clock", "TimedPrompt", "draft_phases", "first_token", "full_prefill_s", "plan_of", "pruned_ttft", "sync",
           "timed"]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plan_of(ids: torch.Tensor, kept: torch.Tensor, n_prompt: int) -> Any:
    """The ``PrefillPlan`` of ``ids[kept]`` at positions ``kept`` (all of them: a full prefill)."""
    from specprefill_rag.types import PrefillPlan

    return PrefillPlan(token_ids=ids[kept], position_ids=kept, next_position=n_prompt, n_prompt=n_prompt,
                       kept_spans=(), speculated=kept.numel() < n_prompt)


def first_token(backend: Any, plan: Any) -> int:
    """The backend's prefill of ``plan`` and its first (greedy) token: what a TTFT waits for."""
    from specprefill_rag.backends.transformers import sample_token
    from specprefill_rag.config import GenerationConfig

    state = backend.prefill(plan)
    return sample_token(state.logits, GenerationConfig(), None)  # int(): the host waits for the device


def timed(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


class Clock:
    """Named marks on the device's timeline: CUDA events (read after a synchronisation, none
    added) on a GPU, ``perf_counter`` on a CPU. A name is marked once (its first time)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: dict[str, Any] = {}

    def mark(self, name: str) -> None:
        if name in self.marks:
            return
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks[name] = event
        else:
            self.marks[name] = time.perf_counter()

    def seconds(self, start: str, end: str) -> float | None:
        if start not in self.marks or end not in self.marks:
            return None
        if self.cuda:
            return float(self.marks[start].elapsed_time(self.marks[end])) / 1e3
        return float(self.marks[end] - self.marks[start])


@contextlib.contextmanager
def draft_phases(draft: Any, clock: Clock) -> Iterator[None]:
    """While open, the draft's prompt forward (``_prompt_forward``) and its scoring (``_scores``)
    mark their start and end on ``clock``: instance attributes that call the draft's own methods,
    removed afterwards (the library's code runs unchanged). A draft without them: no marks."""
    steps = {"_prompt_forward": ("prompt_start", "prompt_end"), "_scores": ("scoring_start", "scoring_end")}
    wrapped = []
    for name, (before, after) in steps.items():
        original = getattr(draft, name, None)
        if original is None:
            continue

        def step(*args: Any, _original: Any = original, _marks: tuple[str, str] = (before, after),
                 **kwargs: Any) -> Any:
            clock.mark(_marks[0])
            out = _original(*args, **kwargs)
            clock.mark(_marks[1])
            return out

        setattr(draft, name, step)
        wrapped.append(name)
    try:
        yield
    finally:
        for name in wrapped:
            delattr(draft, name)


def full_prefill_s(backend: Any, ids: torch.Tensor) -> float:
    """Seconds of ``backend``'s prefill of the whole prompt, first token included."""
    sync(backend.device)
    return timed(first_token, backend, plan_of(ids, torch.arange(ids.numel()), ids.numel()))[0]


@dataclass(frozen=True)
class TimedPrompt:
    """A prompt as a timed request sends it: token ids (n,), the protected mask (n,) bool, each
    token's segment (n,), and the question's token indices (m,), whose queries score."""

    ids: torch.Tensor
    protected: torch.Tensor
    segment: torch.Tensor
    question: torch.Tensor


def pruned_ttft(draft: Any, main: Any, prompt: TimedPrompt, keep: float, config: Any, layout: Any = None
                ) -> dict[str, Any]:
    """One SpecPrefill request's TTFT at ``keep``, phase by phase: ``draft.score`` with ``config``
    (and ``layout``: where the prompt's passages sit, for a config that reads them apart), the
    selection (chunks: synthetic prompts have no sentences), ``main``'s pruned prefill and its
    first token; with what the draft's stores served."""
    from specprefill_rag import SelectionConfig
    from specprefill_rag import selection as selection_lib

    ids, n = prompt.ids, prompt.ids.numel()
    clock = Clock(draft.device)
    sync(draft.device)
    start = time.perf_counter()
    clock.mark("start")
    with draft_phases(draft, clock):  # the engine's path: the question's tokens query the context
        scores = draft.score(ids, question=prompt.question, context=~prompt.protected, config=config, layout=layout)
    clock.mark("draft_end")  # scores end on .cpu(): synchronised
    scored = time.perf_counter()
    sel = SelectionConfig(keep_rate=keep, unit="chunk", min_prompt_tokens=0)
    kept = selection_lib.select(scores.scores, prompt.protected, prompt.segment, sel)
    plan = plan_of(ids, kept, n)
    selected = time.perf_counter()
    first_token(main, plan)
    end = time.perf_counter()
    phases = {
        "draft_prefill_s": clock.seconds("prompt_start", "prompt_end"),
        "lookahead_s": clock.seconds("prompt_end", "scoring_start"),
        "scoring_s": clock.seconds("scoring_start", "scoring_end"),
    }
    known = [v for v in phases.values() if v is not None]
    phases["draft_other_s"] = (clock.seconds("start", "draft_end") or 0.0) - sum(known) if known else None
    return {
        "ttft_s": end - start, "draft_s": scored - start, "selection_s": selected - scored, "prefill_s": end - selected,
        "keep_ratio": kept.numel() / n, "n_kept": int(kept.numel()), "phases": phases,
        "cached_tokens": scores.cached_tokens, "passages_cached": scores.passages_cached,
        "passages_read": scores.passages_read,
    }
