"""What a request is checked for before a byte of its body is read, and the tenants' cache salts.

The gateway (``app.Gateway``) admits or refuses every request at once: the declared size (413), the
media type (415), then draining, the queue and the bodies in flight (its own counters). A tenant's
requests get a cache salt no other tenant can reach (``tenant_salt``).
"""

from __future__ import annotations

import hashlib
import json

from .responses import APIError

__all__ = ["check_media_type", "tenant_salt", "too_large"]


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


def tenant_salt(tenant: str, salt: str | None) -> str:
    """The cache salt of a request of ``tenant`` that sent ``salt`` (None: none): a digest of
    both, so no tenant, whatever salt it sends, reaches another tenant's namespace."""
    return "tenant-" + hashlib.sha256(json.dumps([tenant, salt]).encode()).hexdigest()[:32]
