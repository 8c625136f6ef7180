"""Frozen, validated configuration: one small object per concern.

``SpecPrefillConfig`` bundles the draft, selection and generation settings an engine uses;
every per-request override is a ``dataclasses.replace`` of one of these. The draft's own settings
(``ScoringConfig`` + ``DraftRuntime`` = ``DraftConfig``) are in ``config.draft``; the checks every
config applies in ``config.checks``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from .checks import check as _check
from .checks import check_choice, describe_choices
from .checks import check_types as _check_types
from .draft import (
    DraftConfig,
    DraftRuntime,
    LayerChoice,
    LookaheadTokens,
    OverflowPolicy,
    PassageReading,
    RecomputeKind,
    ScoringConfig,
    TokenizerMapping,
)

PositionMode = Literal["original", "contiguous"]
SelectionUnit = Literal["sentence", "chunk"]

__all__ = [
    "GREEDY_BELOW",
    "DraftConfig",
    "DraftRuntime",
    "GenerationConfig",
    "LayerChoice",
    "LookaheadTokens",
    "OverflowPolicy",
    "PassageReading",
    "PositionMode",
    "RecomputeKind",
    "SelectionConfig",
    "ScoringConfig",
    "SelectionUnit",
    "SpecPrefillConfig",
    "TokenizerMapping",
    "check_choice",
    "describe_choices",
]


# Temperatures below this decode greedily, in every backend: vLLM's rule (its _SAMPLING_EPS), and
# dividing logits by less overflows float32 into inf/nan probabilities.
GREEDY_BELOW = 1e-5
_INT64 = (-(1 << 63), (1 << 63) - 1)  # the range of a seed: OpenAI's and vLLM's int64



@dataclass(frozen=True)
class SelectionConfig:
    """Which prompt tokens the main model prefills.

    The budget is over the CONTEXT, the prunable tokens (retrieved passages, chat history):
    ``keep_rate`` of them (or ``token_budget`` of them). Protected tokens (instructions,
    question, template, tail) are always prefilled on top of it. The budget is filled with the
    best-scoring units of the context — whole sentences by default, never crossing a passage —
    best first; the last unit may overshoot the budget. With ``keep_mass`` the budget adapts:
    the smallest set of units holding that share of the draft's score mass over the context,
    with ``keep_rate`` as its ceiling. A prompt with context always keeps at least one unit.
    """

    keep_rate: float = 0.2  # fraction of the context's tokens prefilled, in (0, 1]
    token_budget: int | None = None  # context tokens prefilled; overrides keep_rate when set
    min_keep_tokens: int = 0  # context tokens; lower clamp on the budget
    max_keep_tokens: int | None = None  # context tokens; upper clamp on the budget
    keep_mass: float | None = None  # adaptive budget: share of the context's score mass, in (0, 1]
    unit: SelectionUnit = "sentence"  # what is kept or dropped whole: sentences or fixed chunks
    chunk_size: int = 32  # tokens per chunk (unit="chunk"; also text without sentence ends)
    max_sentence_tokens: int = 64  # tokens; a longer sentence is cut into pieces of this size
    passage_weight: float = 0.0  # in [0, 1]: share of a unit's rank taken from its passage's score
    # In [0, 1]: share of a unit's rank taken from its passage's retriever score (the number in
    # Passage.metadata["score"], higher = more relevant, e.g. a cosine similarity); used only when
    # passages carry one. 0 ignores the retriever. Measured on bench evidence (docs/benchmarks.md).
    retriever_weight: float = 0.25
    min_prompt_tokens: int = 256  # tokens; shorter prompts skip speculation (full prefill)
    protect_instructions: bool = True  # never prune the system instructions
    # Never prune earlier chat turns (history segments): turn k's prompt begins with turn k − 1's
    # conversation, which vLLM's prefix cache holds, so kept whole it costs little to prefill and a
    # plan's first gap comes after it. False lets a long history be pruned (no prefix cache).
    protect_history: bool = True
    protect_tail_tokens: int = 8  # tokens at the end of the prompt always kept
    positions: PositionMode = "original"  # "contiguous" re-indexes kept tokens (ablation only)

    def __post_init__(self) -> None:
        _check_types(
            self,
            ints=(
                "token_budget", "min_keep_tokens", "max_keep_tokens", "chunk_size",
                "max_sentence_tokens", "min_prompt_tokens", "protect_tail_tokens",
            ),
            numbers=("keep_rate", "keep_mass", "passage_weight", "retriever_weight"),
        )
        _check(
            0.0 < self.keep_rate <= 1.0,
            f"keep_rate must be in (0, 1], got {self.keep_rate!r}; "
            "use 1.0 to prefill everything or a token_budget for an absolute size",
        )
        _check(
            self.token_budget is None or self.token_budget >= 1,
            f"token_budget must be >= 1 or None, got {self.token_budget}",
        )
        _check(self.min_keep_tokens >= 0, f"min_keep_tokens must be >= 0, got {self.min_keep_tokens}")
        _check(
            self.max_keep_tokens is None or self.max_keep_tokens >= max(1, self.min_keep_tokens),
            f"max_keep_tokens ({self.max_keep_tokens}) must be >= max(1, min_keep_tokens)",
        )
        _check(
            self.keep_mass is None or 0.0 < self.keep_mass <= 1.0,
            f"keep_mass must be in (0, 1] or None, got {self.keep_mass}",
        )
        check_choice("unit", self.unit, SelectionUnit)
        _check(self.chunk_size >= 1, f"chunk_size must be >= 1, got {self.chunk_size}")
        _check(self.max_sentence_tokens >= 1, f"max_sentence_tokens must be >= 1, got {self.max_sentence_tokens}")
        _check(
            0.0 <= self.passage_weight <= 1.0, f"passage_weight must be in [0, 1], got {self.passage_weight}"
        )
        _check(
            0.0 <= self.retriever_weight <= 1.0,
            f"retriever_weight must be in [0, 1], got {self.retriever_weight}",
        )
        _check(self.min_prompt_tokens >= 0, "min_prompt_tokens must be >= 0")
        _check(self.protect_tail_tokens >= 0, "protect_tail_tokens must be >= 0")
        _check_types(self, bools=("protect_instructions", "protect_history"))
        check_choice("positions", self.positions, PositionMode)

    def budget(self, n_context: int) -> int:
        """Context tokens to prefill out of ``n_context`` prunable ones (protected come on top).

        At least one token whenever there is context: no keep rate leaves the main model with
        the question alone.
        """
        if n_context <= 0:
            return 0
        if self.token_budget is not None:
            budget = self.token_budget
        else:
            budget = math.ceil(self.keep_rate * n_context)
        budget = max(budget, self.min_keep_tokens, 1)
        if self.max_keep_tokens is not None:
            budget = min(budget, self.max_keep_tokens)
        return min(budget, n_context)


@dataclass(frozen=True)
class GenerationConfig:
    """Decoding settings for the main model."""

    max_new_tokens: int = 256  # tokens
    temperature: float = 0.0  # 0 (or below GREEDY_BELOW) = greedy
    top_p: float = 1.0  # nucleus sampling mass, in (0, 1]
    top_k: int = 0  # 0 = no top-k filter
    seed: int | None = None  # sampling seed, a signed 64-bit int; None = nondeterministic
    stop: tuple[str, ...] = ()  # stop strings; the text is cut before the first match
    # Seconds for the whole request (draft, prefill, every token; the backend gets what is left);
    # past it: BackendTimeoutError. None: no deadline.
    timeout: float | None = None
    # The request's cache namespace, vLLM's ``cache_salt`` (forwarded; the engine's caches key on
    # it too): cached work is shared only between requests of the same salt. None: shared.
    cache_salt: str | None = None
    # With tools offered: "auto", "required", "none" or a tool's name; decoded under the calls'
    # grammar where the backend can, checked always. False: at most one call (docs/tools.md).
    tool_choice: str = "auto"
    parallel_tool_calls: bool = True
    # Lark (llguidance's) the answer must match, e.g. ``grammar.json_grammar(schema)``. None: free.
    grammar: str | None = None

    def __post_init__(self) -> None:
        _check(self.grammar is None or (isinstance(self.grammar, str) and self.grammar.strip() != ""), "grammar must "
               f"be a non-empty string (Lark) or None, got {self.grammar!r:.80}")
        _check(isinstance(self.tool_choice, str) and self.tool_choice != "",
               f"tool_choice must be 'auto', 'required', 'none' or a tool's name, got {self.tool_choice!r:.80}")
        _check_types(self, ints=("max_new_tokens", "top_k", "seed"), numbers=("temperature", "top_p", "timeout"),
                     bools=("parallel_tool_calls",))
        _check(self.cache_salt is None or (isinstance(self.cache_salt, str) and self.cache_salt != ""),
               f"cache_salt must be a non-empty string or None, got {self.cache_salt!r:.80}")
        _check(self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        _check(
            math.isfinite(self.temperature) and self.temperature >= 0.0,
            f"temperature must be >= 0, got {self.temperature}",
        )
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}")
        _check(
            self.seed is None or _INT64[0] <= self.seed <= _INT64[1],
            f"seed must be a signed 64-bit integer, in [{_INT64[0]}, {_INT64[1]}], got {self.seed}",
        )
        _check(isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop),
               "stop must be a tuple of non-empty strings")
        _check(
            self.timeout is None or (math.isfinite(self.timeout) and self.timeout > 0),
            f"timeout must be a positive number of seconds or None, got {self.timeout}",
        )

    @property
    def greedy(self) -> bool:
        """Whether decoding takes the most likely token: a temperature below ``GREEDY_BELOW``."""
        return self.temperature < GREEDY_BELOW

    def with_overrides(self, **changes: Any) -> GenerationConfig:
        """A validated copy with ``changes`` applied; ``None`` values are skipped (a per-call
        option the caller did not set), ``stop`` may be any sequence of strings."""
        changes = {k: v for k, v in changes.items() if v is not None}
        if "stop" in changes and not isinstance(changes["stop"], tuple):
            changes["stop"] = tuple(s for s in changes["stop"] if s)
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class SpecPrefillConfig:
    """Everything an engine needs to know besides its models."""

    draft: DraftConfig = field(default_factory=DraftConfig)
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    instructions: str = (
        "Answer the question using only the provided context. "
        "Be concise. If the context does not contain the answer, say so."
    )
