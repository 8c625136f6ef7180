"""An OpenAI-compatible HTTP gateway: any OpenAI client gets SpecPrefill with no code change.

``create_app(engine)`` builds a FastAPI app serving ``/v1/chat/completions``,
``/v1/completions``, ``/v1/passages`` (warm the draft's passage store), ``/v1/models``, ``/health``,
``/ready`` and ``/metrics``; ``run_app`` serves it
with uvicorn and drains on SIGTERM; ``specprefill-rag gateway`` and ``specprefill-rag serve MODEL --gateway-port 8080``
do both from the command line. See docs/gateway.md.

FastAPI, uvicorn and prometheus-client are optional (``pip install 'specprefill-rag[gateway]'``)
and imported only when an app is built; the prompt mapping (``messages``) needs none of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

from ..errors import ConfigError, MissingDependencyError
from .admission import MIN_SECRET_BYTES
from .messages import DEFAULT_SHAPES, PromptShape

if TYPE_CHECKING:
    from ..engine import SpecPrefillEngine

__all__ = [
    "DEFAULT_SHAPES", "INSTALL_HINT", "GatewayMode", "GatewayOptions", "PromptShape", "create_app", "require_installed",
    "run_app",
]

INSTALL_HINT = "pip install 'specprefill-rag[gateway]'"

# How a request is answered: "specprefill" (position mode: the kept tokens at their original
# positions), "full" (the whole prompt) or "text" (the kept text as an ordinary chat, any upstream).
GatewayMode = Literal["specprefill", "full", "text"]


@dataclass(frozen=True)
class GatewayOptions:
    """How one gateway serves its engine (``create_app(engine, options)`` or the same as keywords).

    ``api_key``: required as ``Authorization: Bearer KEY`` on ``/v1/*`` (None or "": open).
    ``api_keys``: more keys, each mapped to its tenant's name: a tenant's requests share cached
    work (the draft's caches, vLLM's prefix cache) only with requests of the same tenant and the
    same ``cache_salt``; requests with ``api_key`` (or an open gateway's) share it by their
    ``cache_salt`` among themselves, never with a tenant's. Either or both may be given; with
    any, a key is required. ``cache_secret``: the key of every request's cache namespace (an HMAC
    of its tenant and ``cache_salt``; at least 16 bytes; None: 32 random bytes drawn when the app
    is built). Give gateways behind one router the same secret so that a tenant's requests share
    vLLM's prefix cache whichever gateway they reach.
    ``max_queue``: requests in flight (reading their body, waiting or running) before HTTP 429.
    ``max_concurrency``: requests generating at once (None: max(4, the draft's ``max_batch``)).
    ``model_name``: the id in ``/v1/models`` and in answers (None: the backend's); requests may
    name any model. ``shapes``: the prompt layouts whose documents are recognised as passages.
    ``max_body_bytes``: a larger request body is refused with HTTP 413 before it is read whole.
    ``max_body_bytes_in_flight``: the bodies being read or parsed at once, together (a body
    without a Content-Length counts as ``max_body_bytes``); the next gets HTTP 429 (None: four
    times ``max_body_bytes``). ``ready_cache_s``: how long ``/ready`` reuses its upstream check.
    ``default_mode``: the mode of a request that names none (None: "specprefill" with a draft,
    else "full"); "text" sends the kept text as a chat to any OpenAI-compatible upstream.
    ``fallback_text_mode``: a planned request whose upstream has no SpecPrefill plugin is answered
    in text mode (reported in its ``specprefill.fallback``) instead of failing with HTTP 502.
    """

    api_key: str | None = field(default=None, repr=False)
    max_queue: int = 64
    max_concurrency: int | None = None
    model_name: str | None = None
    shapes: Sequence[PromptShape] = field(default=DEFAULT_SHAPES)
    max_body_bytes: int = 8 << 20  # bytes; 8 MiB holds about two million tokens of English text
    api_keys: Mapping[str, str] = field(default_factory=dict, repr=False)  # API key -> tenant name
    max_body_bytes_in_flight: int | None = None  # bytes; None: 4 * max_body_bytes
    ready_cache_s: float = 2.0  # seconds
    default_mode: GatewayMode | None = None  # None: "specprefill" with a draft, else "full"
    fallback_text_mode: bool = False
    cache_secret: bytes | None = field(default=None, repr=False)  # None: random per app; never shown

    def __post_init__(self) -> None:
        secret = self.cache_secret
        if secret is not None and (not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES):
            shown = f"{len(secret)} bytes" if isinstance(secret, bytes) else type(secret).__name__
            raise ConfigError(f"cache_secret must be bytes, at least {MIN_SECRET_BYTES} of them (or None: random), "
                              f"got {shown}")
        if self.default_mode is not None and self.default_mode not in get_args(GatewayMode):
            choices = ", ".join(repr(m) for m in get_args(GatewayMode))
            raise ConfigError(f"default_mode must be one of {choices} or None, got {self.default_mode!r:.40}")
        if not isinstance(self.fallback_text_mode, bool):
            raise ConfigError(f"fallback_text_mode must be True or False, got {self.fallback_text_mode!r:.40}")
        if isinstance(self.max_body_bytes, bool) or not isinstance(self.max_body_bytes, int):
            raise ConfigError(f"max_body_bytes must be an int, got {self.max_body_bytes!r}")
        if self.max_body_bytes < 1:
            raise ConfigError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        in_flight = self.max_body_bytes_in_flight
        if in_flight is None:
            object.__setattr__(self, "max_body_bytes_in_flight", 4 * self.max_body_bytes)
        elif isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < self.max_body_bytes:
            raise ConfigError(f"max_body_bytes_in_flight must be an int >= max_body_bytes ({self.max_body_bytes}), "
                              f"got {in_flight!r}")
        pairs = self.api_keys.items() if isinstance(self.api_keys, Mapping) else None
        if pairs is None or not all(isinstance(x, str) and x.strip() for pair in pairs for x in pair):
            raise ConfigError("api_keys must map non-empty API keys to non-empty tenant names")
        if self.api_key and self.api_key in self.api_keys:
            raise ConfigError("api_key is also one of api_keys: give each key once")
        object.__setattr__(self, "api_keys", dict(self.api_keys))
        if not (isinstance(self.ready_cache_s, (int, float)) and 0 <= self.ready_cache_s < float("inf")):
            raise ConfigError(f"ready_cache_s must be a number of seconds >= 0, got {self.ready_cache_s!r}")
        if self.max_queue < 1:
            raise ConfigError(f"max_queue must be >= 1, got {self.max_queue}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ConfigError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        object.__setattr__(self, "shapes", tuple(self.shapes))


def _app_module() -> Any:
    try:
        from . import app
    except ImportError as error:
        raise MissingDependencyError(
            f"the SpecPrefill gateway needs fastapi, uvicorn and prometheus-client ({error.name} is missing)",
            INSTALL_HINT,
        ) from error
    return app


def require_installed() -> None:
    """``MissingDependencyError`` naming the extra when fastapi, uvicorn or prometheus-client is
    missing: what serving the gateway needs, checked before any model loads."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as error:
        raise MissingDependencyError(f"the gateway needs {error.name}", INSTALL_HINT) from error


def create_app(engine: SpecPrefillEngine, options: GatewayOptions | None = None, **fields: Any) -> Any:
    """A FastAPI app serving ``engine`` over the OpenAI API (``GatewayOptions`` fields may be given
    as keywords instead of ``options``)."""
    return _app_module().create_app(engine, options, **fields)


def run_app(app: Any, *, host: str = "127.0.0.1", port: int = 8080, log_level: str = "info",
            drain_timeout: float = 30.0) -> None:
    """Serve ``app`` with uvicorn until SIGINT/SIGTERM, then drain: the requests in flight get up
    to ``drain_timeout`` seconds while new ones get 503 (docs/deploy.md)."""
    require_installed()
    _app_module().run_app(app, host=host, port=port, log_level=log_level, drain_timeout=drain_timeout)
