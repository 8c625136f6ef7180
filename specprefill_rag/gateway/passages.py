"""``POST /v1/passages``: warm the draft's passage store with a corpus before questions arrive.

With passages read apart (``DraftConfig.passages``) the draft reads each passage once, against
the prompt's system part, and keeps that reading; a question over passages it holds costs it only
its own tokens. A passage never seen is read on first sight and kept, so a gateway warms itself;
this endpoint reads a corpus ahead, as an indexer computes embeddings (``engine.read_passages``).

A reading serves later requests of the same cache namespace whose system part equals the warm
call's ``instructions`` (docs/gateway.md, "Warming passages"): the namespace is derived exactly as
a chat request's (``admission.cache_namespace`` of the tenant and ``cache_salt``, the engine's
default salt when the call sends none), and a call without ``instructions`` serves requests
without a system message. The body is admitted, capped and read in a worker thread as a chat
request's is; the reading holds one generation slot.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..engine import SpecPrefillEngine
from ..types import Passage
from .admission import cache_namespace
from .fields import at_most, bad, shown, valid_text
from .limits import decode_body
from .protocol import passage_item
from .responses import APIError, to_api_error
from .runs import ClientGone

if TYPE_CHECKING:
    from .metrics import GatewayMetrics
    from .runs import Run

__all__ = ["ENDPOINT", "PassageHost", "WarmRequest", "check_reads_apart", "parse_warm", "warm_passages"]


class PassageHost(Protocol):
    """What a warm call takes from the gateway (``app.Gateway``): its engine, keys, admission and
    body reading (the same as for a chat request) and its metrics."""

    engine: SpecPrefillEngine
    metrics: GatewayMetrics
    cache_secret: bytes

    def authorize(self, request: Request) -> str | None: ...

    def admit(self, request: Request, endpoint: str) -> Run: ...

    async def read_body(self, request: Request) -> bytes: ...


ENDPOINT = "passages"  # the ``endpoint`` label of its requests in /metrics
_FIELDS = {"passages", "instructions", "cache_salt"}


@dataclass(frozen=True)
class WarmRequest:
    """One warm call: the passages to read, the system part they are read after ("": none), and
    the ``cache_salt`` sent (None: none)."""

    passages: tuple[Passage, ...]
    instructions: str
    cache_salt: str | None


def check_reads_apart(engine: SpecPrefillEngine) -> None:
    """400 when this gateway's engine keeps no passage readings (no draft, or joint reading)."""
    if engine.draft is None:
        raise APIError(400, "this gateway has no draft model: it reads no passages ahead")
    if engine.config.draft.passages is None:
        raise APIError(400, "this gateway's draft reads every prompt jointly, so it keeps no passage readings: "
                       "start it with --read-passages apart (DraftConfig.passages) to warm passages",
                       code="passages_not_read_apart")


def parse_warm(body: Mapping[str, Any]) -> WarmRequest:
    """The warm call in ``body``; 400 naming the field for anything else."""
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise bad(f"unknown field(s) {shown(unknown)}; known: {sorted(_FIELDS)}", param=str(unknown[0])[:80])
    raw = body.get("passages")
    if not isinstance(raw, list) or not raw:
        raise bad("passages must be a non-empty list of strings or {\"text\": ..., \"id\": ...} objects",
                  param="passages")
    at_most(raw, "passages", "passages")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad(f"instructions must be a string, got {shown(instructions)}", param="instructions")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise bad(f"cache_salt must be a non-empty string if provided, got {shown(salt)}", param="cache_salt")
    return WarmRequest(tuple(passage_item(item, f"passages[{n}]") for n, item in enumerate(raw)),
                       valid_text(instructions or "", "instructions"),
                       None if salt is None else valid_text(salt, "cache_salt"))


def _parse(raw: bytes) -> WarmRequest:
    return parse_warm(decode_body(raw))


async def warm_passages(gateway: PassageHost, request: Request) -> Response:
    """One ``POST /v1/passages``: admitted, its body read and parsed, its passages read into the
    draft's store under the request's namespace; ``{"found": n, "read": n}``. Counted in /metrics
    under ``endpoint="passages"``."""
    try:
        tenant = gateway.authorize(request)
        check_reads_apart(gateway.engine)
    except APIError as error:
        gateway.metrics.finished(ENDPOINT, "none", error.status)
        raise
    run = gateway.admit(request, ENDPOINT)
    status = 499  # unless it is answered or fails: cancelled (the server shutting down)
    try:
        req = await asyncio.to_thread(_parse, await gateway.read_body(request))
        run.release_body()
        engine = gateway.engine
        salt = cache_namespace(gateway.cache_secret, tenant, req.cache_salt or engine.config.generation.cache_salt)
        await run.take_slot()
        # Not cancelled when the client leaves: the reading runs to its end in its thread, holding the slot.
        got = await asyncio.to_thread(engine.read_passages, req.passages, instructions=req.instructions,
                                      cache_salt=salt)
        status = 200
    except ClientGone:
        return Response(status_code=499)
    except Exception as exc:
        failure = to_api_error(exc)
        status = failure.status
        raise failure from exc
    finally:
        await run.close(status)
    return JSONResponse({"found": got.found, "read": got.read})
