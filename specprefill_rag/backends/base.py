"""The contract every main-model backend meets."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ..config import GenerationConfig
from ..types import PrefillPlan

__all__ = ["Backend", "BackendCapabilities", "BackendError"]


class BackendError(RuntimeError):
    """A backend could not serve a request (server down, bad response, unsupported plan)."""


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend can do; the engine checks these instead of backend types."""

    exact_positions: bool  # prefills kept tokens at their original position ids
    streaming: bool  # yields tokens as they are decoded (TTFT is real)
    native_async: bool  # has its own async path (otherwise the engine uses a thread)


@runtime_checkable
class Backend(Protocol):
    """A main model that prefills a ``PrefillPlan`` and decodes from it."""

    name: str
    capabilities: BackendCapabilities

    @property
    def tokenizer(self) -> Any:
        """The main model's (fast) tokenizer: prompts are assembled with it."""
        ...

    @property
    def max_context(self) -> int:
        """Largest position the main model supports, plus one (its context window)."""
        ...

    @property
    def model_name(self) -> str:
        """A human-readable name of the main model."""
        ...

    def stream_tokens(self, plan: PrefillPlan, generation: GenerationConfig) -> Generator[int, None, None]:
        """Prefill ``plan`` and yield generated token ids, EOS excluded.

        The first id is yielded as soon as it exists (that moment is the TTFT). Stops after
        an end-of-sequence token or ``generation.max_new_tokens`` ids; the caller may close
        the iterator early (stop strings).
        """
        ...
