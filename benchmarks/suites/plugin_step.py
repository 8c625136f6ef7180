"""Per-step cost of the vLLM plugin's position rewrite (``GPUModelRunner._prepare_inputs`` wrapper).

A mock runner carries what the wrapper reads of vLLM 0.32's ``GPUModelRunner`` (``input_batch``,
``requests[...].sampling_params.extra_args``, ``query_start_loc.np``, ``positions``, ...); no model,
no engine. Each case is a batch of ``--batch`` requests, P of them planned, replayed for many steps
(decode rows advance one slot per step; prefill rows walk through their prompt in chunks):

    decode-P     P planned decode rows of --batch, steady batch
    churn-P      the same, one request finishing and one arriving each step (its plan parsed then)
    prefill      --batch planned rows, 8 of them prefilling --chunk-token chunks of long prompts

Per case and code path, the host time of a step (on CUDA the device is synchronised outside the
timer after every step: blocking copies count, queued kernels do not):

    base          the stand-in original: refills positions with contiguous slots (one tensor copy)
    current       base + ``plugin_runner.wrap_prepare_inputs`` (the vectorised rewrite)
    legacy        base + the per-request rewrite it replaced (kept here only for this comparison)
    overhead      wrapper time = path − base, per step
    vllm_prepare  an emulation of vLLM 0.32's own ``_prepare_inputs`` host work for the batch (the
                  same numpy/torch operations and host→device copies for decode; a torch gather in
                  place of the Triton slot-mapping kernel)

``ratio`` = overhead / (current overhead of decode-0 + vllm_prepare of decode-0): the wrapper's
cost against an unplanned step's own input preparation. Target: ≤ 0.10 at 256 planned rows.

    python -m benchmarks.suites.plugin_step                     # table + benchmarks/results/plugin_step.json
    python -m benchmarks.suites.plugin_step --device cuda
    python -m benchmarks.suites.plugin_step --tiny --out /tmp/x.json
"""

from __future__ import annotations

import argparse
import functools
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from specprefill_rag.errors import PlanError
from specprefill_rag.vllm_plugin import runner as plugin_runner
from specprefill_rag.vllm_plugin.runner import remap_positions
from specprefill_rag.wire import parse_plan, plan_to_xargs

__all__ = ["Case", "MockRunner", "emulated_prepare_inputs", "legacy_wrap", "main", "run_case"]

BLOCK = 16  # KV-cache block size of the emulated slot mapping


def sparse_plan(k: int, rng: np.random.Generator) -> tuple[list[int], int]:
    """k sorted unique positions spread over ~2k, and the next position."""
    positions = np.sort(rng.choice(2 * k + 8, size=k, replace=False)).tolist()
    return positions, positions[-1] + 1 + int(rng.integers(0, 8))


@dataclass(frozen=True)
class Case:
    name: str
    batch: int  # rows in the batch
    planned: int  # rows carrying a plan
    prefill_rows: int = 0  # rows prefilling a chunk each step (planned ones)
    chunk: int = 0  # tokens per prefill chunk
    prompt: int = 512  # prompt tokens of decode rows
    long_prompt: int = 8192  # prompt tokens of prefill rows
    churn: bool = False  # one request finishes and one arrives each step


class MockRunner:
    """The attributes of vLLM 0.32's ``GPUModelRunner`` the wrapper (and the emulation) read."""

    def __init__(self, case: Case, device: torch.device, seed: int = 0) -> None:
        self.case, self.device = case, device
        self.rng = np.random.default_rng(seed)
        pin = device.type == "cuda"
        n = case.batch
        max_tokens = case.prefill_rows * case.chunk + n
        self.max_tokens = max_tokens
        self.requests: dict[str, SimpleNamespace] = {}
        width = max(case.prompt, case.long_prompt) * 2 + 64
        self.input_batch = SimpleNamespace(
            req_ids=[], num_reqs=0,
            num_computed_tokens_cpu=np.zeros(n, dtype=np.int32),
            token_ids_cpu=torch.zeros(n, width, dtype=torch.int32),
            block_table_cpu=torch.zeros(n, width // BLOCK + 1, dtype=torch.int32, pin_memory=pin),
        )
        self.input_batch.num_computed_tokens_cpu_tensor = torch.from_numpy(self.input_batch.num_computed_tokens_cpu)
        self.query_start_loc = SimpleNamespace(np=np.zeros(n + 1, dtype=np.int32))
        self.query_start_loc.cpu = torch.from_numpy(self.query_start_loc.np)
        self.query_start_loc.gpu = torch.zeros(n + 1, dtype=torch.int32, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.contiguous = torch.zeros(max_tokens, dtype=torch.int64, device=device)  # what vLLM wrote
        # buffers of the emulated vLLM _prepare_inputs (pinned host / device pairs, as vLLM's CpuGpuBuffer)
        self.arange_np = np.arange(max(max_tokens, n) + 1, dtype=np.int64)
        self.host = {name: torch.zeros(size, dtype=dtype, pin_memory=pin) for name, size, dtype in (
            ("query_pos", max_tokens, torch.int64), ("req_indices", max_tokens, torch.int64),
            ("num_scheduled", n, torch.int32), ("input_ids", max_tokens, torch.int32),
            ("seq_lens", n, torch.int32), ("discard", n, torch.bool))}
        self.dev = {name: torch.zeros_like(t, device=device) for name, t in self.host.items()}
        self.block_table = torch.zeros_like(self.input_batch.block_table_cpu, device=device)
        self.num_computed = torch.zeros(n, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.slot_mapping = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.serial = 0
        self.arrived: list[str] = []
        self.finished: set[str] = set()
        for row in range(n):
            self.input_batch.req_ids.append(self._new_request(row))
        self.input_batch.num_reqs = n

    def _new_request(self, row: int) -> str:
        case = self.case
        req_id = f"r{self.serial}"
        self.serial += 1
        prefill = row < case.prefill_rows
        k = case.long_prompt if prefill else case.prompt
        extra = None
        if row >= case.batch - case.planned or prefill:
            extra = plan_to_xargs(*sparse_plan(k, self.rng))
        self.requests[req_id] = SimpleNamespace(
            sampling_params=SimpleNamespace(extra_args=extra), num_prompt_tokens=k, num_tokens=k + 1)
        self.input_batch.num_computed_tokens_cpu[row] = 0 if prefill else k + int(self.rng.integers(0, 64))
        self.arrived.append(req_id)
        return req_id

    def schedule(self) -> np.ndarray:
        """Advance every row by one step (churn: replace one request); returns tokens per row."""
        case, batch = self.case, self.input_batch
        if case.churn:
            row = self.serial % case.batch
            self.finished = {batch.req_ids[row]}
            self.requests.pop(batch.req_ids[row])
            batch.req_ids[row] = self._new_request(row)
        counts = np.ones(case.batch, dtype=np.int32)
        counts[: case.prefill_rows] = case.chunk
        for row in range(case.prefill_rows):  # walk through the prompt, start over at its end
            if batch.num_computed_tokens_cpu[row] + case.chunk > case.long_prompt:
                batch.num_computed_tokens_cpu[row] = 0
        self.query_start_loc.np[0] = 0
        np.cumsum(counts, out=self.query_start_loc.np[1:])
        total = int(counts.sum())
        computed = np.repeat(batch.num_computed_tokens_cpu.astype(np.int64), counts)
        local = np.arange(total) - np.repeat(self.query_start_loc.np[:-1].astype(np.int64), counts)
        self.contiguous[:total].copy_(torch.from_numpy(computed + local))
        return counts

    def output(self) -> SimpleNamespace:
        out = SimpleNamespace(finished_req_ids=self.finished,
                              scheduled_new_reqs=[SimpleNamespace(req_id=r) for r in self.arrived])
        self.arrived, self.finished = [], set()
        return out

    def advance(self, counts: np.ndarray) -> None:
        self.input_batch.num_computed_tokens_cpu += counts


def base_original(runner: MockRunner, scheduler_output: Any, counts: np.ndarray) -> None:
    """Stand-in for vLLM's ``_prepare_inputs``: leaves contiguous slot indices in ``positions``."""
    runner.positions[: int(runner.query_start_loc.np[runner.input_batch.num_reqs])].copy_(
        runner.contiguous[: int(runner.query_start_loc.np[runner.input_batch.num_reqs])])


def emulated_prepare_inputs(runner: MockRunner, scheduler_output: Any, counts: np.ndarray) -> None:
    """vLLM 0.32's ``_prepare_inputs`` host work (no spec decode, no M-RoPE): the same operations."""
    batch, host, dev = runner.input_batch, runner.host, runner.dev
    n, total = batch.num_reqs, int(counts.sum())
    runner.block_table[:n].copy_(batch.block_table_cpu[:n], non_blocking=True)  # commit_block_table
    req_indices = np.repeat(runner.arange_np[:n], counts)
    cu = np.cumsum(counts)
    query_pos = host["query_pos"].numpy()
    query_pos[:total] = runner.arange_np[:total] - np.repeat(cu - counts, counts)
    positions_np = batch.num_computed_tokens_cpu[req_indices] + query_pos[:total]
    token_indices = positions_np + req_indices * batch.token_ids_cpu.shape[1]
    torch.index_select(batch.token_ids_cpu.flatten(), 0, torch.from_numpy(token_indices),
                       out=host["input_ids"][:total])
    qsl = runner.query_start_loc
    qsl.np[0] = 0
    qsl.np[1: n + 1] = cu
    qsl.gpu.copy_(qsl.cpu, non_blocking=True)
    torch.add(batch.num_computed_tokens_cpu_tensor[:n], torch.from_numpy(counts), out=host["seq_lens"][:n])
    num_tokens = np.array([runner.requests[r].num_tokens for r in batch.req_ids], dtype=np.int32)
    host["discard"].numpy()[:n] = host["seq_lens"][:n].numpy() < num_tokens
    dev["discard"][:n].copy_(host["discard"][:n], non_blocking=True)
    runner.num_computed[:n].copy_(batch.num_computed_tokens_cpu_tensor[:n], non_blocking=True)
    host["req_indices"].numpy()[:total] = req_indices
    dev["req_indices"][:total].copy_(host["req_indices"][:total], non_blocking=True)
    dev["query_pos"][:total].copy_(host["query_pos"][:total], non_blocking=True)
    host["num_scheduled"].numpy()[:n] = counts
    dev["num_scheduled"][:n].copy_(host["num_scheduled"][:n], non_blocking=True)
    req_idx = dev["req_indices"][:total]
    runner.positions[:total] = runner.num_computed[req_idx].to(torch.int64) + dev["query_pos"][:total]
    runner.seq_lens[:n] = runner.num_computed[:n] + dev["num_scheduled"][:n]
    blocks = runner.block_table[req_idx, runner.positions[:total] // BLOCK]  # compute_slot_mapping
    runner.slot_mapping[:total] = blocks.to(torch.int64) * BLOCK + runner.positions[:total] % BLOCK
    dev["input_ids"][:total].copy_(host["input_ids"][:total], non_blocking=True)
    _ = qsl.gpu[1: n + 1] - 1  # logits_indices


# -- the per-request rewrite before issue 16 item 6, for comparison only -----------------------


def legacy_wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    """The rewrite as it was: per planned request, ~6 tensor ops on the device, and on a plan's
    first step a pageable ``torch.tensor(list, device=...)`` copy of its kept positions."""
    @functools.wraps(original)
    def _prepare_inputs(self: Any, scheduler_output: Any, num_scheduled_tokens: Any) -> Any:
        result = original(self, scheduler_output, num_scheduled_tokens)
        cache = self.__dict__.setdefault("_legacy_plans", {})
        for req_id in getattr(scheduler_output, "finished_req_ids", None) or ():
            cache.pop(req_id, None)
        batch = self.input_batch
        starts = None
        for i, req_id in enumerate(batch.req_ids[: batch.num_reqs]):
            state = self.requests.get(req_id)
            extra = getattr(getattr(state, "sampling_params", None), "extra_args", None)
            if not extra or "specprefill_positions" not in extra:
                continue
            prompt_len = state.num_prompt_tokens
            cached = cache.get(req_id)
            if cached is None or cached[0] is not extra or cached[1] != prompt_len:
                plan = None
                try:
                    parsed = parse_plan(extra, prompt_len=prompt_len, max_tokens=None, max_len=1 << 62)
                    if parsed is not None:
                        plan = (torch.tensor(parsed.positions, dtype=torch.int64, device=self.positions.device),
                                parsed.next_position)
                except PlanError:
                    pass
                cached = cache[req_id] = (extra, prompt_len, plan)
            entry = cached[2]
            if entry is None or entry[0].numel() == 0:
                continue
            if starts is None:
                starts = self.query_start_loc.np
            start, end = int(starts[i]), int(starts[i + 1])
            if end > start:
                slots = self.positions[start:end]
                slots.copy_(remap_positions(slots, entry[0], entry[1]))
        return result

    return _prepare_inputs


# -- measurement -------------------------------------------------------------------------------

PATHS: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "base": lambda original: original,
    "current": plugin_runner.wrap_prepare_inputs,
    "legacy": legacy_wrap,
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(case: Case, device: torch.device, original: Callable[..., Any], wrap: Callable[..., Any],
               *, steps: int, warmup: int, reps: int) -> float:
    """Median over ``reps`` runs of the mean host time of one step, in microseconds.

    Only the call is timed; the mock's scheduling is not. On CUDA the device is synchronised
    outside the timer after each step, so a step's time is what the host spends (blocking copies
    included) with the device idle at its start.
    """
    runner = MockRunner(case, device)
    step = wrap(original)
    per_step = []
    for rep in range(reps + 1):
        n = warmup if rep == 0 else steps
        elapsed = 0.0
        for _ in range(n):
            counts = runner.schedule()
            output = runner.output()
            _sync(device)
            start = time.perf_counter()
            step(runner, output, counts)
            elapsed += time.perf_counter() - start
            _sync(device)
            runner.advance(counts)
        if rep:
            per_step.append(elapsed / n * 1e6)
    return statistics.median(per_step)


def run_case(case: Case, device: torch.device, *, steps: int, warmup: int, reps: int,
             paths: Sequence[str] = ("base", "current", "legacy")) -> dict[str, Any]:
    row: dict[str, Any] = {"case": case.name, "batch": case.batch, "planned": case.planned,
                           "tokens_per_step": case.prefill_rows * case.chunk + case.batch - case.prefill_rows}
    for path in paths:
        row[f"{path}_us"] = time_steps(case, device, base_original, PATHS[path], steps=steps, warmup=warmup,
                                       reps=reps)
    for path in paths:
        if path != "base":
            row[f"{path}_overhead_us"] = max(row[f"{path}_us"] - row["base_us"], 0.0)
    row["vllm_prepare_us"] = time_steps(case, device, emulated_prepare_inputs, PATHS["base"], steps=steps,
                                        warmup=warmup, reps=reps)
    return row


def check_equal(case: Case, device: torch.device, steps: int = 4) -> None:
    """The current and the legacy rewrite write the same positions (a sanity check of the mock)."""
    got = []
    for wrap in (plugin_runner.wrap_prepare_inputs, legacy_wrap):
        runner, step, out = MockRunner(case, device), wrap(base_original), []
        for _ in range(steps):
            counts = runner.schedule()
            step(runner, runner.output(), counts)
            out.append(runner.positions[: int(counts.sum())].cpu().clone())
            runner.advance(counts)
        got.append(out)
    for a, b in zip(*got, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def cases(batch: int, chunk: int, prompt: int, long_prompt: int) -> list[Case]:
    planned = sorted({0, 1, min(16, batch), batch})
    out = [Case(f"decode-{p}", batch, p, prompt=prompt, long_prompt=long_prompt) for p in planned]
    out.append(Case(f"churn-{batch}", batch, batch, prompt=prompt, long_prompt=long_prompt, churn=True))
    out.append(Case("prefill", batch, batch, prefill_rows=min(8, batch), chunk=chunk, prompt=prompt,
                    long_prompt=long_prompt))
    return out


def table(rows: list[dict[str, Any]]) -> str:
    header = (f"{'case':<12}{'tokens':>7}{'base':>9}{'current':>10}{'legacy':>10}{'cur ovh':>10}"
              f"{'leg ovh':>10}{'vllm prep':>11}{'ratio':>8}{'leg ratio':>10}")
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['case']:<12}{r['tokens_per_step']:>7}{r['base_us']:>9.1f}{r['current_us']:>10.1f}"
            f"{r.get('legacy_us', float('nan')):>10.1f}{r['current_overhead_us']:>10.1f}"
            f"{r.get('legacy_overhead_us', float('nan')):>10.1f}{r['vllm_prepare_us']:>11.1f}"
            f"{r['ratio']:>8.3f}{r.get('legacy_ratio', float('nan')):>10.3f}")
    return "\n".join(lines) + "\n(µs per step; ratio = overhead / (decode-0 overhead + decode-0 vllm prep))"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.suites.plugin_step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="torch device of the positions buffer (%(default)s)")
    parser.add_argument("--batch", type=int, default=256, help="requests per step (%(default)s)")
    parser.add_argument("--chunk", type=int, default=512, help="tokens per prefill chunk (%(default)s)")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens of decode rows (%(default)s)")
    parser.add_argument("--long-prompt", type=int, default=8192, help="prompt tokens of prefill rows (%(default)s)")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per run (%(default)s)")
    parser.add_argument("--reps", type=int, default=5, help="timed runs per cell, median (%(default)s)")
    parser.add_argument("--no-legacy", action="store_true", help="skip the old per-request rewrite")
    parser.add_argument("--tiny", action="store_true", help="smoke run: batch 4, few steps")
    parser.add_argument("--out", default=None, help="result file (default: benchmarks/results/plugin_step.json)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.batch, args.chunk, args.prompt, args.long_prompt, args.steps, args.reps = 4, 16, 32, 64, 3, 1
    device = torch.device(args.device)
    torch.set_num_threads(1)  # vLLM's input preparation is single-threaded host work
    paths = ("base", "current") if args.no_legacy else ("base", "current", "legacy")
    all_cases = cases(args.batch, args.chunk, args.prompt, args.long_prompt)
    if not args.no_legacy:
        for case in all_cases:
            check_equal(case, device)
    rows = [run_case(c, device, steps=args.steps, warmup=max(3, args.steps // 10), reps=args.reps, paths=paths)
            for c in all_cases]
    unplanned = rows[0]  # decode-0
    for path in paths[1:]:
        denominator = unplanned[f"{path}_overhead_us"] + unplanned["vllm_prepare_us"]
        for r in rows:
            r["ratio" if path == "current" else f"{path}_ratio"] = r[f"{path}_overhead_us"] / denominator
    print(table(rows))
    from benchmarks.lib.machine import machine_info
    from benchmarks.lib.results import write_results

    args_given = sys.argv[1:] if argv is None else argv
    command = " ".join(["python -m benchmarks.suites.plugin_step", *map(shlex.quote, args_given)])
    payload = {"command": command, "device": str(device), "machine": machine_info(),
               "definition": "ratio = wrapper overhead per step / (wrapper overhead at 0 planned rows + emulated "
                             "vLLM _prepare_inputs at 0 planned rows), same code path",
               "rows": rows}
    written = write_results("plugin_step_tiny" if args.tiny and not args.out else "plugin_step", payload, args.out)
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
