"""What one look-ahead runs: its length, its tokens, the layers recorded, early exit, guesses.

``LookaheadSpec`` bundles the settings that travel together from ``DraftModel.capture_batch``
through the look-ahead drivers (``lookahead``) down to ``early_exit.upper_greedy``. It is built
from a ``DraftConfig`` in one place (``LookaheadSpec.from_config``); a capture with no spec runs
the draft's own config's look-ahead over every layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..config import DraftConfig, LookaheadTokens, PassageReading, check_choice
from ..errors import ConfigError

__all__ = ["LookaheadSpec"]

_DEFAULT = DraftConfig()


@dataclass(frozen=True)
class LookaheadSpec:
    """One look-ahead's settings (the ``DraftConfig`` fields of the same meaning, resolved for a
    call): which ``lookahead - 1`` tokens follow the prompt, which layers record their queries,
    and how the draft finds those tokens cheaply (early exit, verified guesses, CUDA graphs)."""

    # L: query rows of the last prompt token + (L - 1) look-ahead tokens (``DraftConfig.lookahead``).
    lookahead: int = _DEFAULT.lookahead
    tokens: LookaheadTokens = _DEFAULT.lookahead_tokens  # "greedy" steps or "siblings"
    # Draft layers whose queries and keys are recorded; None: every layer. The last look-ahead
    # forward stops after the highest of them.
    layers: Sequence[int] | None = None
    # The prompt's forward stops after the highest recorded layer too; the upper layers read the
    # ``upper_keep`` share of the prompt to choose the look-ahead tokens (``early_exit``).
    early_exit: bool = False
    upper_keep: float = _DEFAULT.upper_keep  # share of the prompt's tokens, in (0, 1]
    # Guessed tokens verified per greedy forward after an early exit; None (auto): what
    # ``DraftConfig.guesses_on`` gives on the draft's device (``DraftModel`` resolves it).
    guesses: int | None = _DEFAULT.lookahead_guesses
    stop_at_eos: bool = _DEFAULT.lookahead_stop_at_eos  # greedy tokens end with the draft's answer
    graphs: bool = True  # replay the look-ahead's CUDA graphs where captured (False: eager)
    # Read passages apart (``passage_reading``) where the prompt's layout is given; None: jointly.
    passages: PassageReading | None = None

    def __post_init__(self) -> None:
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(int(i) for i in self.layers))
        if self.lookahead < 1:
            raise ConfigError(f"lookahead must be >= 1, got {self.lookahead}")
        if not 0.0 < self.upper_keep <= 1.0:
            raise ConfigError(f"upper_keep must be in (0, 1], got {self.upper_keep}")
        if self.guesses is not None and self.guesses < 0:
            raise ConfigError(f"guesses must be >= 0 or None (auto), got {self.guesses}")
        check_choice("tokens", self.tokens, LookaheadTokens)

    @classmethod
    def from_config(cls, config: DraftConfig, *, lookahead: int | None = None, n_layers: int | None = None
                    ) -> LookaheadSpec:
        """``config``'s look-ahead, of ``lookahead`` queries (default ``config.lookahead``; a
        batch runs its prompts' longest, ``DraftConfig.lookahead_for``). ``n_layers`` (the
        draft's depth): record ``config``'s aggregated layers, exiting early where it says (what
        scoring runs); None: record every layer over full forwards."""
        every = n_layers is None
        return cls(
            lookahead=config.lookahead if lookahead is None else lookahead,
            tokens=config.lookahead_tokens,
            layers=None if n_layers is None else config.layer_indices(n_layers),
            early_exit=False if every else config.early_exit,
            upper_keep=config.upper_keep,
            guesses=config.lookahead_guesses,
            stop_at_eos=config.lookahead_stop_at_eos,
            graphs=config.cuda_graphs,
            passages=config.passages,
        )

    @property
    def steps(self) -> int:
        """Look-ahead tokens after the prompt: ``lookahead - 1``."""
        return self.lookahead - 1

    def recorded(self) -> frozenset[int] | None:
        """The layers recorded (None: every one)."""
        return None if self.layers is None else frozenset(self.layers)

    def top(self, n_layers: int) -> int:
        """The highest recorded layer of a draft of ``n_layers`` layers: where the last look-ahead
        forward stops, and with early exit the prompt's forward too."""
        return max(self.layers) if self.layers else n_layers - 1
