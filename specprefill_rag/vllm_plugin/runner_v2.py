"""The position rewrite in vLLM's V2 model runner (``vllm.v1.worker.gpu.model_runner.GPUModelRunner``).

V2 differs from V1 in the one thing the rewrite depends on: it computes the KV slot mapping
*from the positions tensor* (``prepare_attn`` → ``BlockTables.compute_slot_mappings``), after
``prepare_inputs`` filled it with contiguous indices (the Triton kernel ``prepare_pos_seq_lens``).
So the rewrite runs right after ``prepare_attn``: the slot mapping (where each token's KV goes)
is computed from the contiguous positions, as in V1, and the model's rotary embedding, which
reads the same persistent buffer (``input_buffers.positions``, also what a captured CUDA graph
reads), gets the plan's. Kernels run on one stream, so the scatter-add is ordered after the
slot-mapping kernel.

V2 keeps no sampling params on the runner, so plans are parsed from ``scheduled_new_reqs`` as
``add_requests`` admits them (``runner.request_plan``: the same checks as V1) and dropped in
``_remove_request`` (finished, preempted and re-sent requests all pass through it; a preempted
request comes back as a new one). The per-step arithmetic is V1's (``runner.planned_offsets``).
Batch rows are reordered every step in V2, so the planned rows are found per step (nothing to do
when no request in flight has a plan).

Not handled here, refused at admission instead (``admission.plan_refusal``): speculative
decoding, M-RoPE, prefill context parallelism (``pcp_manager`` partitions the batch before the
slot mapping), and models that read positions themselves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import torch

from .runner import MARK, RequestPlan, _layout, add_offsets, planned_offsets, request_plan

__all__ = ["PATCHES", "RUNNER_V2_MODULE", "V2Plans", "patch_runner_v2", "runner_plans"]

RUNNER_V2_MODULE = "vllm.v1.worker.gpu.model_runner"
_ATTR = "_specprefill_v2_plans"


class V2Plans:
    """One V2 runner's plans by request id, and the rewrite of a step's positions."""

    def __init__(self) -> None:
        self.plans: dict[str, RequestPlan] = {}

    def admit(self, new_reqs: Any) -> None:
        """Parse the plans of ``scheduler_output.scheduled_new_reqs`` (``NewRequestData``)."""
        for data in new_reqs:
            extra = getattr(getattr(data, "sampling_params", None), "extra_args", None)
            plan = request_plan(data.req_id, extra, int(data.prompt_len))
            if plan is not None:
                self.plans[data.req_id] = plan

    def drop(self, req_id: str) -> None:
        self.plans.pop(req_id, None)

    def rewrite(self, input_batch: Any) -> None:
        """Add each planned token's offset to ``input_batch.positions`` (the batch's slice of the
        runner's persistent positions buffer), from the step's host arrays."""
        if not self.plans:
            return
        req_ids = input_batch.req_ids
        rows = [row for row, req_id in enumerate(req_ids) if req_id in self.plans]
        if not rows:
            return
        layout = _layout(req_ids, rows, [self.plans[req_ids[row]] for row in rows])
        bounds = np.asarray(input_batch.query_start_loc_np, dtype=np.int64)[layout.bounds_rows]
        starts, counts = bounds[: len(rows)], bounds[len(rows) :] - bounds[: len(rows)]
        computed = np.asarray(input_batch.num_computed_tokens_np, dtype=np.int64)[layout.rows]
        index, offsets = planned_offsets(starts, counts, computed, layout.kept, layout.lengths,
                                         layout.next_positions)
        positions = input_batch.positions
        if positions.device.type == "cpu":
            add_offsets(positions, index, offsets)
            return
        # A fresh pinned tensor per step (as V2 copies its own host arrays): V2 has no event that
        # says when the previous step's copy finished, so a reused buffer could be overwritten.
        both = torch.from_numpy(np.concatenate([index, offsets])).pin_memory().to(positions.device,
                                                                                 non_blocking=True)
        add_offsets(positions, both[: index.size], both[index.size :])


def runner_plans(runner: Any) -> V2Plans:
    plans = runner.__dict__.get(_ATTR)
    if plans is None:
        plans = runner.__dict__.setdefault(_ATTR, V2Plans())
    return plans


def _wrap_add_requests(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def add_requests(self: Any, scheduler_output: Any) -> Any:
        result = original(self, scheduler_output)
        runner_plans(self).admit(scheduler_output.scheduled_new_reqs)
        return result

    setattr(add_requests, MARK, True)
    return add_requests


def _wrap_remove_request(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _remove_request(self: Any, req_id: str) -> Any:
        runner_plans(self).drop(req_id)
        return original(self, req_id)

    setattr(_remove_request, MARK, True)
    return _remove_request


def _wrap_prepare_attn(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def prepare_attn(self: Any, input_batch: Any) -> Any:
        result = original(self, input_batch)  # the slot mapping, from the contiguous positions
        runner_plans(self).rewrite(input_batch)
        return result

    setattr(prepare_attn, MARK, True)
    return prepare_attn


# method → (the parameters it must have, its wrapper)
_WRAPPED: dict[str, tuple[list[str], Callable[[Callable[..., Any]], Callable[..., Any]]]] = {
    "add_requests": (["self", "scheduler_output"], _wrap_add_requests),
    "_remove_request": (["self", "req_id"], _wrap_remove_request),
    "prepare_attn": (["self", "input_batch"], _wrap_prepare_attn),
}


def patch_runner_v2(module: ModuleType) -> None:
    runner = module.GPUModelRunner
    originals = {name: getattr(runner, name, None) for name in _WRAPPED}
    if all(getattr(method, MARK, False) for method in originals.values()):
        return
    for name, method in originals.items():
        params = None if method is None else list(method.__code__.co_varnames[: method.__code__.co_argcount])
        if params != _WRAPPED[name][0]:
            raise RuntimeError(
                f"specprefill-rag: the V2 GPUModelRunner.{name}{tuple(params or ())} is not the shape this plugin "
                "was written for (vLLM 0.32/0.33); refusing to patch"
            )
    for name, method in originals.items():
        assert method is not None  # checked above
        setattr(runner, name, _WRAPPED[name][1](method))


PATCHES: dict[str, Callable[[ModuleType], None]] = {RUNNER_V2_MODULE: patch_runner_v2}
