"""The contract every main-model backend meets, and the rules every backend shares.

The ``Backend`` protocol and ``BackendCapabilities``; ``ModelIdentity`` for the read-only
properties; ``max_new_tokens`` (the generation limit: the configured one, cut at the end of the
window), ``TokenStep`` (a token with its log-probability) and ``checked_xargs`` (a plan's
``vllm_xargs``, validated as the plugin validates them). The ids that end an answer come from
``loading.eos_ids``.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..config import DraftConfig, GenerationConfig
from ..errors import PlanError
from ..types import PrefillPlan
from ..wire import is_contiguous, parse_plan, plan_to_xargs

if TYPE_CHECKING:
    from ..draft import DraftModel

__all__ = [
    "Backend", "BackendCapabilities", "ModelIdentity", "SelfDrafting", "TokenStep", "check_window", "checked_xargs",
    "max_new_tokens",
]


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend can do, declared by the backend.

    The engine reads ``exact_positions``: without it, a plan at original (non-contiguous)
    positions is refused with a ``ConfigError`` instead of being run re-indexed. Without
    ``grammar``, a ``GenerationConfig.grammar`` is refused the same way, and tool calls are only
    checked after decoding.
    """

    exact_positions: bool  # prefills kept tokens at their original position ids
    grammar: bool = False  # decodes under GenerationConfig.grammar (llguidance's Lark)


@dataclass(frozen=True)
class TokenStep:
    """One generated token and, when asked for, its log-probability under the main model."""

    token_id: int
    logprob: float | None


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


@runtime_checkable
class SelfDrafting(Protocol):
    """A backend whose main model can also be the draft: one set of weights in both roles
    (``SpecPrefillEngine.from_pretrained(main, draft=main)``)."""

    def as_draft(self, config: DraftConfig) -> DraftModel:
        """The main model as a ``DraftModel`` with ``config``."""
        ...


class ModelIdentity:
    """The ``Backend`` properties that only report what a backend was built with.

    A backend sets ``_tokenizer``, ``_max_context`` and ``_name`` in its constructor; these
    read-only properties expose them (``tokenizer``, ``max_context``, ``model_name``).
    """

    _tokenizer: Any
    _max_context: int
    _name: str

    @property
    def tokenizer(self) -> Any:
        """The main model's (fast) tokenizer: prompts are assembled with it."""
        return self._tokenizer

    @property
    def max_context(self) -> int:
        """Largest position the main model supports, plus one (its context window)."""
        return self._max_context

    @property
    def model_name(self) -> str:
        """A human-readable name of the main model."""
        return self._name


def check_window(plan: PrefillPlan, window: int) -> None:
    """``PlanError`` unless the plan's prompt ends inside the main model's ``window``."""
    if plan.next_position > window:
        raise PlanError(
            f"plan reaches position {plan.next_position}, beyond the main model's window of {window} tokens"
        )


def max_new_tokens(plan: PrefillPlan, generation: GenerationConfig, window: int) -> int:
    """Tokens to generate: the configured limit, cut at the end of the window (as transformers)."""
    check_window(plan, window)
    return min(generation.max_new_tokens, window - plan.next_position)


def checked_xargs(plan: PrefillPlan, *, max_tokens: int, window: int, model: str) -> dict[str, Any] | None:
    """The plugin's ``vllm_xargs`` for ``plan`` (None when its positions are contiguous), after the
    same validation the plugin applies on the server; ``PlanError`` says what is wrong."""
    if plan.n_kept == 0:
        raise PlanError("the plan keeps no tokens")
    positions = plan.position_ids.tolist()
    xargs = plan_to_xargs(positions, plan.next_position)
    try:
        parse_plan(xargs, prompt_len=plan.n_kept, max_tokens=max_tokens, max_len=window)
    except PlanError as error:
        raise PlanError(f"invalid prefill plan for {model}: {error}") from None
    return None if is_contiguous(positions, plan.next_position) else xargs
