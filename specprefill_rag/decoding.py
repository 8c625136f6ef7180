"""Prefill a planned prompt on a backend and decode the answer: the engine's last stage.

``prefill_and_decode`` streams text deltas (stop strings and incremental detokenizing by
``detokenize``), keeps the request's deadline between tokens, stops when asked from another
thread, and returns a ``GenerationResult`` with the timings of every stage (assembly, draft,
selection, main prefill, first token, decode).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Generator

from .backends import Backend
from .backends.base import max_new_tokens
from .config import GenerationConfig
from .detokenize import IncrementalDecoder
from .errors import BackendTimeoutError, ConfigError
from .grammar import check_support
from .types import GenerationResult, PlannedPrompt, PrefillPlan, Timings
from .wire import is_contiguous

__all__ = ["check_positions", "prefill_and_decode"]


def check_positions(backend: Backend, plan: PrefillPlan) -> None:
    """Refuse a plan with original (non-contiguous) positions on a backend whose
    ``capabilities.exact_positions`` is False: it would run them at 0..k-1, silently."""
    capabilities = getattr(backend, "capabilities", None)
    if capabilities is None or capabilities.exact_positions or not plan.speculated:
        return
    if not is_contiguous(plan.position_ids.tolist(), plan.next_position):
        raise ConfigError(
            f"the {backend.name} backend cannot prefill tokens at their original positions "
            "(capabilities.exact_positions is False): use SelectionConfig(positions='contiguous') or "
            "another backend"
        )


def prefill_and_decode(
    backend: Backend,
    planned: PlannedPrompt,
    generation: GenerationConfig,
    *,
    started: float | None = None,
    stop: threading.Event | None = None,
) -> Generator[str, None, GenerationResult]:
    """Prefill and decode a planned prompt; yields text deltas, returns the result.

    ``started``: the request's start (perf_counter; default now), from which TTFT and the
    ``generation.timeout`` deadline count. ``stop``: set from another thread, decoding ends after
    the current token (finish reason "cancelled").
    """
    gen = generation
    started = time.perf_counter() if started is None else started
    plan = planned.plan
    check_positions(backend, plan)
    check_support(backend, gen.grammar)
    decoder = IncrementalDecoder(backend.tokenizer, gen.stop)
    limit = max_new_tokens(plan, gen, backend.max_context)
    prefill_start = time.perf_counter()
    first: float | None = None
    timeout = gen.timeout
    deadline = None if timeout is None else started + timeout
    if deadline is not None:
        # The backend gets the time left; the engine checks it between tokens too (a local
        # backend cannot be interrupted inside one forward pass).
        gen = dataclasses.replace(gen, timeout=max(deadline - prefill_start, 1e-3))
    tokens = backend.stream_tokens(plan, gen)
    try:
        _check_deadline(deadline, timeout)  # the draft may have used it up
        for token in tokens:
            _check_deadline(deadline, timeout)
            if stop is not None and stop.is_set():
                break
            if first is None:
                first = time.perf_counter()
            delta = decoder.push(token)
            if delta:
                yield delta
            if decoder.stopped:
                break
    finally:
        tokens.close()
    rest = decoder.finish()
    if rest:
        yield rest
    if stop is not None and stop.is_set():
        finish = "cancelled"
    else:
        finish = "stop" if decoder.stopped or len(decoder.token_ids) < limit else "length"
    return _result(planned, decoder, finish, started=started, prefill_start=prefill_start, first=first)


def _check_deadline(deadline: float | None, timeout: float | None) -> None:
    if deadline is not None and timeout is not None and time.perf_counter() > deadline:
        raise BackendTimeoutError(f"no complete answer within timeout={timeout:g} s")


def _result(planned: PlannedPrompt, decoder: IncrementalDecoder, finish: str, *, started: float,
            prefill_start: float, first: float | None) -> GenerationResult:
    """The answer of one ``prefill_and_decode``: text, tokens and the timings of each stage (perf_counter
    values: the request's start, the prefill's start, the first token; now is the end)."""
    end = time.perf_counter()
    first = end if first is None else first
    n_generated = len(decoder.token_ids)
    timings = Timings(
        assemble_s=planned.assemble_s,
        draft_s=planned.scores.seconds if planned.scores is not None else None,
        selection_s=planned.selection_s,
        prefill_s=first - prefill_start,
        ttft_s=first - started,
        decode_s=end - first,
        total_s=end - started,
        decode_tokens_per_s=(n_generated - 1) / (end - first) if n_generated > 1 and end > first else None,
    )
    plan, scores = planned.plan, planned.scores
    return GenerationResult(text=decoder.text, token_ids=decoder.token_ids, finish_reason=finish,
                            prompt_tokens=plan.n_prompt, prefilled_tokens=plan.n_kept, plan=plan, timings=timings,
                            prompt=planned.prompt, draft_memo_hit=scores is not None and scores.from_memo,
                            draft_cached_tokens=0 if scores is None else scores.cached_tokens,
                            passages_cached=0 if scores is None else scores.passages_cached,
                            passages_read=0 if scores is None else scores.passages_read,
                            draft_windows=0 if scores is None else scores.windows, path=planned.path)
