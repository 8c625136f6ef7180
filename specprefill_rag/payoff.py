"""Which path one request takes, and why: pruned by the draft, or prefilled whole.

SpecPrefill trades a draft pass for a shorter main-model prefill. A prompt is prefilled whole
when pruning cannot help it (``mode="full"``, a prompt under ``min_prompt_tokens``, a budget that
keeps all its context, a draft that cannot read it) and, with ``DraftRuntime.skip_when_slower``,
when pruning would not pay right now: the draft tokens queued ahead of it plus its own, at the
draft's measured seconds per token, would take longer than the main-model prefill the pruning
saves, at the main model's measured seconds per token (``PrefillCosts``: running measurements of
this engine's own requests). Every answer says which path it took (``PathChoice``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from .config import SelectionConfig
from .types import AssembledPrompt, PathChoice

__all__ = ["PrefillCosts", "unpruned"]

# Weight of the newest measurement in the running per-token costs (an exponential average):
# a few requests move it, one outlier does not.
NEWEST_WEIGHT = 0.2


def unpruned(prompt: AssembledPrompt, mode: str, sel: SelectionConfig) -> PathChoice | None:
    """Why ``prompt`` is prefilled whole whatever the draft would say (None: it may be pruned)."""
    if mode == "full":
        return PathChoice("full_mode", "mode='full': the baseline prefills every token")
    if prompt.n_tokens < sel.min_prompt_tokens:
        return PathChoice("short_prompt", f"the prompt's {prompt.n_tokens} tokens are fewer than "
                                          f"min_prompt_tokens={sel.min_prompt_tokens}")
    n_context = prompt.n_context
    if sel.budget(n_context) >= n_context:
        return PathChoice("keeps_everything", f"the budget keeps all {n_context} context tokens")
    return None


class PrefillCosts:
    """This engine's running costs, shared by its requests (thread-safe): the draft's seconds per
    token it reads, the main model's seconds per token it prefills (each an exponential average
    of the requests measured so far), and the draft tokens queued or being scored now."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.draft_per_token: float | None = None
        self.main_per_token: float | None = None
        self.queued_tokens = 0

    @staticmethod
    def _blend(average: float | None, value: float) -> float:
        return value if average is None else average + NEWEST_WEIGHT * (value - average)

    def observe_draft(self, tokens: int, seconds: float) -> None:
        """One draft run: ``tokens`` read (a batch's together) in ``seconds``."""
        if tokens > 0 and seconds > 0:
            with self._lock:
                self.draft_per_token = self._blend(self.draft_per_token, seconds / tokens)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """One main-model prefill: ``tokens`` prefilled, the first token after ``seconds``."""
        if tokens > 0 and seconds > 0:
            with self._lock:
                self.main_per_token = self._blend(self.main_per_token, seconds / tokens)

    @contextmanager
    def queued(self, tokens: int) -> Iterator[None]:
        """Count ``tokens`` as waiting for, or being read by, the draft inside the block."""
        with self._lock:
            self.queued_tokens += tokens
        try:
            yield
        finally:
            with self._lock:
                self.queued_tokens -= tokens

    def slower(self, read_tokens: int, saved_tokens: int) -> PathChoice | None:
        """The ``draft_slower`` choice when the draft's queue and its reading of ``read_tokens``
        are predicted to take at least the prefill of the ``saved_tokens`` pruning saves; None
        when pruning pays, or before both costs have been measured (the first requests prune)."""
        with self._lock:
            draft, main, queued = self.draft_per_token, self.main_per_token, self.queued_tokens
        if draft is None or main is None:
            return None
        draft_s, saved_s = draft * (queued + read_tokens), main * saved_tokens
        if draft_s < saved_s:
            return None
        return PathChoice("draft_slower", f"the draft's queue ({queued} tokens) and this prompt ({read_tokens} "
                                          f"tokens) would take ~{draft_s:.2f} s, more than the ~{saved_s:.2f} s "
                                          f"of main-model prefill pruning saves")
