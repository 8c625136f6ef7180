"""The plan on the wire (``specprefill_rag.wire``) and its validation rules, and the plugin's version check
(pure Python: no vLLM, no server)."""

from __future__ import annotations

import pytest
import torch

from specprefill_rag.backends.vllm_server import request_body
from specprefill_rag.config import GenerationConfig
from specprefill_rag.errors import PlanError, ServerStartError, UnsupportedVLLMError
from specprefill_rag.types import PrefillPlan
from specprefill_rag.vllm_plugin import check_vllm_version
from specprefill_rag.vllm_plugin.runner import remap_positions
from specprefill_rag.wire import NEXT_POSITION_KEY, POSITIONS_KEY, parse_plan, plan_salt, plan_to_xargs


def xargs(positions, next_position):
    return {POSITIONS_KEY: positions, NEXT_POSITION_KEY: next_position}


def test_no_plan_is_none():
    assert parse_plan(None, prompt_len=3, max_tokens=4, max_len=100) is None
    assert parse_plan({"other": 1}, prompt_len=3, max_tokens=4, max_len=100) is None


def test_valid_plan():
    plan = parse_plan(xargs([0, 5, 9], 20), prompt_len=3, max_tokens=4, max_len=100)
    assert plan is not None and plan.positions == (0, 5, 9) and plan.next_position == 20


@pytest.mark.parametrize(
    "extra, message",
    [
        ({POSITIONS_KEY: [0, 1, 2]}, "needs both"),
        (xargs("0,1,2", 20), "must be a list of integers, got str"),
        (xargs([0, 1.5, 2], 20), "must be a list of integers"),
        (xargs([0, True, 2], 20), "must be a list of integers"),
        (xargs([0, 1, 2], "20"), "specprefill_next_position must be an integer"),
        (xargs([0, 1], 20), "has 2 entries but the prompt has 3 tokens"),
        (xargs([-1, 1, 2], 20), "must be >= 0"),
        (xargs([0, 2, 1], 20), "must be sorted ascending: 1 follows 2"),
        (xargs([0, 2, 2], 20), "duplicate position 2"),
        (xargs([0, 1, 30], 20), "must be greater than the last prompt position"),
        (xargs([0, 1, 2], 100), "must be below the model's maximum length of 100"),
        (xargs([0, 1, 2], 98), r"\+ max_tokens \(4\) exceeds the model's maximum length of 100"),
    ],
)
def test_bad_plans(extra, message):
    with pytest.raises(PlanError, match=message):
        parse_plan(extra, prompt_len=3, max_tokens=4, max_len=100)


def test_remap_positions():
    kept = torch.tensor([0, 4, 7, 9])
    # a chunk of the prompt, then the whole prompt + two generated tokens, then one decode step
    assert remap_positions(torch.tensor([1, 2]), kept, 20).tolist() == [4, 7]
    assert remap_positions(torch.arange(6), kept, 20).tolist() == [0, 4, 7, 9, 20, 21]
    assert remap_positions(torch.tensor([7]), kept, 20).tolist() == [23]


def test_salt_depends_on_positions_only():
    assert plan_salt([0, 4, 7], 10) == plan_salt([0, 4, 7], 10)
    assert plan_salt([0, 4, 7], 10) != plan_salt([0, 5, 7], 10)
    assert plan_salt([0, 4, 7], 10) != plan_salt([0, 4, 7], 11)
    assert len(plan_salt(list(range(8000)), 8000)) <= 128


def test_version_gate(monkeypatch):
    check_vllm_version("0.32.0")
    check_vllm_version("0.32.0+cpu")
    check_vllm_version("0.32.3")  # a patch release: admitted, the signature checks decide
    check_vllm_version("0.33.0")  # verified by reading (docs/vllm.md)
    check_vllm_version("0.33.1")
    monkeypatch.delenv("SPECPREFILL_VLLM_ALLOW_UNTESTED", raising=False)
    with pytest.raises(UnsupportedVLLMError, match=r"supports vLLM 0.32.0, 0.33.0 \(and their patch releases\), "
                                                   r"but vLLM 0.31.1 is installed"):
        check_vllm_version("0.31.1")
    with pytest.raises(UnsupportedVLLMError):
        check_vllm_version("0.34.0")
    monkeypatch.setenv("SPECPREFILL_VLLM_ALLOW_UNTESTED", "1")
    check_vllm_version("0.31.1")


def test_unsupported_vllm_disables_the_plugin_without_aborting(monkeypatch, caplog):
    """An untested vLLM: one error line, nothing patched, vLLM starts."""
    vllm = pytest.importorskip("vllm")
    import specprefill_rag.vllm_plugin as plugin

    monkeypatch.setattr(vllm, "__version__", "0.31.1")
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(plugin, "_disabled", None)
    monkeypatch.delenv("SPECPREFILL_VLLM_ALLOW_UNTESTED", raising=False)
    applied = []
    monkeypatch.setattr(plugin, "apply_patches", lambda: applied.append(1))
    with caplog.at_level("ERROR", logger="specprefill_rag.vllm_plugin"):
        plugin.register()
        plugin.register()  # once per process
    assert not applied
    assert len(caplog.records) == 1 and "plugin disabled" in caplog.records[0].getMessage()
    reason = plugin.disabled_reason()
    assert reason is not None and "0.31.1" in reason


@pytest.mark.parametrize(("env", "pinned", "logged"), [
    (None, "0", "pins vLLM's V1 model runner"),  # unset: V1 pinned, with a line that says why
    ("0", "0", None),
    ("1", "1", "plans are rewritten in vLLM's V2 model runner"),  # the user's choice: V2 is patched too
])
def test_the_v1_runner_is_pinned_unless_the_environment_chooses(monkeypatch, caplog, env, pinned, logged):
    vllm = pytest.importorskip("vllm")
    import specprefill_rag.vllm_plugin as plugin

    monkeypatch.setattr(vllm, "__version__", "0.32.0")
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(plugin, "_disabled", None)
    if env is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", env)
    applied = []
    monkeypatch.setattr(plugin, "apply_patches", lambda: applied.append(1))
    with caplog.at_level("INFO", logger="specprefill_rag.vllm_plugin"):
        plugin.register()
    assert applied == [1] and plugin.disabled_reason() is None
    import os

    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == pinned
    messages = [r.getMessage() for r in caplog.records]
    assert (any(logged in m for m in messages) if logged else not messages), messages


def test_server_binds_cpu_ranks_when_numa_nodes_are_fewer(monkeypatch):
    from specprefill_rag.tools import vllm_process as server

    assert server.parallel_ranks(["--tensor-parallel-size", "2"]) == 2
    assert server.parallel_ranks(["-tp=2", "--pipeline-parallel-size", "3"]) == 6
    assert server.parallel_ranks(["--max-num-seqs", "8"]) == 1
    assert server.cpu_binding(2, [0, 1]) == "0|1"
    assert server.cpu_binding(2, [4, 5, 6, 7, 8]) == "4,5|6,7"
    assert server.cpu_binding(3, [0, 1]) is None and server.cpu_binding(1, [0, 1]) is None
    monkeypatch.setattr(server, "numa_nodes", lambda: 1)
    monkeypatch.setattr(server.os, "sched_getaffinity", lambda pid: {0, 1})
    env = server.server_env({}, cpu=True, extra_args=["--tensor-parallel-size", "2"])
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert server.server_env({"VLLM_CPU_OMP_THREADS_BIND": "auto"}, cpu=True,
                             extra_args=["-tp", "2"])["VLLM_CPU_OMP_THREADS_BIND"] == "auto"  # the caller's wins
    assert "VLLM_CPU_OMP_THREADS_BIND" not in server.server_env({}, cpu=True)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in server.server_env({}, cpu=False, extra_args=["-tp", "2"])
    monkeypatch.setattr(server, "numa_nodes", lambda: 2)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in server.server_env({}, cpu=True, extra_args=["-tp", "2"])


def test_request_body_sends_plan_only_when_positions_differ():
    ids = torch.arange(100, 110)
    full = PrefillPlan(ids, torch.arange(10), 10, 10, (), False)
    body = request_body(full, GenerationConfig(max_new_tokens=5), model="m", max_tokens=5, logprobs=True, stream=True)
    assert "vllm_xargs" not in body and "cache_salt" not in body
    assert body["prompt"] == ids.tolist() and body["logprobs"] == 0 and body["return_token_ids"]
    kept = [0, 1, 5, 6, 20]
    sparse = PrefillPlan(ids[:5], torch.tensor(kept), 30, 30, (), True)
    body = request_body(sparse, GenerationConfig(), model="m", max_tokens=5, logprobs=False, stream=True)
    assert body["vllm_xargs"] == plan_to_xargs(kept, 30)
    assert "cache_salt" not in body  # positions are the plugin's part of the block hash, not a salt
    # A caller's salt (tenant, cold benchmark requests) goes on every request as given.
    body = request_body(full, GenerationConfig(), model="m", max_tokens=5, logprobs=False, stream=True,
                        cache_salt="tenant-a")
    assert body["cache_salt"] == "tenant-a" and "vllm_xargs" not in body
    body = request_body(sparse, GenerationConfig(), model="m", max_tokens=5, logprobs=False, stream=True,
                        cache_salt="tenant-a")
    assert body["cache_salt"] == "tenant-a" and body["vllm_xargs"] == plan_to_xargs(kept, 30)


def test_server_in_another_environment_is_checked_there(tmp_path):
    """VLLMServer(python=...) checks the plugin with that interpreter, and says what it answered."""
    from specprefill_rag.tools import vllm_process

    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named vllm' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(ServerStartError, match=f"cannot start vLLM with {fake}: ModuleNotFoundError"):
        vllm_process._require_plugin(str(fake))
    command = vllm_process.server_command("/models/m", launch=vllm_process.LaunchOptions(python=str(fake)), cpu=True)
    assert command[:3] == [str(fake), "-m", "vllm.entrypoints.openai.api_server"]


def test_cpu_defaults_are_one_table_for_server_and_offline_engine():
    """The server's flags and ``vllm.LLM``'s arguments on CPU come from CPU_ENGINE_ARGS; the
    caller's own values win, ``dtype="auto"`` included as absent."""
    from specprefill_rag.backends import vllm_offline
    from specprefill_rag.tools import vllm_process

    command = vllm_process.server_command("/models/m", cpu=True, extra_args=["--max-num-seqs", "8"])
    assert command[-5:] == ["--dtype", "float32", "--enforce-eager", "--max-num-seqs", "8"]
    assert "--dtype" not in vllm_process.server_command("/models/m", cpu=False)
    assert vllm_process.server_env({}, cpu=True)["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert vllm_process.server_env({"VLLM_CPU_KVCACHE_SPACE": "4"}, cpu=True)["VLLM_CPU_KVCACHE_SPACE"] == "4"
    args = vllm_offline.cpu_engine_args({"dtype": "auto", "max_model_len": 2048}, env={})
    assert args == {"dtype": "float32", "enforce_eager": True, "max_model_len": 2048, "kv_cache_memory_bytes": 1 << 30}
    args = vllm_offline.cpu_engine_args({"dtype": "bfloat16", "enforce_eager": False},
                                        env={"VLLM_CPU_KVCACHE_SPACE": "2"})
    assert args == {"dtype": "bfloat16", "enforce_eager": False}
