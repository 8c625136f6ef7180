"""Concurrent requests share the draft: score requests that arrive together run as one batch.

The first request to arrive leads: it waits up to ``window_s`` for others (or until
``max_batch`` are waiting), runs one batched draft pass for the group, and hands each request
its own scores. No background thread: the callers' own threads do the work, so an idle engine
costs nothing. Requests with different draft settings never share a batch.

A batch of prompts of different lengths runs as right-padded passes, and padding is compute
thrown away: ``length_buckets`` splits a batch into groups of near-equal lengths
(``DraftConfig.batch_pad_limit``), one padded pass each.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Generic, TypeVar

__all__ = ["MicroBatcher", "TurnLock", "in_buckets", "length_buckets", "padding_share"]

In = TypeVar("In")
Out = TypeVar("Out")
R = TypeVar("R")


def padding_share(lengths: Sequence[int]) -> float:
    """The share of a right-padded pass over ``lengths`` that is padding (0: equal lengths)."""
    if not lengths:
        return 0.0
    longest = max(lengths)
    return 1.0 - sum(lengths) / (longest * len(lengths)) if longest else 0.0


def length_buckets(lengths: Sequence[int], pad_limit: float) -> list[list[int]]:
    """The indices of ``lengths`` grouped into padded passes: sorted longest first, a prompt joins
    the current group while padding the group to its longest prompt leaves at most ``pad_limit``
    of the pass as padding, else it opens the next group. Groups are longest first; indices in a
    group ascend. ``pad_limit`` 1: one pass for all; 0: only equal lengths share a pass."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        if groups and padding_share([lengths[j] for j in groups[-1]] + [lengths[i]]) <= pad_limit:
            groups[-1].append(i)
        else:
            groups.append([i])
    return [sorted(group) for group in groups]


def in_buckets(lengths: Sequence[int], pad_limit: float, run: Callable[[list[int]], Sequence[R]]) -> list[R]:
    """``run`` once per group of ``length_buckets(lengths, pad_limit)`` (it gets the group's
    indices, returns one result per index, in that order), the results back in input order."""
    out: list[R | None] = [None] * len(lengths)
    for group in length_buckets(lengths, pad_limit):
        for i, result in zip(group, run(group), strict=True):
            out[i] = result
    return out  # type: ignore[return-value]  # every index is in exactly one group


class TurnLock:
    """A lock granted in arrival order (a ticket lock): concurrent requests' draft passes run one
    at a time, first come first served, instead of sharing the cores or the GPU all at once.

    Shared at once, N passes that start together all end together, after N passes' time, and
    reach the main model together; one at a time, the k-th ends after k passes' time and its main
    prefill overlaps the next pass: half the median wait, and the two models work side by side."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._issued = 0  # tickets handed out
        self._serving = 0  # the ticket whose turn it is

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Wait for this caller's turn, hold it inside the block."""
        with self._changed:
            ticket = self._issued
            self._issued += 1
            while ticket != self._serving:
                self._changed.wait()
        try:
            yield
        finally:
            with self._changed:
                self._serving += 1
                self._changed.notify_all()

    @property
    def waiting(self) -> int:
        """Callers holding or waiting for a turn."""
        with self._changed:
            return self._issued - self._serving


class MicroBatcher(Generic[In, Out]):
    """Runs ``run(key, items)`` on groups of concurrent ``submit(key, item)`` calls.

    ``run`` returns one output per item, in order; an exception fails every call of the group.
    """

    def __init__(
        self, run: Callable[[Hashable, Sequence[In]], Sequence[Out]], *, max_batch: int, window_s: float
    ) -> None:
        self._run = run
        self.max_batch = max_batch
        self.window_s = window_s
        self._lock = threading.Lock()
        self._full = threading.Condition(self._lock)
        self._pending: dict[Hashable, list[tuple[In, Future[Out]]]] = {}

    def submit(self, key: Hashable, item: In) -> Out:
        """``item``'s output, computed in a batch with the calls that arrive with it."""
        future: Future[Out] = Future()
        with self._lock:
            group = self._pending.setdefault(key, [])
            group.append((item, future))
            leader = len(group) == 1
            if len(group) >= self.max_batch:
                self._full.notify_all()
        if leader:
            self._lead(key)
        return future.result()

    def _lead(self, key: Hashable) -> None:
        deadline = time.monotonic() + self.window_s
        with self._lock:
            while len(self._pending[key]) < self.max_batch:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._full.wait(left)
            group = self._pending[key][: self.max_batch]
            rest = self._pending[key][self.max_batch :]
            if rest:
                self._pending[key] = rest
            else:
                del self._pending[key]
        try:
            outputs = self._run(key, [item for item, _ in group])
            if len(outputs) != len(group):
                raise RuntimeError(f"a batch of {len(group)} gave {len(outputs)} results")
        except BaseException as error:  # every caller of the batch sees the failure
            for _, future in group:
                future.set_exception(error)
        else:
            for (_, future), output in zip(group, outputs, strict=True):
                future.set_result(output)
        finally:
            if rest:
                # Callers beyond max_batch arrived while this batch formed: the first leads the next.
                threading.Thread(target=self._lead, args=(key,), daemon=True).start()
