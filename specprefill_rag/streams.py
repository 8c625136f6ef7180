"""Streams of one answer: text deltas as they are decoded, the typed result at the end.

``TextStream`` wraps the engine's generator (sync); ``AsyncTextStream`` runs each step in a
worker thread. Both are context managers that close the backend's stream when left, and both
can be cancelled from another thread (generation stops after the current token).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Generator, Iterator

from .types import GenerationResult

__all__ = ["AsyncTextStream", "TextStream"]


class TextStream(Iterator[str]):
    """Text deltas of one answer; ``text`` is what has been streamed so far, ``result`` holds
    the ``GenerationResult`` once exhausted.

    A context manager: leaving the ``with`` block (a ``break``, an exception) stops the
    generation and closes the backend's stream (the HTTP response, for a server) at once,
    instead of whenever the stream is garbage-collected.
    """

    def __init__(
        self, run: Generator[str, None, GenerationResult], stop: threading.Event | None = None
    ) -> None:
        self._run = run
        self._stop = stop or threading.Event()
        self.result: GenerationResult | None = None
        self.text = ""  # the deltas so far, joined

    def wait(self) -> GenerationResult:
        """Run to the end (discarding the deltas) and return the result."""
        for _ in self:
            pass
        assert self.result is not None
        return self.result

    def cancel(self) -> None:
        """Ask a step running in another thread to stop after its current token (thread-safe)."""
        self._stop.set()

    def __enter__(self) -> TextStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __next__(self) -> str:
        try:
            delta = next(self._run)
        except StopIteration as stop:
            self.result = stop.value
            raise StopIteration from None
        self.text += delta
        return delta

    def close(self) -> None:
        """Stop generating (the backend stops decoding and closes its stream)."""
        self._stop.set()
        self._run.close()


class AsyncTextStream(AsyncIterator[str]):
    """Async view of a ``TextStream``: each step runs in a worker thread, never on the loop.

    Cancelling a task that awaits the next delta stops the generation: the worker thread
    finishes the token it is computing (a thread cannot be interrupted), then ``aclose`` (or
    leaving ``async with``) closes the stream and the backend's. ``agenerate`` does this itself.
    """

    _DONE = object()

    def __init__(self, stream: TextStream) -> None:
        self._stream = stream
        self._step: asyncio.Future[object] | None = None  # the step running in a worker thread

    @property
    def result(self) -> GenerationResult | None:
        return self._stream.result

    @property
    def text(self) -> str:
        """The deltas streamed so far, joined."""
        return self._stream.text

    async def __anext__(self) -> str:
        if self._step is None:
            self._step = asyncio.ensure_future(asyncio.to_thread(next, self._stream, self._DONE))
        # Shielded: a cancelled caller leaves the step running to its end, so that aclose()
        # can wait for it before closing the generator (never "generator already executing").
        item = await asyncio.shield(self._step)
        self._step = None
        if item is self._DONE:
            raise StopAsyncIteration
        return item  # type: ignore[return-value]

    async def aclose(self) -> None:
        """Stop generating: the running step ends after its current token, then the stream closes."""
        self._stream.cancel()
        if self._step is not None:
            with contextlib.suppress(BaseException):
                await self._step
            self._step = None
        await asyncio.to_thread(self._stream.close)

    async def __aenter__(self) -> AsyncTextStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
