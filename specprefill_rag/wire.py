"""The plan on the wire: how a position plan travels to vLLM, and the rules it must meet.

Shared by our clients (the engine, the vLLM backends) and the vLLM plugin, which imports it and
never the other way round. Pure Python, no vLLM import: the client validates and encodes with the
same code the server validates with. A request carries its plan in ``SamplingParams.extra_args``
(over HTTP: the ``vllm_xargs`` field of ``/v1/completions``)::

    {"specprefill_positions": [0, 1, 2, 40, 41, ...],   # one original position per prompt token
     "specprefill_next_position": 512}                   # position of the first generated token

Prompt slot ``i`` (vLLM's contiguous index) gets position ``positions[i]``; generated token
``t`` (slot ``k + t``, ``k`` = prompt length) gets ``next_position + t``.

The answer carries the plugin's proof that it applied the plan: every JSON object of a planned
``/v1/completions`` response (each streamed chunk, or the whole non-streamed body) has a
``"specprefill_plan"`` field holding ``plan_proof`` of the prompt token ids the server rendered
and the plan it admitted. Stock vLLM accepts ``vllm_xargs`` silently and answers at contiguous
positions, so a client refuses a planned answer without the proof it expects: behind a router, a
replica without the plugin can then never answer wrongly with HTTP 200. The plugin admits a plan
(and so proves it) only once every vLLM worker of the replica has reported the position rewrite
(``vllm_plugin.workers``); until then plans get HTTP 503.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import PlanError
from .types import is_int

__all__ = [
    "INVALID_PLAN",
    "NEXT_POSITION_KEY",
    "POSITIONS_KEY",
    "PROOF_FIELD",
    "PositionPlan",
    "is_contiguous",
    "parse_plan",
    "plan_proof",
    "plan_salt",
    "plan_to_xargs",
]

POSITIONS_KEY = "specprefill_positions"
NEXT_POSITION_KEY = "specprefill_next_position"
# How the plugin words a refused plan (HTTP 400, VLLMValidationError): "<INVALID_PLAN>: <the rule>".
# A client that gets it for an invalid plan knows the plugin is active in the server.
INVALID_PLAN = "invalid SpecPrefill plan in vllm_xargs"
# The response field that carries ``plan_proof`` (module docstring).
PROOF_FIELD = "specprefill_plan"
_SALT_PREFIX = "specprefill-"
_PROOF_PREFIX = "specprefill-proof-"
_SALT_HEX = 32  # hex digits of sha256 kept in the salt (128 bits)


@dataclass(frozen=True)
class PositionPlan:
    """Validated original positions of a request's prompt tokens."""

    positions: tuple[int, ...]  # strictly increasing, one per prompt token
    next_position: int  # position of the first generated token, > positions[-1]

    @property
    def salt(self) -> str:
        return plan_salt(self.positions, self.next_position)


def is_contiguous(positions: Sequence[int], next_position: int) -> bool:
    """True when the plan is what stock vLLM does anyway (0..k-1, then k)."""
    k = len(positions)
    return next_position == k and (k == 0 or (positions[0] == 0 and positions[-1] == k - 1))


def plan_salt(positions: Sequence[int], next_position: int) -> str:
    """Prefix-cache salt for a plan: equal only for equal positions (sha256, 128 bits)."""
    digest = hashlib.sha256()
    digest.update(",".join(map(str, positions)).encode())
    digest.update(f";{next_position}".encode())
    return _SALT_PREFIX + digest.hexdigest()[:_SALT_HEX]


def plan_proof(prompts: Sequence[Sequence[int]], positions: Sequence[int], next_position: int) -> str:
    """What the plugin answers a planned request with: sha256 (128 bits) of the request's prompts
    (token ids, in order; one for our clients) and its plan. Pure ASCII, so it can be spliced into
    JSON unescaped."""
    digest = hashlib.sha256()
    for ids in prompts:
        digest.update(("[" + ",".join(map(str, ids)) + "]").encode())
    digest.update(f"@{','.join(map(str, positions))};{next_position}".encode())
    return _PROOF_PREFIX + digest.hexdigest()[:_SALT_HEX]


def plan_to_xargs(positions: Sequence[int], next_position: int) -> dict[str, Any]:
    """The ``extra_args`` / ``vllm_xargs`` entries for a plan."""
    return {POSITIONS_KEY: [int(p) for p in positions], NEXT_POSITION_KEY: int(next_position)}


def parse_plan(
    extra_args: Mapping[str, Any] | None,
    *,
    prompt_len: int,
    max_tokens: int | None,
    max_len: int,
) -> PositionPlan | None:
    """Validate a request's plan; None when the request carries none (stock vLLM behaviour).

    ``max_len`` is the largest position the model supports plus one (vLLM's ``max_model_len``).
    ``max_tokens`` is the number of tokens the request may generate (None: not checked). Raises
    ``PlanError`` with a message naming the field and the rule it breaks.
    """
    if not extra_args or (POSITIONS_KEY not in extra_args and NEXT_POSITION_KEY not in extra_args):
        return None
    if POSITIONS_KEY not in extra_args or NEXT_POSITION_KEY not in extra_args:
        raise PlanError(f"a SpecPrefill plan needs both {POSITIONS_KEY!r} and {NEXT_POSITION_KEY!r}")
    positions, next_position = extra_args[POSITIONS_KEY], extra_args[NEXT_POSITION_KEY]
    if not isinstance(positions, list | tuple) or not all(is_int(p) for p in positions):
        raise PlanError(f"{POSITIONS_KEY} must be a list of integers, got {_describe(positions)}")
    if not is_int(next_position):
        raise PlanError(f"{NEXT_POSITION_KEY} must be an integer, got {_describe(next_position)}")
    if len(positions) != prompt_len:
        raise PlanError(
            f"{POSITIONS_KEY} has {len(positions)} entries but the prompt has {prompt_len} tokens: "
            "send one original position per prompt token"
        )
    if positions and positions[0] < 0:
        raise PlanError(f"{POSITIONS_KEY} must be >= 0, got {positions[0]}")
    for i in range(1, len(positions)):
        if positions[i] == positions[i - 1]:
            raise PlanError(f"{POSITIONS_KEY} has a duplicate position {positions[i]} (at index {i})")
        if positions[i] < positions[i - 1]:
            raise PlanError(
                f"{POSITIONS_KEY} must be sorted ascending: {positions[i]} follows {positions[i - 1]} "
                f"(at index {i})"
            )
    if positions and next_position <= positions[-1]:
        raise PlanError(
            f"{NEXT_POSITION_KEY} ({next_position}) must be greater than the last prompt position "
            f"({positions[-1]})"
        )
    if next_position < 0:
        raise PlanError(f"{NEXT_POSITION_KEY} must be >= 0, got {next_position}")
    if next_position >= max_len:
        raise PlanError(
            f"{NEXT_POSITION_KEY} ({next_position}) must be below the model's maximum length of "
            f"{max_len} positions: the original prompt leaves no position to generate at; shorten it "
            "(fewer or shorter passages) or start vLLM with a larger --max-model-len"
        )
    if max_tokens is not None and next_position + max_tokens > max_len:
        raise PlanError(
            f"{NEXT_POSITION_KEY} ({next_position}) + max_tokens ({max_tokens}) exceeds the model's "
            f"maximum length of {max_len} positions: lower max_tokens to at most {max_len - next_position}"
        )
    return PositionPlan(tuple(positions), next_position)


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"
