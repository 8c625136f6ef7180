"""Position-aware prefix-cache block hashes for planned requests (vLLM's ``kv_cache_utils``).

vLLM hashes a KV block from its parent block's hash, its token ids and the block's *extra keys*
(``generate_block_hash_extra_keys``: LoRA, multimodal, prompt embeddings, and ``cache_salt`` on the
first block only). A block's KV depends on the positions of its tokens and of every token before
it as well, which vLLM takes to be their indices. The plugin wraps that one function:

- for a request without a plan, nothing changes;
- for a planned request, a block all of whose tokens and all earlier tokens sit at their own
  index (before the plan's first gap) gets exactly the extra keys vLLM gives it without a plan,
  so it is shared with full requests and with other planned requests of the same prefix (a
  protected system prompt);
- from the block holding the first gap on, the extra keys also carry
  ``("specprefill_positions", (p_start, ..., p_end-1))``, the positions of the block's tokens
  (prompt slots from the plan, generated slots ``next_position + t``). Chained through the parent
  hash, a block is reused only when every earlier token and position is equal.

The plan's own salt, which admission appends to ``cache_salt``, is replaced by the caller's salt
again (tenants keep their isolation); the salt stays on the request, so an engine whose block
hasher this module did not wrap (a vLLM whose function does not have the expected shape) still
isolates each plan and never reuses KV at wrong positions. Docs: docs/vllm.md, "Prefix cache".
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ..wire import NEXT_POSITION_KEY, POSITIONS_KEY, plan_salt
from .runner import MARK

__all__ = [
    "BLOCK_POOL_MODULE", "KV_CACHE_UTILS_MODULE", "OFFLOAD_MODULE", "PATCHES", "POSITIONS_TAG", "HashPlan",
    "hash_plan", "planned_extra_keys",
]

logger = logging.getLogger(__name__)

KV_CACHE_UTILS_MODULE = "vllm.v1.core.kv_cache_utils"
# Modules that import ``generate_block_hash_extra_keys`` by name (KV events, CPU offload metadata).
BLOCK_POOL_MODULE = "vllm.v1.core.block_pool"
OFFLOAD_MODULE = "vllm.v1.simple_kv_offload.manager"
_FUNCTION = "generate_block_hash_extra_keys"
_PARAMS = ["request", "start_token_idx", "end_token_idx", "start_mm_idx"]
POSITIONS_TAG = "specprefill_positions"  # the extra key's tag; vLLM's own tags: lora, mm, cache_salt, ...
_SALT_KEY = "cache_salt"
_ATTR = "_specprefill_hash_plan"  # the parsed plan, cached on vLLM's Request
_UNSET = object()


@dataclass(frozen=True)
class HashPlan:
    """What the block hasher needs of a request's plan."""

    positions: Sequence[int]  # one per prompt slot
    next_position: int  # position of generated slot len(positions)
    first_gap: int | None  # first slot whose position is not its index (None: none, a stock request)
    salt: str | None  # the caller's own cache_salt, without the plan's

    def position(self, slot: int) -> int:
        k = len(self.positions)
        return int(self.positions[slot]) if slot < k else self.next_position + slot - k


def _first_gap(positions: Sequence[int], next_position: int) -> int | None:
    for i, p in enumerate(positions):
        if p != i:
            return i
    return None if next_position == len(positions) else len(positions)


def _caller_salt(salt: str | None, plan: str) -> str | None:
    """The request's ``cache_salt`` without the plan's salt that admission appended."""
    if salt is None or salt == plan:
        return None
    suffix = f"-{plan}"
    return salt[: -len(suffix)] if salt.endswith(suffix) else salt


def hash_plan(request: Any) -> HashPlan | None:
    """The request's plan as the hasher reads it (parsed once, cached on the request); None when
    the request carries none. Admission validated the plan before the request reached the engine.

    A streaming-input session (``request.resumable``) gets None too: vLLM hashes the blocks of an
    input chunk before it swaps in the chunk's sampling params (and plan), so its hashes keep
    admission's per-plan salt and share nothing, as before this module."""
    cached = getattr(request, _ATTR, _UNSET)
    if cached is not _UNSET:
        return cached  # type: ignore[return-value]
    extra = getattr(getattr(request, "sampling_params", None), "extra_args", None)
    plan = None
    if extra and POSITIONS_KEY in extra and NEXT_POSITION_KEY in extra and not getattr(request, "resumable", False):
        positions, next_position = extra[POSITIONS_KEY], int(extra[NEXT_POSITION_KEY])
        plan = HashPlan(positions, next_position, _first_gap(positions, next_position),
                        _caller_salt(getattr(request, "cache_salt", None), plan_salt(positions, next_position)))
    try:
        setattr(request, _ATTR, plan)
    except AttributeError:  # a Request with __slots__ (not vLLM 0.32/0.33): parsed again next time
        pass
    return plan


def planned_extra_keys(keys: tuple[Any, ...] | None, plan: HashPlan, start: int, end: int) -> tuple[Any, ...] | None:
    """vLLM's extra keys of block ``[start, end)`` made position-aware (module docstring)."""
    out = list(keys or ())
    salted = [i for i, key in enumerate(out) if isinstance(key, tuple) and key[:1] == (_SALT_KEY,)]
    for i in reversed(salted):  # the plan's salt is vLLM's cache_salt key of the first block
        if plan.salt is None:
            del out[i]
        else:
            out[i] = (_SALT_KEY, plan.salt)
    if plan.first_gap is not None and end > plan.first_gap:
        out.append((POSITIONS_TAG, tuple(plan.position(slot) for slot in range(start, end))))
    return tuple(out) or None


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def generate_block_hash_extra_keys(
        request: Any, start_token_idx: int, end_token_idx: int, start_mm_idx: int
    ) -> tuple[tuple[Any, ...] | None, int]:
        keys, mm_idx = original(request, start_token_idx, end_token_idx, start_mm_idx)
        plan = hash_plan(request)
        if plan is None:
            return keys, mm_idx
        return planned_extra_keys(keys, plan, start_token_idx, end_token_idx), mm_idx

    setattr(generate_block_hash_extra_keys, MARK, True)
    return generate_block_hash_extra_keys


def _patch_kv_cache_utils(module: ModuleType) -> None:
    original = getattr(module, _FUNCTION, None)
    if original is None or getattr(original, MARK, False):
        return
    params = list(inspect.signature(original).parameters)
    if params != _PARAMS:
        logger.warning("specprefill-rag: %s.%s%s is not the shape this plugin was written for (vLLM 0.32/0.33); "
                       "planned requests keep one prefix-cache salt per plan and share no cached block",
                       module.__name__, _FUNCTION, tuple(params))
        return
    setattr(module, _FUNCTION, _wrap(original))


def _patch_importer(module: ModuleType) -> None:
    """A module that imported the function by name gets the wrapped one (same keys in KV events)."""
    utils = sys.modules.get(KV_CACHE_UTILS_MODULE)
    wrapped = getattr(utils, _FUNCTION, None)
    if wrapped is not None and getattr(wrapped, MARK, False) and hasattr(module, _FUNCTION):
        setattr(module, _FUNCTION, wrapped)


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    KV_CACHE_UTILS_MODULE: _patch_kv_cache_utils,
    BLOCK_POOL_MODULE: _patch_importer,
    OFFLOAD_MODULE: _patch_importer,
}
