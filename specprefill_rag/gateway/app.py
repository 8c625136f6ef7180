"""The FastAPI app: OpenAI-compatible endpoints in front of one ``SpecPrefillEngine``.

Every request is admitted or refused at once, before a byte of its body is read: at most
``max_queue`` requests are in flight (reading their body, waiting or running) and at most
``max_body_bytes_in_flight`` bytes of bodies are being read or parsed; the next gets HTTP 429
with ``Retry-After``. Parsing (JSON, prompt shapes, segments: linear in the body) runs in a
worker thread. Of the admitted, at most ``max_concurrency`` generate at a time, through
``engine.astream``: every model step runs in a worker thread, so the event loop only moves
bytes. Concurrent requests score in one draft batch when the engine's ``DraftConfig.max_batch``
allows; requests of different cache namespaces (tenants, ``cache_salt``, keyed with the gateway's
secret) share no cache and no batch.

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

A request in text mode (``specprefill.mode: "text"``, or ``default_mode``) sends the draft's kept
text as an ordinary chat to the backend's server, any OpenAI-compatible one (``text_mode``); with
``fallback_text_mode`` a planned request whose vLLM has no plugin is answered so instead of failing.

The request's life (slots, engine stream, events) is ``runs``; the checks before its body is read
are ``admission``; a warm call (``POST /v1/passages``) is ``passages``; this module holds the
gateway's state, its routes and serving it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..engine import SpecPrefillEngine
from ..errors import ConfigError, InputError, PluginMissingError
from . import GatewayMode, GatewayOptions, tools
from .admission import cache_namespace, check_media_type, new_secret, too_large
from .limits import check_totals, decode_body
from .metrics import GatewayMetrics
from .openapi import CHAT_REQUEST, COMPLETION_REQUEST, PASSAGES_REQUEST, RESPONSES_REQUEST, request_body
from .passages import warm_passages
from .protocol import GatewayRequest, parse_chat, parse_completion
from .responses import RETRY_AFTER_S, APIError, error_body, new_id, now, response, to_api_error
from .responses_api import ResponsesCall, ResponseStore, stream_response, whole_response
from .runs import ClientGone, EventStream, Run, stream_completion, unless_disconnected
from .text_mode import TextMode, added_token_strings
from .text_mode import warm_up as warm_up_text

__all__ = ["Gateway", "cache_namespace", "create_app", "run_app"]

logger = logging.getLogger(__name__)


class Gateway:
    """State of one gateway: the engine, admission counters, metrics. ``create_app`` wires it."""

    def __init__(self, engine: SpecPrefillEngine, options: GatewayOptions) -> None:
        self.max_concurrency = options.max_concurrency or max(4, engine.config.draft.max_batch)
        self.engine = engine
        self.api_key = options.api_key or None
        self.tenants = dict(options.api_keys)  # API key -> tenant name
        self.cache_secret = options.cache_secret or new_secret()  # keys every request's cache namespace
        if options.cache_secret is None:
            logger.info("cache namespaces are keyed with a secret drawn at start: gateways behind one router share "
                        "a tenant's vLLM prefix cache only when given the same one (--cache-secret-file)")
        self.max_queue = options.max_queue
        self.max_body_bytes = options.max_body_bytes
        assert options.max_body_bytes_in_flight is not None  # GatewayOptions fills it in
        self.max_body_bytes_in_flight = options.max_body_bytes_in_flight
        self.ready_cache_s = options.ready_cache_s
        self.model_name = options.model_name or engine.backend.model_name
        self.shapes = tuple(options.shapes)
        self.default_mode: GatewayMode = options.default_mode or (
            "specprefill" if engine.draft is not None else "full")
        if self.default_mode != "full" and engine.draft is None:
            raise ConfigError(f"default_mode={self.default_mode!r} needs a draft model; this engine has none")
        chat_upstream = getattr(engine.backend, "chat_upstream", None)  # a server backend's plain chat endpoint
        self.text = TextMode(chat_upstream() if chat_upstream is not None else None,
                             tokens=added_token_strings(engine.tokenizer))
        self.fallback_text_mode = options.fallback_text_mode
        self.metrics = GatewayMetrics()
        self.conversations = ResponseStore()  # what /v1/responses' previous_response_id continues
        if engine.draft is not None:
            self.metrics.watch_passages(engine.draft.passages)
        self.slots = asyncio.Semaphore(self.max_concurrency)
        self.admitted = 0  # requests in flight: reading their body, waiting for a slot or running
        self.body_bytes = 0  # of the admitted requests' bodies not parsed yet (declared, else the limit)
        self.running = 0
        self.created = now()
        self.draining = False  # set by a shutdown signal (``run_app``): not ready, new generations 503
        self.warmed = False  # the engine answered once (``ready``)
        self._warm_lock = asyncio.Lock()
        self._upstream: tuple[float, str] | None = None  # (monotonic time, verdict) of the last upstream check
        self._upstream_lock = asyncio.Lock()

    # -- request handling ------------------------------------------------------------------

    def authorize(self, request: Request) -> str | None:
        """The request's tenant (None: the shared namespace), or 401 without a valid key. Every
        configured key is compared, in constant time each, whichever matches."""
        if self.api_key is None and not self.tenants:
            return None
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        given = token.strip().encode()
        found: str | None = None
        matched = False
        if self.api_key is not None and hmac.compare_digest(given, self.api_key.encode()):
            matched = True
        for key, tenant in self.tenants.items():
            if hmac.compare_digest(given, key.encode()):
                matched, found = True, tenant
        if scheme.lower() != "bearer" or not matched:
            raise APIError(401, "Incorrect or missing API key: send it as 'Authorization: Bearer KEY'",
                           code="invalid_api_key")
        return found

    def admit(self, request: Request, endpoint: str) -> Run:
        """Admission, before a byte of the body is read: the declared size (413), the media type
        (415), draining (503), the queue (429) and the bodies in flight (429). A refusal is counted."""
        limit = self.max_body_bytes
        declared = request.headers.get("content-length", "")
        try:
            if declared.isdigit() and int(declared) > limit:
                raise too_large(int(declared), limit)
            check_media_type(request.headers.get("content-type"))
            if self.draining:
                raise APIError(503, "the gateway is shutting down: retry, the load balancer sends you to another one",
                               type="service_unavailable", code="draining",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
            if self.admitted >= self.max_queue:
                raise APIError(
                    429, f"the gateway has {self.max_queue} requests in flight, its limit (--max-queue): retry later",
                    type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)},
                )
            size = int(declared) if declared.isdigit() else limit
            if self.body_bytes + size > self.max_body_bytes_in_flight:
                raise APIError(
                    429, f"the gateway is reading {self.body_bytes} bytes of request bodies, its limit being "
                    f"{self.max_body_bytes_in_flight} (--max-body-bytes-in-flight): retry later",
                    type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)},
                )
        except APIError as error:
            self.metrics.finished(endpoint, "none", error.status)
            raise
        return Run(self, endpoint, size)

    async def read_body(self, request: Request) -> bytes:
        """The request body, refused with 413 once the bytes read pass ``max_body_bytes`` (reading
        stops there; a declared size over it was refused at admission)."""
        limit = self.max_body_bytes
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large(None, limit)
                chunks.append(chunk)
        except ClientDisconnect:
            raise ClientGone from None
        return b"".join(chunks)

    def _parse(self, raw: bytes, endpoint: str, tenant: str | None) -> tuple[GatewayRequest, ResponsesCall | None]:
        """The body as a request (in a worker thread: JSON, prompt shapes and segments take time
        linear in the body, up to tens of milliseconds for megabytes); its cache salt replaced by
        its namespace (``admission.cache_namespace``: the tenant's and the salt's HMAC). A
        Responses body is read as its chat body (``responses_api``), with what its answer needs."""
        body = decode_body(raw)  # its containers counted before any is built: the request's caps in all (limits)
        call = None
        if endpoint == "responses":
            call = ResponsesCall.read(body, self.conversations, cache_namespace(self.cache_secret, tenant, None))
            body = call.chat
        check_totals(body)
        parse = parse_completion if endpoint == "completions" else parse_chat
        try:
            req = parse(body, self.engine.config.generation, self.default_mode, self.shapes)
        except (InputError, ConfigError, APIError) as error:
            failure = error if isinstance(error, APIError) else APIError(400, str(error))
            raise (failure if call is None else call.renamed(failure)) from None
        req = dataclasses.replace(req, call_opener=tools.check_support(req.segments, self.engine.tokenizer))
        salt = cache_namespace(self.cache_secret, tenant, req.generation.cache_salt)  # every request's, keyed
        return dataclasses.replace(req, generation=dataclasses.replace(req.generation, cache_salt=salt)), call

    async def handle(self, request: Request, endpoint: str) -> Response:
        """One ``/v1/chat/completions`` (``endpoint="chat"``), ``/v1/completions`` or ``/v1/responses``
        request."""
        try:
            tenant = self.authorize(request)
        except APIError as error:
            self.metrics.finished(endpoint, "none", error.status)
            raise
        run = self.admit(request, endpoint)
        first: str | None = None
        answer: JSONResponse | None = None
        call: ResponsesCall | None = None
        try:
            raw = await self.read_body(request)
            req, call = await asyncio.to_thread(self._parse, raw, endpoint, tenant)
            run.parsed(req)
            if req.stream:  # wait for the first text: until then a failure is still an HTTP status
                first = await unless_disconnected(request, run.start())
            else:
                await unless_disconnected(request, run.collect())
                result = run.result
                assert result is not None
                # Rendered here, so that text UTF-8 cannot carry is this request's error, counted as such.
                answer = JSONResponse(
                    response(req.kind, new_id(req.kind), now(), self.model_name, result, req.prompt_shape)
                    if call is None else whole_response(call, self.model_name, result, req.prompt_shape))
                if call is not None:
                    call.remember(self.conversations, result)
        except ClientGone:
            await run.close(499)
            return Response(status_code=499)
        except Exception as exc:
            failure = to_api_error(exc)  # an unexpected failure too: OpenAI-shaped and counted
            failure = failure if call is None else call.renamed(failure)  # a Responses request's own fields
            await run.close(failure.status)
            raise failure from exc
        except BaseException:  # cancelled (server shutdown)
            await run.close(499)
            raise
        if req.stream:
            if call is not None:
                return EventStream(stream_response(run, first, call, self.model_name, self.conversations), run)
            return EventStream(stream_completion(run, first, self.model_name), run)
        await run.close(200)
        assert answer is not None
        return answer

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
            "fallback_text_mode": self.fallback_text_mode,
            "text_upstream": self.text.upstream.base_url if self.text.upstream is not None else "local",
            "keep_rate": config.selection.keep_rate, "draft_max_batch": config.draft.max_batch,
            "read_passages": "joint" if config.draft.passages is None else "apart",
            "in_flight": self.admitted, "running": self.running,
            "max_queue": self.max_queue, "max_concurrency": self.max_concurrency, "draining": self.draining,
        }

    async def ready(self) -> tuple[bool, dict[str, Any]]:
        """Whether to send this gateway traffic, and each check's verdict (the module docstring).

        The warm-up runs once, on the first call that finds the engine cold (one at a time; a
        failed one is tried again on the next call). The upstream check's verdict is reused for
        ``ready_cache_s`` seconds and one check runs at a time, so probes, however many, cannot
        multiply into requests to the upstream.
        """
        checks: dict[str, str] = {"draining": "yes" if self.draining else "no"}
        if not self.warmed:
            async with self._warm_lock:
                if not self.warmed:
                    try:
                        await asyncio.to_thread(self._warm_up)
                        self.warmed = True
                    except Exception as error:  # reported, tried again on the next probe
                        checks["warm_up"] = f"failed: {to_api_error(error).message}"
        if self.warmed:
            checks["warm_up"] = "done"
            checks["upstream"] = await self._upstream_check()
        ok = not self.draining and checks["warm_up"] == "done" and checks.get("upstream") in ("ok", "none")
        return ok, {"ready": ok, "checks": checks}

    def _warm_up(self) -> None:
        """The engine's warm-up; where its upstream has no plugin but text mode may answer (the
        default mode, or the fallback), the draft warmed up all the same and one tiny chat proves
        the upstream instead."""
        try:
            self.engine.warm_up()
        except PluginMissingError:
            if not (self.fallback_text_mode or self.default_mode == "text"):
                raise
            warm_up_text(self.engine, self.text)

    async def _upstream_check(self) -> str:
        """"ok", "none" (no upstream) or "failed: ..." for the upstream, at most ``ready_cache_s`` old."""
        ping = getattr(self.engine.backend, "ping", None)  # backends with an upstream server
        if ping is None:
            return "none"

        def fresh() -> str | None:
            if self._upstream is None or time.monotonic() - self._upstream[0] >= self.ready_cache_s:
                return None
            return self._upstream[1]

        if (verdict := fresh()) is not None:
            return verdict
        async with self._upstream_lock:  # probes arriving meanwhile wait for this check
            if (verdict := fresh()) is not None:
                return verdict
            try:
                await asyncio.to_thread(ping)
                verdict = "ok"
            except Exception as error:
                verdict = f"failed: {to_api_error(error).message}"
            self._upstream = (time.monotonic(), verdict)
            return verdict


def create_app(engine: SpecPrefillEngine, options: GatewayOptions | None = None, **fields: Any) -> FastAPI:
    """An OpenAI-compatible app serving ``engine`` (docs/gateway.md); ``options`` (or its fields as
    keywords) say how: API key, queue and concurrency bounds, model name, prompt shapes."""
    if options is not None and fields:
        raise ConfigError("give GatewayOptions or its fields as keywords, not both")
    gateway = Gateway(engine, options or GatewayOptions(**fields))
    # No docs pages and no schema: /openapi.json would describe the API to anyone, key or not
    # (``app.openapi()`` still gives it, with the request bodies of ``openapi``, to tests and tools).
    app = FastAPI(title="SpecPrefill gateway", lifespan=_lifespan(gateway), docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.gateway = gateway
    app.exception_handler(APIError)(_api_error)
    app.exception_handler(StarletteHTTPException)(_http_error)

    @app.post("/v1/chat/completions", openapi_extra=request_body(CHAT_REQUEST))
    async def chat_completions(request: Request) -> Response:
        return await gateway.handle(request, "chat")

    @app.post("/v1/completions", openapi_extra=request_body(COMPLETION_REQUEST))
    async def completions(request: Request) -> Response:
        return await gateway.handle(request, "completions")

    @app.post("/v1/responses", openapi_extra=request_body(RESPONSES_REQUEST))
    async def responses(request: Request) -> Response:
        return await gateway.handle(request, "responses")

    @app.post("/v1/passages", openapi_extra=request_body(PASSAGES_REQUEST))
    async def passages(request: Request) -> Response:
        return await warm_passages(gateway, request)

    _other_routes(app, gateway)
    return app


def _other_routes(app: FastAPI, gateway: Gateway) -> None:
    """The endpoints besides generation and warming: the models, health, readiness and metrics."""

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        gateway.authorize(request)
        return gateway.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> dict[str, Any]:
        gateway.authorize(request)
        if model_id != gateway.model_name:
            raise APIError(404, f"the model {model_id!r:.100} does not exist; this gateway serves "
                           f"{gateway.model_name!r}", param="model", code="model_not_found")
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
