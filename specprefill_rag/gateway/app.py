"""The FastAPI app: OpenAI-compatible endpoints in front of one ``SpecPrefillEngine``.

Every request is admitted or refused at once: at most ``max_queue`` requests are in flight
(running or waiting), the next gets HTTP 429 with ``Retry-After``. Of the admitted, at most
``max_concurrency`` generate at a time, through ``engine.astream``: every model step runs in a
worker thread, so the event loop only moves bytes. Concurrent requests score in one draft
batch when the engine's ``DraftConfig.max_batch`` allows.

Failures before the first token are plain HTTP errors (400, 413, 502, 503, 504, OpenAI-shaped);
after it, an ``{"error": ...}`` event ends the stream, and every stream ends with ``[DONE]``. A
client that goes away stops its generation: the engine stream is closed (and with it the
request to an upstream vLLM). A body over ``max_body_bytes`` is refused before it is read whole.

Deployment (docs/deploy.md): ``/health`` says the process is alive; ``/ready`` answers 200 only
once the engine has warmed up (one tiny answer through the draft and the main model: for a vLLM
upstream that also proves it reachable and its plugin active), the upstream answers now, and the
gateway is not draining, 503 with the failing check otherwise. SIGTERM (or Ctrl-C) starts a
drain: ``/ready`` turns 503 and new generation requests get 503 with ``Retry-After`` while the
requests in flight finish; the process exits once none is left or after ``drain_timeout`` seconds
(a second signal shuts down at once). Gateways share nothing, so N of them behind one load
balancer answer alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from ..engine import Mode, SpecPrefillEngine
from ..errors import ConfigError, InputError
from ..streams import AsyncTextStream
from ..types import GenerationResult
from . import GatewayOptions
from .metrics import GatewayMetrics
from .protocol import GatewayRequest, parse_chat, parse_completion
from .responses import RETRY_AFTER_S, APIError, StreamChunks, error_body, new_id, now, response, to_api_error

__all__ = ["Gateway", "create_app", "run_app"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ClientGone(Exception):
    """The client closed the connection before the answer was complete."""


def _too_large(size: int | None, limit: int) -> APIError:
    """413 for a body of ``size`` bytes (None: more than ``limit``, read up to there)."""
    what = f"has {size} bytes, over" if size is not None else "has more bytes than"
    return APIError(413, f"the request body {what} this gateway's limit of {limit} bytes (--max-body-bytes)",
                    code="request_too_large")


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed the connection (the body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
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


class _Run:
    """One admitted request: its queue slot, its generation slot and its engine stream."""

    def __init__(self, gateway: Gateway, request: GatewayRequest, endpoint: str) -> None:
        self.gateway, self.request, self.endpoint = gateway, request, endpoint
        self.stream: AsyncTextStream | None = None
        self.running = False
        self.closed = False
        gateway.admitted += 1
        gateway.metrics.in_flight.inc()

    @property
    def result(self) -> GenerationResult | None:
        return self.stream.result if self.stream is not None else None

    async def start(self) -> str | None:
        """Wait for a generation slot, start the engine stream; the first text delta (None: no text)."""
        await self.gateway.slots.acquire()
        self.running = True
        self.gateway.running += 1
        self.gateway.metrics.running.inc()
        req = self.request
        self.stream = await self.gateway.engine.astream(
            list(req.segments), mode=req.mode, keep_rate=req.keep_rate, generation=req.generation
        )
        return await self.next()

    async def next(self) -> str | None:
        assert self.stream is not None
        try:
            return await self.stream.__anext__()
        except StopAsyncIteration:
            return None

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
        gateway.admitted -= 1
        gateway.metrics.in_flight.dec()
        gateway.metrics.finished(self.endpoint, self.request.mode, status, self.result if status == 200 else None)


class _EventStream(StreamingResponse):
    """Server-sent events of one run. Whatever ends the response (the last event, the client
    going away, even before the first event was sent), the generator is closed and the run's
    slots are freed at once: Starlette cancels a response without closing its iterator."""

    def __init__(self, events: AsyncGenerator[bytes, None], run: _Run) -> None:
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


def _sse(obj: dict[str, Any]) -> bytes:
    """One event, encoded here: text that UTF-8 cannot carry fails in the events' own ``try``."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


def _sse_error(error: APIError) -> bytes:
    return f"data: {json.dumps(error.body())}\n\n".encode()  # ASCII: always encodable


class Gateway:
    """State of one gateway: the engine, admission counters, metrics. ``create_app`` wires it."""

    def __init__(self, engine: SpecPrefillEngine, options: GatewayOptions) -> None:
        self.max_concurrency = options.max_concurrency or max(4, engine.config.draft.max_batch)
        self.engine = engine
        self.api_key = options.api_key or None
        self.max_queue = options.max_queue
        self.max_body_bytes = options.max_body_bytes
        self.model_name = options.model_name or engine.backend.model_name
        self.shapes = tuple(options.shapes)
        self.default_mode: Mode = "specprefill" if engine.draft is not None else "full"
        self.metrics = GatewayMetrics()
        self.slots = asyncio.Semaphore(self.max_concurrency)
        self.admitted = 0  # requests in flight: running or waiting for a slot
        self.running = 0
        self.created = now()
        self.draining = False  # set by a shutdown signal (``run_app``): not ready, new generations 503
        self.warmed = False  # the engine answered once (``ready``)
        self._warm_lock = asyncio.Lock()

    # -- request handling ------------------------------------------------------------------

    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "Incorrect or missing API key: send it as 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    async def _body(self, request: Request) -> bytes:
        """The request body, refused with 413 as soon as it is known to exceed ``max_body_bytes``:
        by its Content-Length, else once the bytes read pass the limit (reading stops there)."""
        limit = self.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(int(declared), limit)
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(None, limit)
                chunks.append(chunk)
        except ClientDisconnect:
            raise ClientGone from None
        return b"".join(chunks)

    async def _parse(self, request: Request, endpoint: str) -> GatewayRequest:
        self.authorize(request)
        raw = await self._body(request)
        try:
            body = json.loads(raw)
        except ValueError:
            raise APIError(400, "the request body is not valid JSON") from None
        except RecursionError:  # the C decoder counts its depth against the recursion limit
            raise APIError(400, "the request body nests JSON arrays or objects too deeply") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        parse = parse_chat if endpoint == "chat" else parse_completion
        try:
            return parse(body, self.engine.config.generation, self.default_mode, self.shapes)
        except (InputError, ConfigError) as error:
            raise APIError(400, str(error)) from None

    async def handle(self, request: Request, endpoint: str) -> Response:
        """One ``/v1/chat/completions`` (``endpoint="chat"``) or ``/v1/completions`` request."""
        try:
            req = await self._parse(request, endpoint)
        except ClientGone:  # before the whole body came
            self.metrics.finished(endpoint, "none", 499)
            return Response(status_code=499)
        except Exception as exc:
            error = to_api_error(exc)  # an unexpected failure too: OpenAI-shaped and counted
            self.metrics.finished(endpoint, "none", error.status)
            raise error from exc
        if self.draining:
            self.metrics.finished(endpoint, req.mode, 503)
            raise APIError(503, "the gateway is shutting down: retry, the load balancer sends you to another one",
                           type="service_unavailable", code="draining", headers={"Retry-After": str(RETRY_AFTER_S)})
        if self.admitted >= self.max_queue:
            self.metrics.finished(endpoint, req.mode, 429)
            raise APIError(
                429, f"the gateway has {self.max_queue} requests in flight, its limit (--max-queue): retry later",
                type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        run = _Run(self, req, endpoint)
        first: str | None = None
        answer: JSONResponse | None = None
        try:
            if req.stream:  # wait for the first text: until then a failure is still an HTTP status
                first = await _unless_disconnected(request, run.start())
            else:
                await _unless_disconnected(request, run.collect())
                result = run.result
                assert result is not None
                # Rendered here, so that text UTF-8 cannot carry is this request's error, counted as such.
                answer = JSONResponse(response(req.kind, new_id(req.kind), now(), self.model_name, result,
                                               req.prompt_shape))
        except ClientGone:
            await run.close(499)
            return Response(status_code=499)
        except Exception as exc:
            failure = to_api_error(exc)
            await run.close(failure.status)
            raise failure from exc
        except BaseException:  # cancelled (server shutdown)
            await run.close(499)
            raise
        if req.stream:
            return _EventStream(self._events(run, first), run)
        await run.close(200)
        assert answer is not None
        return answer

    async def _events(self, run: _Run, first: str | None) -> AsyncGenerator[bytes, None]:
        """The stream's events; whatever fails after the first token (the engine, or encoding an
        event) ends it with an error event, counted with the error's status, then ``[DONE]``."""
        req = run.request
        chunks = StreamChunks(req.kind, new_id(req.kind), now(), self.model_name, req.prompt_shape)
        status = 499  # unless the stream ends or fails: the client went away (cancelled, closed)
        try:
            for chunk in chunks.first():
                yield _sse(chunk)
            delta = first
            while delta is not None:
                yield _sse(chunks.delta(delta))
                delta = await run.next()
            result = run.result
            assert result is not None
            tail = [_sse(chunks.last(result))] + ([_sse(chunks.usage(result))] if req.include_usage else [])
            status = 200
        except Exception as exc:  # after the first token: an error event ends the stream
            error = to_api_error(exc)
            status = error.status
            tail = [_sse_error(error)]
        finally:
            # Free the slots before the last event: a client may send its next request at once.
            await run.close(status)
        for event in tail:
            yield event
        yield b"data: [DONE]\n\n"

    # -- other endpoints -------------------------------------------------------------------

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "specprefill-rag"}

    def health(self) -> dict[str, Any]:
        config = self.engine.config
        return {
            "status": "ok", "model": self.model_name, "backend": self.engine.backend.name,
            "draft": self.engine.draft is not None, "default_mode": self.default_mode,
            "keep_rate": config.selection.keep_rate, "draft_max_batch": config.draft.max_batch,
            "in_flight": self.admitted, "running": self.running,
            "max_queue": self.max_queue, "max_concurrency": self.max_concurrency, "draining": self.draining,
        }

    async def ready(self) -> tuple[bool, dict[str, Any]]:
        """Whether to send this gateway traffic, and each check's verdict (the module docstring).

        The warm-up runs once, on the first call that finds the engine cold (one at a time; a
        failed one is tried again on the next call); the upstream check runs on every call.
        """
        checks: dict[str, str] = {"draining": "yes" if self.draining else "no"}
        if not self.warmed:
            async with self._warm_lock:
                if not self.warmed:
                    try:
                        await asyncio.to_thread(self.engine.warm_up)
                        self.warmed = True
                    except Exception as error:  # reported, tried again on the next probe
                        checks["warm_up"] = f"failed: {to_api_error(error).message}"
        if self.warmed:
            checks["warm_up"] = "done"
            ping = getattr(self.engine.backend, "ping", None)  # backends with an upstream server
            try:
                if ping is not None:
                    await asyncio.to_thread(ping)
                checks["upstream"] = "ok" if ping is not None else "none"
            except Exception as error:
                checks["upstream"] = f"failed: {to_api_error(error).message}"
        ok = not self.draining and checks["warm_up"] == "done" and checks.get("upstream") in ("ok", "none")
        return ok, {"ready": ok, "checks": checks}


def create_app(engine: SpecPrefillEngine, options: GatewayOptions | None = None, **fields: Any) -> FastAPI:
    """An OpenAI-compatible app serving ``engine`` (docs/gateway.md); ``options`` (or its fields as
    keywords) say how: API key, queue and concurrency bounds, model name, prompt shapes."""
    if options is not None and fields:
        raise ConfigError("give GatewayOptions or its fields as keywords, not both")
    gateway = Gateway(engine, options or GatewayOptions(**fields))
    # No docs pages and no schema: /openapi.json would describe the API to anyone, key or not.
    app = FastAPI(title="SpecPrefill gateway", lifespan=_lifespan(gateway), docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.gateway = gateway
    app.exception_handler(APIError)(_api_error)
    app.exception_handler(StarletteHTTPException)(_http_error)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await gateway.handle(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await gateway.handle(request, "completions")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        gateway.authorize(request)
        return gateway.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> dict[str, Any]:
        gateway.authorize(request)
        if model_id != gateway.model_name:
            raise APIError(404, f"the model {model_id!r} does not exist; this gateway serves {gateway.model_name!r}",
                           param="model", code="model_not_found")
        return gateway.model_card()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return gateway.health()

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok, body = await gateway.ready()
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = gateway.metrics.render()
        return Response(body, media_type=content_type)

    return app


def _lifespan(gateway: Gateway) -> Any:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Every model step runs in the loop's default executor (asyncio.to_thread): size it so
        # that each running generation has a thread, plus a few for closing and tokenizing.
        executor = ThreadPoolExecutor(gateway.max_concurrency + 4, thread_name_prefix="specprefill-gateway")
        asyncio.get_running_loop().set_default_executor(executor)
        warm_up = asyncio.create_task(gateway.ready())  # ready without waiting for the first probe
        yield
        warm_up.cancel()
        executor.shutdown(wait=False, cancel_futures=True)

    return lifespan


async def _api_error(request: Request, error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    code = "not_found" if error.status_code == 404 else None
    return JSONResponse(error_body(str(error.detail), type="invalid_request_error", code=code),
                        status_code=error.status_code, headers=error.headers)


DRAIN_TIMEOUT_S = 30.0  # seconds a drain waits for the requests in flight


def run_app(app: FastAPI, *, host: str = "127.0.0.1", port: int = 8080, log_level: str = "info",
            drain_timeout: float = DRAIN_TIMEOUT_S) -> None:
    """Serve ``app`` with uvicorn until SIGTERM/SIGINT, then drain (module docstring): in-flight
    requests get ``drain_timeout`` seconds, then 5 s more while uvicorn closes their connections."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        drain_until: float | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.drain_until is not None:  # a second signal: shut down now
                super().handle_exit(sig, frame)
                return
            self.drain_until = time.monotonic() + drain_timeout
            getattr(self, "_captured_signals", []).append(sig)  # uvicorn re-raises it once shut down
            app.state.gateway.draining = True
            logger.warning("draining: %d requests in flight, at most %g s", app.state.gateway.admitted, drain_timeout)

        async def on_tick(self, counter: int) -> bool:
            if self.drain_until is not None and not self.should_exit and (
                    app.state.gateway.admitted == 0 or time.monotonic() >= self.drain_until):
                self.should_exit = True
            return await super().on_tick(counter)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    DrainingServer(config).run()
