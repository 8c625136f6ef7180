"""What a request is checked for before a byte of its body is read, and every request's cache salt.

The gateway (``app.Gateway``) admits or refuses every request at once: the declared size (413), the
media type (415), then draining, the queue and the bodies in flight (its own counters). Every
request's cache namespace is ``cache_namespace``: an HMAC, under the gateway's secret, of its tenant
and the ``cache_salt`` it sent, so no request reaches a namespace that is not its own.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets

from .responses import APIError

__all__ = ["MIN_SECRET_BYTES", "cache_namespace", "check_media_type", "new_secret", "too_large"]

MIN_SECRET_BYTES = 16  # a cache secret shorter than this could be guessed
_DOMAIN = b"specprefill-rag cache namespace v1\0"  # what these HMACs are of: no other use of the secret


def too_large(size: int | None, limit: int) -> APIError:
    """413 for a body of ``size`` bytes (None: more than ``limit``, read up to there)."""
    what = f"has {size} bytes, over" if size is not None else "has more bytes than"
    return APIError(413, f"the request body {what} this gateway's limit of {limit} bytes (--max-body-bytes)",
                    code="request_too_large")


def check_media_type(content_type: str | None) -> None:
    """415 for a body declared as anything but JSON, as FastAPI (and so vLLM) refuses it: a web
    page can post a form or text/plain to a gateway on 127.0.0.1 without asking, JSON it cannot.
    A body with no Content-Type is read as JSON."""
    if content_type is None:
        return
    media = content_type.partition(";")[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    raise APIError(415, f"the request body must be JSON (Content-Type: application/json), not {media[:80]!r}",
                   code="unsupported_media_type")


def new_secret() -> bytes:
    """A random cache secret (32 bytes), for a gateway whose operator gave none."""
    return secrets.token_bytes(32)


def cache_namespace(secret: bytes, tenant: str | None, salt: str | None) -> str:
    """The cache salt of a request of ``tenant`` (None: the shared API key, or an open gateway)
    that sent ``salt`` (None: none): an HMAC-SHA-256 under ``secret`` of both.

    Every request's salt is made so, the tenant's or not: a client's ``cache_salt`` is only ever an
    input, so a client that sends another tenant's namespace (or anything) lands in a namespace of
    its own, and without the secret nobody can compute a namespace, not even a client of the same
    vLLM that bypasses the gateway. Each engine cache and vLLM key on the result alone."""
    message = _DOMAIN + json.dumps([tenant, salt]).encode()
    return "ns-" + hmac.new(secret, message, hashlib.sha256).hexdigest()[:32]
