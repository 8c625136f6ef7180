"""The per-step position rewrite in vLLM's model runner (``GPUModelRunner._prepare_inputs``).

After vLLM filled the positions tensor with contiguous indices, planned requests get their
original positions; the slot mapping (KV placement) was already computed from the contiguous
indices and stays so. Each runner parses a request's plan once, into host arrays, and rewrites
the whole batch with one scatter-add per step (docs/vllm.md, "Per-step cost").
``SpecPrefillWorkerExtension`` lets a frontend register the plugin in, and check, every worker.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch

from ..errors import PlanError
from ..wire import NEXT_POSITION_KEY, POSITIONS_KEY, parse_plan

__all__ = [
    "PATCHES", "RUNNER_MODULE", "WORKER_EXTENSION", "RequestPlan", "SpecPrefillWorkerExtension", "add_offsets",
    "planned_offsets", "remap_positions", "request_plan", "runner_patched", "wrap_prepare_inputs",
]

logger = logging.getLogger(__name__)

MARK = "__specprefill_wrapped__"  # set on every function the plugin wraps
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"


def remap_positions(slots: torch.Tensor, kept: torch.Tensor, next_position: int) -> torch.Tensor:
    """Original positions for vLLM's contiguous slot indices of one request.

    slots: (n,) int64 indices into the request's sequence; kept: (k,) int64 prompt positions.
    Slot i < k → kept[i]; slot i >= k (generated tokens) → next_position + (i - k).
    """
    k = kept.numel()
    prompt = kept[slots.clamp(max=k - 1)]  # (n,)
    return torch.where(slots < k, prompt, slots + (next_position - k))


def planned_offsets(
    starts: np.ndarray,
    counts: np.ndarray,
    computed: np.ndarray,
    kept: Sequence[np.ndarray],
    lengths: np.ndarray,
    next_positions: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """What to add to vLLM's contiguous positions so that planned requests see their original ones.

    One entry per planned request (row), all int64: starts (p,) its first token in the batch,
    counts (p,) its tokens this step, computed (p,) its first slot this step, kept[j] (k_j,) its
    prompt positions, lengths (p,) the k_j, next_positions (p,). Returns (index, offsets), both
    (t,) int64, t = counts.sum(): slot + offset is ``remap_positions`` of that slot. Array
    operations for the whole batch, plus one slice per request still in its prompt (a prefill
    chunk, a recompute after preemption).
    """
    shifts = next_positions - lengths  # generated slot i: next_position + (i - k)
    prompt_rows = np.flatnonzero(computed < lengths)
    if counts.size and not prompt_rows.size and counts.min() == counts.max() == 1:  # decode
        return starts, shifts
    total = int(counts.sum())
    local = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)  # (t,)
    index = np.repeat(starts, counts) + local
    offsets = np.repeat(shifts, counts)
    if prompt_rows.size:  # prompt slot i: kept[i]
        slots = np.repeat(computed, counts) + local
        in_prompt = slots < np.repeat(lengths, counts)  # each row's prompt slots come first, rows in order
        ends = np.minimum(computed + counts, lengths)
        pieces = [kept[j][a:b] for j, a, b in zip(prompt_rows.tolist(), computed[prompt_rows].tolist(),
                                                  ends[prompt_rows].tolist(), strict=True)]
        offsets[in_prompt] = np.concatenate(pieces) - slots[in_prompt]
    return index, offsets


@dataclass(frozen=True, eq=False)  # compared by identity
class RequestPlan:
    """A request's plan as the runners apply it (``request_plan``)."""

    kept: np.ndarray  # (k,) int64 original positions of the prompt slots, on the host
    next_position: int  # position of generated slot k


@dataclass(frozen=True)
class _Layout:
    """Which rows of the current batch carry a plan; rebuilt only when the batch changes."""

    req_ids: list[str]  # the batch's request ids, row order
    rows: np.ndarray  # (p,) int64 rows of planned requests
    kept: list[np.ndarray]  # per planned row: its kept positions
    lengths: np.ndarray  # (p,) int64 prompt lengths
    next_positions: np.ndarray  # (p,) int64
    bounds_rows: np.ndarray  # (2p,) entries of query_start_loc to read: each row's start, then its end


def _layout(req_ids: list[str], rows: list[int], plans: list[RequestPlan]) -> _Layout:
    kept = [plan.kept for plan in plans]
    planned = np.array(rows, dtype=np.int64)
    return _Layout(list(req_ids), planned, kept, np.fromiter(map(len, kept), dtype=np.int64, count=len(kept)),
                   np.fromiter((plan.next_position for plan in plans), dtype=np.int64, count=len(plans)),
                   np.concatenate([planned, planned + 1]))


@dataclass(frozen=True)
class _DecodeStep:
    """The last step's rewrite when every planned row decoded: the same rows at the same batch
    offsets need the same offsets again (a generated slot's offset is constant)."""

    bounds: np.ndarray  # (2p,) query_start_loc at the planned rows
    index: Any  # (p,) on the positions' device (numpy on CPU)
    offsets: Any  # (p,)


_UNSEEN = object()


class _RunnerPlans:
    """One model runner's plans, parsed once per request on the host, and its per-step rewrite.

    ``plans`` maps request id → plan (None: nothing to rewrite: no plan, a contiguous plan, or a
    plan that does not fit the request, logged once). An entry is dropped when vLLM finishes the
    request or sends it again in ``scheduled_new_reqs`` (a new request under a reused id, a
    streaming-input update: the only ways vLLM 0.32 replaces a request's params or prompt in the
    runner), so it is parsed afresh against the new ``extra_args`` and prompt length.

    Per step, the offsets of all planned tokens are computed on the host as arrays and added to
    the positions with one scatter-add (on CUDA after one pinned, non-blocking host→device copy).
    A pure-decode step on an unchanged batch reuses the previous step's device arrays: no copy.
    The pinned buffer is reused across steps like vLLM's own input buffers: under async
    scheduling ``execute_model`` waits on ``prepare_inputs_event`` before preparing the next step.
    """

    def __init__(self) -> None:
        self.plans: dict[str, RequestPlan | None] = {}
        self.layout = _layout([], [], [])
        self.decode: _DecodeStep | None = None
        self.staging: torch.Tensor | None = None  # pinned host buffer (CUDA only)

    def rewrite(self, runner: Any, scheduler_output: Any) -> None:
        finished = scheduler_output.finished_req_ids
        resent = scheduler_output.scheduled_new_reqs
        for req_id in finished:
            self.plans.pop(req_id, None)
        for data in resent:
            self.plans.pop(data.req_id, None)
        batch = runner.input_batch
        req_ids = batch.req_ids[: batch.num_reqs]
        if finished or resent or req_ids != self.layout.req_ids:
            self._relayout(runner, req_ids)
        layout = self.layout
        if not layout.rows.size:
            return
        bounds = runner.query_start_loc.np[layout.bounds_rows]
        computed = batch.num_computed_tokens_cpu[layout.rows]
        decode = self.decode
        if decode is not None and (bounds == decode.bounds).all() and (computed >= layout.lengths).all():
            add_offsets(runner.positions, decode.index, decode.offsets)
            return
        p = layout.rows.size
        starts = bounds[:p].astype(np.int64)
        counts = bounds[p:] - starts
        computed = computed.astype(np.int64)
        index, offsets = planned_offsets(starts, counts, computed, layout.kept, layout.lengths,
                                         layout.next_positions)
        index, offsets = self._to_device(runner.positions.device, index, offsets)
        add_offsets(runner.positions, index, offsets)
        pure_decode = (counts == 1).all() and (computed >= layout.lengths).all()
        self.decode = _DecodeStep(bounds, index, offsets) if pure_decode else None

    def _relayout(self, runner: Any, req_ids: list[str]) -> None:
        if len(self.plans) > 4 * max(1, len(runner.requests)) + 64:  # finished in steps we did not see
            self.plans = {r: p for r, p in self.plans.items() if r in runner.requests}
        plans = [self.plans.get(req_id, _UNSEEN) for req_id in req_ids]
        if _UNSEEN in plans:
            for row, req_id in enumerate(req_ids):
                if plans[row] is _UNSEEN:
                    plans[row] = self.plans[req_id] = _parse_request_plan(runner, req_id)
        rows = [row for row, plan in enumerate(plans) if plan is not None]
        self.layout = _layout(req_ids, rows, [plans[row] for row in rows])  # type: ignore[misc]
        self.decode = None

    def _to_device(self, device: torch.device, index: np.ndarray, offsets: np.ndarray) -> tuple[Any, Any]:
        if device.type == "cpu":
            return index, offsets
        n = index.size
        if self.staging is None or self.staging.numel() < 2 * n:
            self.staging = torch.empty(1 << (2 * n - 1).bit_length(), dtype=torch.int64, pin_memory=True)
        host = self.staging[: 2 * n]
        host_np = host.numpy()
        host_np[:n] = index
        host_np[n:] = offsets
        both = host.to(device, non_blocking=True)
        return both[:n], both[n:]


def add_offsets(positions: torch.Tensor, index: Any, offsets: Any) -> None:
    """positions[index] += offsets (indices unique): numpy on CPU, one kernel on a device."""
    if isinstance(index, np.ndarray):
        positions.numpy()[index] += offsets
    else:
        positions.index_add_(0, index, offsets)


def _parse_request_plan(runner: Any, req_id: str) -> RequestPlan | None:
    """The plan of a request in the runner's batch, checked against the runner's own state."""
    state = runner.requests.get(req_id)
    return request_plan(req_id, getattr(getattr(state, "sampling_params", None), "extra_args", None),
                        _prompt_len(state))


def request_plan(req_id: str, extra: Any, prompt_len: int) -> RequestPlan | None:
    """A request's plan (its ``sampling_params.extra_args``) checked against its prompt length.

    A well-formed plan is checked with array operations (a list of ints, sorted, unique, >= 0,
    one per prompt token, below ``next_position``); anything else goes through ``parse_plan``.
    process_inputs already refused malformed plans, so this only guards the engine: an error is
    logged once and the request keeps contiguous positions. None: nothing to rewrite.
    """
    if not extra or POSITIONS_KEY not in extra:
        return None
    kept, next_position = _int_array(extra[POSITIONS_KEY]), extra.get(NEXT_POSITION_KEY)
    if (kept is None or type(next_position) is not int or kept.size != prompt_len or kept[0] < 0
            or next_position <= kept[-1] or not (kept[1:] > kept[:-1]).all()):
        try:
            parsed = parse_plan(extra, prompt_len=prompt_len, max_tokens=None, max_len=1 << 62)
        except PlanError as error:
            logger.error("SpecPrefill plan of request %s not applied, its positions stay contiguous: %s",
                         req_id, error)
            return None
        if parsed is None or not parsed.positions:
            return None
        kept, next_position = np.array(parsed.positions, dtype=np.int64), parsed.next_position
    if next_position == kept.size and kept[-1] == kept.size - 1:
        return None  # contiguous (sorted, unique, from 0): what vLLM does anyway
    return RequestPlan(kept, next_position)


def _int_array(values: Any) -> np.ndarray | None:
    """A non-empty list of integers as (n,) int64; None for anything else (floats, strings,
    nested lists, ints beyond int64). numpy's conversion: a bool among ints counts as 0 or 1."""
    if type(values) not in (list, tuple) or not values:
        return None
    try:
        array = np.array(values)
    except (TypeError, ValueError, OverflowError):
        return None
    return array.astype(np.int64, copy=False) if array.ndim == 1 and array.dtype.kind == "i" else None


def _prompt_len(state: Any) -> int:
    """Prompt tokens of a runner's request state (``CachedRequestState.num_prompt_tokens``)."""
    n = getattr(state, "num_prompt_tokens", None)
    return int(n) if isinstance(n, int) else len(getattr(state, "prompt_token_ids", None) or ())


def wrap_prepare_inputs(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _prepare_inputs(self: Any, scheduler_output: Any, num_scheduled_tokens: Any) -> Any:
        result = original(self, scheduler_output, num_scheduled_tokens)
        plans = self.__dict__.get("_specprefill_plans")
        if plans is None:
            plans = self.__dict__.setdefault("_specprefill_plans", _RunnerPlans())
        plans.rewrite(self, scheduler_output)
        return result

    setattr(_prepare_inputs, MARK, True)
    return _prepare_inputs


def runner_patched(worker: Any) -> bool:
    """Whether a vLLM worker's model runner rewrites positions: its class has the wrapped
    ``_prepare_inputs`` (V1) or ``prepare_attn`` (V2, ``runner_v2``). Runs inside the worker,
    through ``collective_rpc``."""
    kind = type(getattr(worker, "model_runner", None))
    return any(getattr(getattr(kind, name, None), MARK, False) for name in ("_prepare_inputs", "prepare_attn"))


class SpecPrefillWorkerExtension:
    """vLLM ``worker_extension_cls``: lets the frontend register the plugin in every worker.

    vLLM mixes this class into its worker class in each worker process (the offline backend
    starts ``vllm.LLM`` with it), so ``collective_rpc("specprefill_register")`` reaches every
    worker without the entry point or cloudpickled functions.
    """

    def init_worker_extension(self) -> None:
        """vLLM 0.33 calls this in each worker after device init (0.32 does not): register early.
        ``ensure_plugin`` still checks every worker through ``specprefill_register``."""
        from . import register

        register()

    def specprefill_register(self) -> bool:
        """Register the plugin in this worker's process; True when its runner is patched."""
        from . import register

        register()
        return runner_patched(self)

    def specprefill_runner_patched(self) -> bool:
        """Whether this worker's runner is patched, without registering anything."""
        return runner_patched(self)


WORKER_EXTENSION = f"{__name__}.{SpecPrefillWorkerExtension.__qualname__}"


def _patch_runner(module: ModuleType) -> None:
    runner = module.GPUModelRunner
    original = runner._prepare_inputs
    if getattr(original, MARK, False):
        return
    params = list(original.__code__.co_varnames[: original.__code__.co_argcount])
    if params != ["self", "scheduler_output", "num_scheduled_tokens"]:
        raise RuntimeError(
            f"specprefill-rag: GPUModelRunner._prepare_inputs{tuple(params)} is not the shape this "
            "plugin was written for (vLLM 0.32); refusing to patch"
        )
    from vllm.v1.core.sched.output import SchedulerOutput

    missing = {"finished_req_ids", "scheduled_new_reqs"} - {f.name for f in dataclasses.fields(SchedulerOutput)}
    if missing:
        raise RuntimeError(
            f"specprefill-rag: vLLM's SchedulerOutput has no {sorted(missing)}, which this plugin (written for "
            "vLLM 0.32) reads to keep its plans current; refusing to patch"
        )
    runner._prepare_inputs = wrap_prepare_inputs(original)


# vLLM module → the patch applied to it once vLLM imports it (``vllm_plugin.apply_patches``).
PATCHES: dict[str, Callable[[ModuleType], None]] = {RUNNER_MODULE: _patch_runner}
