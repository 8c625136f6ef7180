"""Frozen, validated configuration: one small object per concern.

``SpecPrefillConfig`` bundles the draft, selection and generation settings an engine uses;
every per-request override is a ``dataclasses.replace`` of one of these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

LayerChoice = Literal["all", "upper_half"]
PositionMode = Literal["original", "contiguous"]
TokenizerMapping = Literal["auto", "same", "offsets"]

__all__ = [
    "DraftConfig",
    "GenerationConfig",
    "LayerChoice",
    "PositionMode",
    "SelectionConfig",
    "SpecPrefillConfig",
    "TokenizerMapping",
]


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True)
class DraftConfig:
    """How the draft model scores prompt tokens."""

    lookahead: int = 8  # L: queries of the last prompt token + (L - 1) greedy draft tokens
    pool_kernel: int = 13  # tokens; odd width of the average pool along the prompt
    layers: LayerChoice | tuple[int, ...] = "all"  # draft layers whose attention is aggregated
    # How draft scores reach the main model's tokens: "same" demands the main tokenizer (scores
    # are read index by index); "offsets" renders the prompt with the draft's own tokenizer and
    # maps scores through character offsets (any draft family); "auto" = "same" when the
    # tokenizers are identical, else "offsets".
    tokenizer_mapping: TokenizerMapping = "auto"

    def __post_init__(self) -> None:
        _check(self.lookahead >= 1, f"lookahead must be >= 1, got {self.lookahead}")
        _check(
            self.pool_kernel >= 1 and self.pool_kernel % 2 == 1,
            f"pool_kernel must be a positive odd number of tokens, got {self.pool_kernel}",
        )
        if isinstance(self.layers, tuple):
            _check(len(self.layers) > 0, "layers must name at least one layer index")
            _check(all(i >= 0 for i in self.layers), f"layer indices must be >= 0: {self.layers}")
        else:
            _check(
                self.layers in ("all", "upper_half"),
                f"layers must be 'all', 'upper_half' or a tuple of indices, got {self.layers!r}",
            )
        _check(
            self.tokenizer_mapping in ("auto", "same", "offsets"),
            f"tokenizer_mapping must be 'auto', 'same' or 'offsets', got {self.tokenizer_mapping!r}",
        )


@dataclass(frozen=True)
class SelectionConfig:
    """Which prompt tokens the main model prefills.

    The budget is over the WHOLE prompt: ``keep_rate`` of its tokens (or ``token_budget``
    tokens), protected tokens included. Protected tokens are always kept even past the
    budget; the rest of the budget goes to the best-scoring chunks of prunable segments,
    rounded up to whole chunks.
    """

    keep_rate: float = 0.2  # fraction of prompt tokens prefilled, in (0, 1]
    token_budget: int | None = None  # tokens prefilled; overrides keep_rate when set
    min_keep_tokens: int = 0  # tokens; lower clamp on the budget
    max_keep_tokens: int | None = None  # tokens; upper clamp on the budget (protected still kept)
    chunk_size: int = 32  # tokens per chunk; chunks never cross a segment boundary
    min_prompt_tokens: int = 256  # tokens; shorter prompts skip speculation (full prefill)
    protect_instructions: bool = True  # never prune the system instructions
    protect_tail_tokens: int = 8  # tokens at the end of the prompt always kept
    positions: PositionMode = "original"  # "contiguous" re-indexes kept tokens (ablation only)

    def __post_init__(self) -> None:
        _check(
            isinstance(self.keep_rate, (int, float))
            and math.isfinite(self.keep_rate)
            and 0.0 < self.keep_rate <= 1.0,
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
        _check(self.chunk_size >= 1, f"chunk_size must be >= 1, got {self.chunk_size}")
        _check(self.min_prompt_tokens >= 0, "min_prompt_tokens must be >= 0")
        _check(self.protect_tail_tokens >= 0, "protect_tail_tokens must be >= 0")
        _check(
            self.positions in ("original", "contiguous"),
            f"positions must be 'original' or 'contiguous', got {self.positions!r}",
        )

    def budget(self, n_prompt: int) -> int:
        """Tokens to prefill for a prompt of ``n_prompt`` tokens (before protected spans)."""
        if self.token_budget is not None:
            budget = self.token_budget
        else:
            budget = math.ceil(self.keep_rate * n_prompt)
        budget = max(budget, self.min_keep_tokens)
        if self.max_keep_tokens is not None:
            budget = min(budget, self.max_keep_tokens)
        return min(budget, n_prompt)


@dataclass(frozen=True)
class GenerationConfig:
    """Decoding settings for the main model."""

    max_new_tokens: int = 256  # tokens
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus sampling mass, in (0, 1]
    top_k: int = 0  # 0 = no top-k filter
    seed: int | None = None  # sampling seed; None = nondeterministic
    stop: tuple[str, ...] = ()  # stop strings; the text is cut before the first match

    def __post_init__(self) -> None:
        _check(self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        _check(
            math.isfinite(self.temperature) and self.temperature >= 0.0,
            f"temperature must be >= 0, got {self.temperature}",
        )
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}")
        _check(
            isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop),
            "stop must be a tuple of non-empty strings",
        )


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
