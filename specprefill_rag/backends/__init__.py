"""Main-model backends, found by name.

Backends are imported only when asked for, so optional dependencies (vLLM, an HTTP client)
are needed only by those who use them. Third parties add theirs with ``register_backend``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError
from .base import Backend, BackendCapabilities

__all__ = [
    "Backend",
    "BackendCapabilities",
    "available_backends",
    "create_backend",
    "loads_torch_model",
    "register_backend",
]

# name -> "module:factory" (imported lazily) or a factory callable
_REGISTRY: dict[str, str | Callable[..., Backend]] = {
    "transformers": "specprefill_rag.backends.transformers:TransformersBackend.from_pretrained",
    "vllm_offline": "specprefill_rag.backends.vllm_offline:VLLMOfflineBackend.from_pretrained",
    "vllm_server": "specprefill_rag.backends.vllm_server:VLLMServerBackend.from_pretrained",
}


# Backends whose factory loads a torch model into this process and takes ``dtype`` and ``device``
# keywords, which ``SpecPrefillEngine.from_pretrained`` hands on (the draft's own).
_TORCH_MODELS: set[str] = {"transformers"}


def register_backend(name: str, factory: str | Callable[..., Backend], *, torch_model: bool = False) -> None:
    """Make ``create_backend(name, ...)`` call ``factory`` (a callable or "module:attr").

    ``torch_model``: the factory loads a torch model in this process and takes ``dtype`` and
    ``device`` keywords, which ``SpecPrefillEngine.from_pretrained`` then passes to it.
    """
    _REGISTRY[name] = factory
    if torch_model:
        _TORCH_MODELS.add(name)
    else:
        _TORCH_MODELS.discard(name)


def loads_torch_model(name: str) -> bool:
    """Whether the backend registered as ``name`` takes ``dtype`` and ``device`` (see ``register_backend``)."""
    return name in _TORCH_MODELS


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def _resolve(name: str) -> Callable[..., Backend]:
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ConfigError(
            f"unknown backend {name!r}; available: {', '.join(available_backends())}"
        ) from None
    if callable(factory):
        return factory
    module_name, _, attr = factory.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[no-any-return]


def create_backend(name: str, /, *args: Any, **kwargs: Any) -> Backend:
    """Build the backend registered as ``name``; arguments go to its factory."""
    return _resolve(name)(*args, **kwargs)
