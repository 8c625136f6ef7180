"""The plugin's position rewrite in vLLM's V2 model runner, checked on one device.

Drives the real V2 ``GPUModelRunner.prepare_attn``, patched by ``vllm_plugin.runner_v2``, with
its step's inputs built as V2 builds them: the persistent positions buffer filled with
contiguous indices, and a block table that records what the slot mapping was computed from.
Where Triton and a GPU are at hand, the positions come from V2's own kernel
(``input_batch.prepare_pos_seq_lens``) and are checked against the numpy formula the CPU tests
use; elsewhere that formula fills them. Then: the slot mapping must see the contiguous
positions, the model the plan's (``runner.remap_positions``), over three steps whose rows V2
would reorder (prefill chunks, decodes). ``tests/test_runner_v2.py`` runs it on the CPU;
``benchmarks/suites/gpu_ttft.py`` on its GPU when vLLM is installed there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from specprefill_rag.vllm_plugin import runner_v2
from specprefill_rag.vllm_plugin.runner import remap_positions
from specprefill_rag.wire import plan_to_xargs

PLANS = {  # request id → (kept prompt positions, next position)
    "a": ([0, 7, 9, 20, 21], 40),
    "b": ([0, 1, 2, 50, 51, 60], 61),
}
STEPS = [  # rows of each step: (request id, tokens computed before it, tokens it schedules)
    [("plain", 0, 4), ("a", 0, 3), ("b", 5, 3)],  # prefill chunks; b's last prompt slot, then generated
    [("b", 8, 1), ("plain", 4, 1), ("a", 3, 4)],  # V2 reorders rows: decodes first
    [("a", 7, 1), ("b", 9, 1)],  # pure decode
]


class RecordingBlockTables:
    """``BlockTables`` whose slot mapping records the positions it was computed from."""

    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def gather_block_tables(self, idx_mapping: Any, num_reqs_padded: int, **kwargs: Any) -> tuple[()]:
        return ()

    def compute_slot_mappings(self, idx_mapping: Any, query_start_loc: Any, positions: torch.Tensor,
                              num_tokens_padded: int) -> torch.Tensor:
        self.seen.append(positions[:num_tokens_padded].tolist())
        return torch.zeros(1, num_tokens_padded, dtype=torch.int64, device=positions.device)


def runner(cls: Any, device: torch.device) -> Any:
    """An instance of the V2 runner class with what ``prepare_attn`` reads (its ``__init__``
    needs a whole engine)."""
    out = object.__new__(cls)
    out.pcp_manager = None
    out.block_tables = RecordingBlockTables()
    out.positions_buffer = torch.full((64,), -1, dtype=torch.int64, device=device)  # V2's input buffer
    return out


def admit(model_runner: Any, *requests: str) -> None:
    """The plans of ``requests`` as ``add_requests`` admits them."""
    new = [SimpleRequest(r, len(PLANS[r][0]), plan_to_xargs(*PLANS[r])) for r in requests]
    runner_v2.runner_plans(model_runner).admit(new)


@dataclasses.dataclass
class SimpleRequest:
    """What ``V2Plans.admit`` reads of vLLM's ``NewRequestData``."""

    req_id: str
    prompt_len: int
    extra_args: dict[str, Any] | None

    @property
    def sampling_params(self) -> Any:
        return self


def contiguous(starts: np.ndarray, counts: np.ndarray, computed: np.ndarray) -> np.ndarray:
    """What ``prepare_pos_seq_lens`` writes: token i of a row is at its computed count + i."""
    n = int(starts[-1])
    return np.repeat(computed, counts) + np.arange(n) - np.repeat(starts[:-1], counts)


def step_batch(model_runner: Any, rows: list[tuple[str, int, int]], kernel: bool = False) -> Any:
    """An ``InputBatch`` of ``rows``, its positions in the runner's buffer; ``kernel``: filled by
    V2's Triton kernel (checked against ``contiguous``)."""
    from vllm.v1.worker.gpu.input_batch import InputBatch

    buffer = model_runner.positions_buffer
    counts = np.array([count for _, _, count in rows], dtype=np.int32)
    computed = np.array([done for _, done, _ in rows], dtype=np.int32)
    starts = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(counts, out=starts[1:])
    n = int(starts[-1])
    want = torch.from_numpy(contiguous(starts, counts, computed))
    query_start_loc = torch.from_numpy(starts).to(buffer.device)
    if kernel:
        from vllm.v1.worker.gpu.input_batch import prepare_pos_seq_lens

        seq_lens = torch.zeros(len(rows) + 1, dtype=torch.int32, device=buffer.device)
        prepare_pos_seq_lens(torch.arange(len(rows), dtype=torch.int32, device=buffer.device), query_start_loc,
                             torch.from_numpy(computed).to(buffer.device), buffer, seq_lens)
        if buffer[:n].cpu().tolist() != want.tolist():
            raise AssertionError(f"V2's prepare_pos_seq_lens wrote {buffer[:n].tolist()}, not {want.tolist()}")
    else:
        buffer[:n].copy_(want)
    given: dict[str, Any] = dict(
        req_ids=[r for r, _, _ in rows], num_reqs=len(rows), num_reqs_after_padding=len(rows),
        idx_mapping=torch.arange(len(rows), device=buffer.device), query_start_loc=query_start_loc,
        query_start_loc_np=starts, num_scheduled_tokens=counts, num_tokens=n, num_tokens_after_padding=n,
        num_computed_tokens_np=computed, positions=buffer[:n],
    )
    required = [f.name for f in dataclasses.fields(InputBatch)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    fields: dict[str, Any] = {name: given.get(name) for name in required}
    return InputBatch(**fields)


def expected(req_id: str, computed: int, count: int) -> list[int]:
    """The positions the model must see for a row's slots."""
    if req_id not in PLANS:
        return list(range(computed, computed + count))
    kept, next_position = PLANS[req_id]
    return remap_positions(torch.arange(computed, computed + count), torch.tensor(kept), next_position).tolist()


def check(cls: Any, device: torch.device, kernel: bool = False) -> dict[str, Any]:
    """Run ``STEPS`` through ``cls.prepare_attn`` (the patched V2 runner class) on ``device``;
    AssertionError on any wrong position. Returns what ran."""
    model_runner = runner(cls, device)
    admit(model_runner, "a", "b")
    for rows in STEPS:
        batch = step_batch(model_runner, rows, kernel)
        before = batch.positions.tolist()
        model_runner.prepare_attn(batch)
        if model_runner.block_tables.seen[-1] != before:
            raise AssertionError(f"the slot mapping saw {model_runner.block_tables.seen[-1]}, not {before}")
        want = [p for req_id, done, count in rows for p in expected(req_id, done, count)]
        if batch.positions.tolist() != want or model_runner.positions_buffer[: len(want)].tolist() != want:
            raise AssertionError(f"step {rows}: the model sees {batch.positions.tolist()}, not {want}")
    return {"status": "ok", "device": str(device), "steps": len(STEPS), "kernel": kernel}


def gpu_check() -> dict[str, Any]:
    """``check`` on the GPU with V2's own kernel, for ``benchmarks/suites/gpu_ttft.py``: "skipped" with
    the reason where vLLM, its V2 runner or Triton is missing, "failed" with the error."""
    try:
        from vllm.v1.worker.gpu import model_runner

        from specprefill_rag.vllm_plugin.runner_v2 import patch_runner_v2
    except Exception as error:  # noqa: BLE001 - any import failure means: not checkable here
        return {"status": "skipped", "why": f"vLLM's V2 runner cannot be imported: {error}"}
    if not torch.cuda.is_available():
        return {"status": "skipped", "why": "no GPU"}
    try:
        import triton  # noqa: F401
    except ImportError:
        return {"status": "skipped", "why": "no Triton"}
    patch_runner_v2(model_runner)
    try:
        return check(model_runner.GPUModelRunner, torch.device("cuda"), kernel=True)
    except Exception as error:  # noqa: BLE001 - reported in the results, not raised mid-run
        return {"status": "failed", "why": f"{type(error).__name__}: {error}"}
