"""The life of one admitted request: its slots, its engine stream, its server-sent events, and
noticing a client that went away.

A ``Run`` holds a queue slot from admission (before its body is read), its share of the bodies in
flight until parsed, then a generation slot while the engine streams; ``close`` frees them all,
whatever ended the request, and counts it. A text-mode request streams from ``text_mode`` instead
of the engine; a planned one whose upstream turns out to have no plugin (``PluginMissingError``,
before its first token) starts again in text mode when the gateway allows the fallback.
``EventStream`` makes sure a streamed answer closes its run even when Starlette cancels the response.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, Awaitable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ..engine import Mode
from ..errors import GrammarError, PluginMissingError
from ..streams import AsyncTextStream
from ..toolcalls import CallText
from ..types import GenerationResult
from .protocol import GatewayRequest
from .responses import APIError, StreamChunks, new_id, now, to_api_error
from .text_mode import text_stream

if TYPE_CHECKING:
    from ..engine import SpecPrefillEngine
    from .metrics import GatewayMetrics
    from .text_mode import TextMode


class RunHost(Protocol):
    """What a run takes from the gateway that admitted it (``app.Gateway``): the engine, text
    mode, and the load it shares with the other runs: requests admitted (reading a body, waiting for
    a slot or running), bytes of bodies not parsed yet, generations running and their slots."""

    engine: SpecPrefillEngine
    text: TextMode
    fallback_text_mode: bool
    metrics: GatewayMetrics
    slots: asyncio.Semaphore
    admitted: int
    body_bytes: int
    running: int

__all__ = [
    "ClientGone", "EventStream", "Run", "RunHost", "sse", "sse_error", "stream_completion", "unless_disconnected",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ClientGone(Exception):
    """The client closed the connection before the answer was complete."""


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed the connection (the body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result, or ``ClientGone`` (``work`` cancelled) when the client leaves first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise ClientGone


class Run:
    """One admitted request: its queue slot (taken before its body is read), its share of the
    bodies in flight (until parsed), its generation slot and its engine stream."""

    def __init__(self, gateway: RunHost, endpoint: str, body_bytes: int) -> None:
        self.gateway, self.endpoint = gateway, endpoint
        self.request: GatewayRequest | None = None  # once the body is parsed
        self.body_bytes = body_bytes  # of ``max_body_bytes_in_flight``, held until parsed
        self.stream: AsyncTextStream | None = None
        self.calls: CallText | None = None  # what of the answer is shown, when the request offers tools
        self.running = False
        self.closed = False
        gateway.admitted += 1
        gateway.body_bytes += body_bytes
        gateway.metrics.in_flight.inc()

    def parsed(self, request: GatewayRequest) -> None:
        """The body became ``request``: its bytes no longer count as in flight."""
        self.request = request
        self.release_body()

    def release_body(self) -> None:
        self.gateway.body_bytes -= self.body_bytes
        self.body_bytes = 0

    @property
    def result(self) -> GenerationResult | None:
        return self.stream.result if self.stream is not None else None

    async def take_slot(self) -> None:
        """Wait for a generation slot (``close`` frees it): the engine's model work is bounded by them."""
        await self.gateway.slots.acquire()
        self.running = True
        self.gateway.running += 1
        self.gateway.metrics.running.inc()

    async def start(self) -> str | None:
        """Wait for a generation slot, start the engine stream; the first text delta (None: no text)."""
        await self.take_slot()
        req = self.request
        assert req is not None
        gateway = self.gateway
        self.calls = None if req.call_opener is None else CallText(req.call_opener)
        if req.mode == "text":
            self.stream = await self._text()
            return await self.next()
        mode: Mode = "full" if req.mode == "full" else "specprefill"
        try:
            self.stream = await gateway.engine.astream(
                list(req.segments), mode=mode, keep_rate=req.keep_rate, generation=req.generation
            )
        except GrammarError as error:  # refused before any model ran; a grammar of the request's own is its schema's
            raise GrammarError(str(error), error.param or "response_format") from None
        try:
            return await self.next()
        except PluginMissingError as error:  # before the first token: nothing was sent yet
            if not gateway.fallback_text_mode:
                raise
            logger.warning("answering in text mode: %s", error)
            await self.stream.aclose()
            gateway.metrics.fallbacks.inc()
            self.stream = await self._text(fallback=(mode, str(error)))
            return await self.next()

    async def _text(self, fallback: tuple[str, str] | None = None) -> AsyncTextStream:
        """The request answered in text mode (``text_mode``); ``fallback``: from what and why."""
        req, gateway = self.request, self.gateway
        assert req is not None
        stream = await asyncio.to_thread(text_stream, gateway.engine, req, gateway.text, fallback)
        return AsyncTextStream(stream)

    async def next(self) -> str | None:
        """The next text to send (None: the answer is complete, its calls checked). With tools, only
        content is sent (``CallText``): a delta inside a call is not, so this may read several."""
        assert self.stream is not None and self.request is not None
        while True:
            try:
                delta = await self.stream.__anext__()
            except StopAsyncIteration:
                return None
            if self.calls is None:
                return delta
            if shown := self.calls.feed(delta):
                return shown

    async def collect(self) -> str:
        parts = []
        delta = await self.start()
        while delta is not None:
            parts.append(delta)
            delta = await self.next()
        return "".join(parts)

    async def close(self, status: int) -> None:
        """Stop generating (if still running), free both slots, count the request. Idempotent."""
        if self.closed:
            return
        self.closed = True
        with anyio.CancelScope(shield=True):  # also runs while the request's task is being cancelled
            if self.stream is not None:
                try:
                    await self.stream.aclose()
                except Exception:  # closing a failed stream: the failure was reported already
                    logger.debug("closing the engine stream failed", exc_info=True)
        gateway = self.gateway
        if self.running:
            gateway.slots.release()
            gateway.running -= 1
            gateway.metrics.running.dec()
        self.release_body()
        gateway.admitted -= 1
        gateway.metrics.in_flight.dec()
        mode = self.request.mode if self.request is not None else "none"
        gateway.metrics.finished(self.endpoint, mode, status, self.result if status == 200 else None)


class EventStream(StreamingResponse):
    """Server-sent events of one run. Whatever ends the response (the last event, the client
    going away, even before the first event was sent), the generator is closed and the run's
    slots are freed at once: Starlette cancels a response without closing its iterator."""

    def __init__(self, events: AsyncGenerator[bytes, None], run: Run) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events
        self._run = run

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._events.aclose()
                await self._run.close(499)  # a no-op when the events closed it


def sse(obj: dict[str, Any]) -> bytes:
    """One event, encoded here: text that UTF-8 cannot carry fails in the events' own ``try``."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


def sse_error(error: APIError) -> bytes:
    return f"data: {json.dumps(error.body())}\n\n".encode()  # ASCII: always encodable


async def stream_completion(run: Run, first: str | None, model: str) -> AsyncGenerator[bytes, None]:
    """A streamed chat or text completion's events (``StreamChunks``) as the run yields its text;
    whatever fails after the first token (the engine, or encoding an event) ends it with an error
    event, counted with the error's status, then ``[DONE]``. (A Responses stream:
    ``responses_api.stream_response``.)"""
    req = run.request
    assert req is not None
    chunks = StreamChunks(req.kind, new_id(req.kind), now(), model, req.prompt_shape)
    status = 499  # unless the stream ends or fails: the client went away (cancelled, closed)
    try:
        for chunk in chunks.first():
            yield sse(chunk)
        delta = first
        while delta is not None:
            yield sse(chunks.delta(delta))
            delta = await run.next()
        result = run.result
        assert result is not None
        rest = run.calls.finish(result) if run.calls is not None else ""  # content after the tool calls
        tail = [sse(chunks.delta(rest))] if rest else []
        tail += [sse(chunk) for chunk in chunks.calls(result)]
        tail += [sse(chunks.last(result))] + ([sse(chunks.usage(result))] if req.include_usage else [])
        status = 200
    except Exception as exc:  # after the first token: an error event ends the stream
        error = to_api_error(exc)
        status = error.status
        tail = [sse_error(error)]
    finally:
        # Free the slots before the last event: a client may send its next request at once.
        await run.close(status)
    for event in tail:
        yield event
    yield b"data: [DONE]\n\n"
