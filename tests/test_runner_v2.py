"""The position rewrite in vLLM's V2 model runner (``vllm_plugin.runner_v2``), on CPU tensors.

V2 cannot run here (its kernels need Triton), so these tests drive the real V2
``GPUModelRunner.prepare_attn``, patched, through ``benchmarks/lib/runner_v2_check.py``: the step's
positions buffer filled as V2's Triton kernel fills it, a block table that records what the slot
mapping was computed from. The slot mapping must see the contiguous positions (the KV goes where
vLLM allocated it), the model the plan's (``runner.remap_positions``), rows in any order,
prefill chunks and decodes. ``benchmarks/suites/gpu_ttft.py`` runs the same check on a GPU with V2's own
kernel where vLLM is installed.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from benchmarks.lib import runner_v2_check as check  # noqa: E402
from specprefill_rag.vllm_plugin import runner_v2  # noqa: E402
from specprefill_rag.vllm_plugin.runner import MARK, runner_patched  # noqa: E402
from specprefill_rag.wire import plan_to_xargs  # noqa: E402


@pytest.fixture
def v2(monkeypatch):
    """The real V2 ``GPUModelRunner`` class, patched for this test only."""
    from vllm.v1.worker.gpu import model_runner

    cls = model_runner.GPUModelRunner
    for name in runner_v2._WRAPPED:
        monkeypatch.setattr(cls, name, getattr(cls, name))  # restored after the test
    runner_v2.patch_runner_v2(model_runner)
    return cls


def test_the_slot_mapping_sees_contiguous_positions_and_the_model_the_plans(v2):
    """Three steps (prefill chunks, rows reordered, pure decode): ``check`` raises on any slot
    mapping computed from rewritten positions and on any position the model would see wrong."""
    assert check.check(v2, torch.device("cpu")) == {"status": "ok", "device": "cpu", "steps": 3, "kernel": False}
    assert check.expected("b", 5, 3) == [60, 61, 62] and check.expected("a", 0, 3) == [0, 7, 9]
    assert check.expected("plain", 4, 1) == [4]
    # The GPU variant (V2's own Triton kernel) says why it cannot run here instead of failing.
    assert check.gpu_check()["status"] == "skipped"


def test_plans_follow_the_requests_in_and_out(v2, caplog):
    """Plans are parsed as ``add_requests`` admits requests and dropped in ``_remove_request``
    (finished, preempted, re-sent); a contiguous plan or none needs nothing, a malformed one is
    logged and left contiguous; a runner with no planned request in the batch is left alone."""
    calls: list[str] = []
    add = runner_v2._wrap_add_requests(lambda self, out: calls.append("add"))
    remove = runner_v2._wrap_remove_request(lambda self, req_id: calls.append(f"remove {req_id}"))
    runner = SimpleNamespace()
    def request(req_id, prompt_len, extra, params=True):
        return SimpleNamespace(req_id=req_id, prompt_len=prompt_len,
                               sampling_params=SimpleNamespace(extra_args=extra) if params else None)

    new = [request("a", 5, plan_to_xargs(*check.PLANS["a"])), request("full", 3, plan_to_xargs([0, 1, 2], 3)),
           request("none", 3, None), request("pooling", 3, None, params=False),
           request("bad", 4, plan_to_xargs([0, 5], 9))]
    with caplog.at_level(logging.ERROR, logger="specprefill_rag.vllm_plugin.runner"):
        add(runner, SimpleNamespace(scheduled_new_reqs=new))
    plans = runner_v2.runner_plans(runner).plans
    assert list(plans) == ["a"] and plans["a"].kept.tolist() == check.PLANS["a"][0]
    assert any("request bad" in r.getMessage() for r in caplog.records)
    remove(runner, "a")
    assert calls == ["add", "remove a"] and not plans
    unplanned = check.runner(v2, torch.device("cpu"))
    batch = check.step_batch(unplanned, [("x", 0, 3)])
    unplanned.prepare_attn(batch)
    assert batch.positions.tolist() == [0, 1, 2]


def test_the_v2_runner_is_patched_once_and_checked(v2):
    from vllm.v1.worker.gpu import model_runner

    wrapped = {name: getattr(v2, name) for name in runner_v2._WRAPPED}
    assert all(getattr(method, MARK, False) for method in wrapped.values())
    runner_v2.patch_runner_v2(model_runner)  # again: nothing changes
    assert all(getattr(v2, name) is method for name, method in wrapped.items())
    assert runner_patched(SimpleNamespace(model_runner=object.__new__(v2)))

    class Moved:
        def add_requests(self, scheduler_output, extra):
            pass

        def _remove_request(self, req_id):
            pass

        def prepare_attn(self, input_batch):
            pass

    with pytest.raises(RuntimeError, match=r"V2 GPUModelRunner.add_requests\('self', 'scheduler_output', 'extra'\)"):
        runner_v2.patch_runner_v2(SimpleNamespace(GPUModelRunner=Moved))
    assert not getattr(Moved.prepare_attn, MARK, False)  # nothing patched when one method has moved
