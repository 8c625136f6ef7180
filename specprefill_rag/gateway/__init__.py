"""An OpenAI-compatible HTTP gateway: any OpenAI client gets SpecPrefill with no code change.

``create_app(engine)`` builds a FastAPI app serving ``/v1/chat/completions``,
``/v1/completions``, ``/v1/models``, ``/health``, ``/ready`` and ``/metrics``; ``run_app`` serves it
with uvicorn and drains on SIGTERM; ``specprefill-rag gateway`` and ``specprefill-rag serve MODEL --gateway-port 8080``
do both from the command line. See docs/gateway.md.

FastAPI, uvicorn and prometheus-client are optional (``pip install 'specprefill-rag[gateway]'``)
and imported only when an app is built; the prompt mapping (``messages``) needs none of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from .messages import DEFAULT_SHAPES, PromptShape

if TYPE_CHECKING:
    from ..engine import SpecPrefillEngine

__all__ = [
    "DEFAULT_SHAPES", "INSTALL_HINT", "GatewayOptions", "PromptShape", "create_app", "run_app",
]

INSTALL_HINT = "pip install 'specprefill-rag[gateway]'"


@dataclass(frozen=True)
class GatewayOptions:
    """How one gateway serves its engine (``create_app(engine, options)`` or the same as keywords).

    ``api_key``: required as ``Authorization: Bearer KEY`` on ``/v1/*`` (None or "": open).
    ``max_queue``: requests in flight (running or waiting) before HTTP 429. ``max_concurrency``:
    requests generating at once (None: max(4, the draft's ``max_batch``)). ``model_name``: the
    id in ``/v1/models`` and in answers (None: the backend's); requests may name any model.
    ``shapes``: the prompt layouts whose documents are recognised as passages.
    ``max_body_bytes``: a larger request body is refused with HTTP 413 before it is read whole.
    """

    api_key: str | None = None
    max_queue: int = 64
    max_concurrency: int | None = None
    model_name: str | None = None
    shapes: Sequence[PromptShape] = field(default=DEFAULT_SHAPES)
    max_body_bytes: int = 8 << 20  # bytes; 8 MiB holds about two million tokens of English text

    def __post_init__(self) -> None:
        if isinstance(self.max_body_bytes, bool) or not isinstance(self.max_body_bytes, int):
            raise ConfigError(f"max_body_bytes must be an int, got {self.max_body_bytes!r}")
        if self.max_body_bytes < 1:
            raise ConfigError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.max_queue < 1:
            raise ConfigError(f"max_queue must be >= 1, got {self.max_queue}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ConfigError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        object.__setattr__(self, "shapes", tuple(self.shapes))


def _app_module() -> Any:
    try:
        from . import app
    except ImportError as error:
        raise ImportError(
            f"the SpecPrefill gateway needs fastapi, uvicorn and prometheus-client ({error.name} is missing): "
            f"{INSTALL_HINT}"
        ) from error
    return app


def create_app(engine: SpecPrefillEngine, options: GatewayOptions | None = None, **fields: Any) -> Any:
    """A FastAPI app serving ``engine`` over the OpenAI API (``GatewayOptions`` fields may be given
    as keywords instead of ``options``)."""
    return _app_module().create_app(engine, options, **fields)


def run_app(app: Any, *, host: str = "127.0.0.1", port: int = 8080, log_level: str = "info",
            drain_timeout: float = 30.0) -> None:
    """Serve ``app`` with uvicorn until SIGINT/SIGTERM, then drain: the requests in flight get up
    to ``drain_timeout`` seconds while new ones get 503 (docs/deploy.md)."""
    try:
        import uvicorn  # noqa: F401
    except ImportError as error:
        raise ImportError(f"serving the gateway needs uvicorn: {INSTALL_HINT}") from error
    _app_module().run_app(app, host=host, port=port, log_level=log_level, drain_timeout=drain_timeout)
