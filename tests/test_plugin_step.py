"""The vectorised position rewrite of the vLLM plugin equals ``remap_positions`` request by request.

- ``planned_offsets`` on random batches (prefill chunks, decode, a recompute spanning prompt and
  generated slots, several plans side by side, unplanned rows in between).
- The wrapped ``_prepare_inputs`` on a simulated runner over many steps: chunked prefill under a
  token budget, decode, arrivals, finished requests, reused ids, preemption and recompute, rows
  reordered, contiguous and ill-fitting plans, requests without plans.
- The micro-benchmark's tiny run (``benchmarks/suites/plugin_step.py``) runs and writes its rows.
"""

from __future__ import annotations

import json
import logging
import random
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from specprefill_rag.vllm_plugin import runner as plugin_runner
from specprefill_rag.vllm_plugin.runner import planned_offsets, remap_positions
from specprefill_rag.wire import plan_to_xargs


def random_plan(rng: random.Random, k: int) -> tuple[list[int], int]:
    kept = sorted(rng.sample(range(3 * k + 5), k))
    return kept, kept[-1] + 1 + rng.randrange(20)


@pytest.mark.parametrize("seed", range(40))
def test_planned_offsets_match_remap_positions(seed):
    rng = random.Random(seed)
    rows, start = [], rng.randrange(5)
    for _ in range(rng.randint(1, 12)):
        k = rng.randint(1, 120)
        kept, next_position = random_plan(rng, k)
        kind = rng.choice(["chunk", "decode", "recompute", "last-prompt-token"])
        if kind == "chunk":
            computed, count = rng.randrange(k), rng.randint(1, 64)
        elif kind == "decode":
            computed, count = k + rng.randrange(50), 1
        elif kind == "recompute":  # resumed after preemption: prompt and generated slots in one chunk
            computed, count = 0, k + rng.randint(1, 20)
        else:
            computed, count = k - 1, 1
        rows.append((start, count, computed, np.array(kept, dtype=np.int64), next_position))
        start += count + rng.randrange(4)  # unplanned rows in between
    starts, counts, computed, kept, nexts = (list(c) for c in zip(*rows, strict=True))
    as64 = lambda v: np.array(v, dtype=np.int64)  # noqa: E731
    lengths = as64([a.size for a in kept])
    index, offsets = planned_offsets(as64(starts), as64(counts), as64(computed), kept, lengths, as64(nexts))
    assert index.dtype == offsets.dtype == np.int64
    expected_index, expected = [], []
    for s, n, c, kp, nxt in rows:
        slots = torch.arange(c, c + n)
        expected_index += range(s, s + n)
        expected += remap_positions(slots, torch.from_numpy(kp), nxt).tolist()
    assert index.tolist() == expected_index
    slots = np.concatenate([np.arange(c, c + n) for _, n, c, _, _ in rows])
    assert (slots + offsets).tolist() == expected


def test_planned_offsets_of_nothing():
    empty = np.zeros(0, dtype=np.int64)
    index, offsets = planned_offsets(empty, empty, empty, [], empty, empty)
    assert index.size == offsets.size == 0


# -- the wrapper over a simulated vLLM runner ----------------------------------------------


class SimulatedRunner:
    """Plays vLLM 0.32's scheduler and persistent batch around the wrapped ``_prepare_inputs``."""

    def __init__(self, rng: random.Random, max_reqs: int = 8, budget: int = 48) -> None:
        self.rng, self.max_reqs, self.budget = rng, max_reqs, budget
        self.requests: dict[str, SimpleNamespace] = {}
        self.input_batch = SimpleNamespace(req_ids=[], num_reqs=0,
                                           num_computed_tokens_cpu=np.zeros(max_reqs, dtype=np.int32))
        self.query_start_loc = SimpleNamespace(np=np.zeros(max_reqs + 1, dtype=np.int32))
        self.positions = torch.full((budget + 8,), -1, dtype=torch.int64)
        self.live: dict[str, dict[str, Any]] = {}  # req id → k, plan, computed, generated, target
        self.rows: list[str] = []  # the persistent batch, row order
        self.preempted: list[str] = []
        self.serial = 0
        self.misfits = 0  # ill-fitting plans sent
        self.prepare = plugin_runner.wrap_prepare_inputs(self._contiguous)

    def _contiguous(self, runner: Any, scheduler_output: Any, counts: Any) -> None:
        start = 0
        for row in range(len(self.rows)):
            c, n = self.input_batch.num_computed_tokens_cpu[row], counts[row]
            self.positions[start:start + n] = torch.arange(c, c + n)
            start += n

    def arrive(self, reuse: str | None = None, kind: str | None = None) -> str:
        rng = self.rng
        req_id = reuse or f"q{self.serial}"
        self.serial += 1
        k = rng.randint(1, 90)
        kind = kind or rng.choice(["plan", "plan", "plan", "none", "contiguous", "misfit"])
        self.misfits += kind == "misfit"
        kept, next_position = random_plan(rng, k)
        extra: dict[str, Any] | None = {
            "plan": plan_to_xargs(kept, next_position),
            "none": None,
            "contiguous": plan_to_xargs(list(range(k)), k),
            "misfit": plan_to_xargs(kept[:-1] or [0, 1], next_position),
        }[kind]
        self.requests[req_id] = SimpleNamespace(sampling_params=SimpleNamespace(extra_args=extra), num_prompt_tokens=k)
        plan = (torch.tensor(kept), next_position) if kind == "plan" else None
        self.live[req_id] = {"k": k, "plan": plan, "computed": 0, "generated": 0, "target": rng.randint(1, 12)}
        self.rows.append(req_id)
        return req_id

    def step(self, events: bool = True, new: list[str] | None = None) -> int:
        """One engine step; checks every scheduled request's positions. Returns the tokens scheduled.

        ``events``: requests finish, arrive (some under a finished one's id), are preempted and
        resumed, rows are reordered; otherwise the batch stays as it is (``new``: just added)."""
        rng, finished, new = self.rng, set(), list(new or ())
        for req_id in [r for r in self.rows if self.live[r]["generated"] >= self.live[r]["target"]]:
            finished.add(req_id)
            self.rows.remove(req_id)
            del self.live[req_id], self.requests[req_id]
        if events and self.preempted and rng.random() < 0.5 and len(self.rows) < self.max_reqs:
            self.rows.append(self.preempted.pop(0))  # resumed: recomputes prompt and generated tokens
        reusable = sorted(finished)  # ids of requests that just finished
        while events and len(self.rows) < self.max_reqs and rng.random() < 0.6:
            reuse = reusable.pop(rng.randrange(len(reusable))) if reusable and rng.random() < 0.5 else None
            new.append(self.arrive(reuse))
        running = [r for r in self.rows if r not in new]
        if events and running and rng.random() < 0.2:  # preempted: leaves the batch, state kept
            victim = rng.choice(running)
            self.rows.remove(victim)
            self.live[victim]["computed"] = 0
            self.preempted.append(victim)
        if events and rng.random() < 0.3:  # vLLM reorders and condenses its persistent batch
            rng.shuffle(self.rows)
        counts, left = [], self.budget - len(self.rows)
        for req_id in self.rows:
            state = self.live[req_id]
            remaining = state["k"] + state["generated"] - state["computed"]
            extra = min(remaining - 1, left)
            counts.append(1 + extra)
            left -= extra
        batch = self.input_batch
        batch.req_ids, batch.num_reqs = list(self.rows), len(self.rows)
        batch.num_computed_tokens_cpu[: len(self.rows)] = [self.live[r]["computed"] for r in self.rows]
        self.query_start_loc.np[: len(counts) + 1] = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        output = SimpleNamespace(finished_req_ids=finished, scheduled_new_reqs=[SimpleNamespace(req_id=r) for r in new])
        self.prepare(self, output, np.array(counts, dtype=np.int32))
        start = 0
        for req_id, n in zip(self.rows, counts, strict=True):
            state = self.live[req_id]
            slots = torch.arange(state["computed"], state["computed"] + n)
            expected = slots if state["plan"] is None else remap_positions(slots, *state["plan"])
            assert self.positions[start:start + n].tolist() == expected.tolist(), (req_id, state)
            start += n
            state["computed"] += n
            if state["computed"] == state["k"] + state["generated"]:
                state["generated"] += 1  # sampled a token
        return start


@pytest.mark.parametrize("seed", range(12))
def test_wrapper_equals_remap_positions_over_a_random_schedule(seed, caplog):
    sim = SimulatedRunner(random.Random(seed))
    with caplog.at_level(logging.ERROR, logger=plugin_runner.__name__):
        tokens = sum(sim.step() for _ in range(150))
    assert tokens > 1000 and sim.serial > 20
    assert sum("not applied" in r.getMessage() for r in caplog.records) == sim.misfits  # once per request


def test_steady_decode_reuses_the_last_step():
    """An unchanged all-decode batch reuses the last step's arrays (on a GPU: no host→device copy)."""
    sim = SimulatedRunner(random.Random(0), max_reqs=4, budget=400)
    new = [sim.arrive(kind="plan") for _ in range(3)] + [sim.arrive(kind="none")]
    for req_id in sim.rows:
        sim.live[req_id]["target"] = 100
    sim.step(events=False, new=new)  # whole prompts
    sim.step(events=False)  # first decode step: arrays built
    decode = sim._specprefill_plans.decode
    assert decode is not None and decode.index.size == 3
    for _ in range(5):
        sim.step(events=False)
        assert sim._specprefill_plans.decode is decode


# -- the benchmark ---------------------------------------------------------------------------


def test_benchmark_tiny_run_writes_rows(tmp_path):
    from benchmarks.suites import plugin_step

    out = tmp_path / "plugin_step.json"
    assert plugin_step.main(["--tiny", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {row["case"]: row for row in result["rows"]}
    assert {"decode-0", "decode-4", "prefill"} <= set(rows)
    assert all(row["current_us"] > 0 and "ratio" in row for row in rows.values())
