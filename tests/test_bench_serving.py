"""``bench serving``: open-loop Poisson arrivals, per-rate TTFT percentiles and the goodput under
a TTFT SLO (pure parts and the arrival loop with a fake server), and a short ladder through a
real gateway over the tiny engine."""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path

import pytest

from benchmarks.suites import serving


def test_arrivals_are_a_seeded_poisson_process():
    times = serving.arrival_times(0.5, 4000, seed=3)
    assert times == serving.arrival_times(0.5, 4000, seed=3) and times != serving.arrival_times(0.5, 4000, seed=4)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert times[0] == 0.0 and min(gaps) > 0
    assert statistics.fmean(gaps) == pytest.approx(2.0, rel=0.06)  # 1 / rate
    assert statistics.stdev(gaps) == pytest.approx(2.0, rel=0.1)  # exponential: sd = mean
    with pytest.raises(ValueError, match="positive rate"):
        serving.arrival_times(0, 3, seed=0)


def test_the_loop_is_open_requests_go_out_on_time_whatever_the_server_does():
    """A server that takes 0.3 s per request does not delay the next sends (a closed loop would)."""
    in_flight, most = 0, 0
    lock = threading.Lock()

    def slow(i: int) -> dict:
        nonlocal in_flight, most
        with lock:
            in_flight += 1
            most = max(most, in_flight)
        time.sleep(0.3)
        with lock:
            in_flight -= 1
        return {"status": 200, "ttft_s": 0.1 * (i + 1)}

    times = [0.0, 0.05, 0.1, 0.15]
    began = time.perf_counter()
    rows = serving.open_loop(slow, times)
    assert time.perf_counter() - began < 0.9  # 4 × 0.3 s one after the other would take 1.2 s
    assert most >= 3 and [r["ttft_s"] for r in rows] == pytest.approx([0.1, 0.2, 0.3, 0.4])
    for row, at in zip(rows, times, strict=True):
        assert row["sent_s"] == pytest.approx(at, abs=0.04) and row["e2e_s"] >= 0.3


def test_a_dropped_connection_is_counted_not_raised():
    def broken(i: int) -> dict:
        if i == 1:
            raise ConnectionResetError("reset by peer")
        return {"status": 200, "ttft_s": 0.01}

    rows = serving.open_loop(broken, [0.0, 0.0])
    assert rows[1]["status"] is None and "reset" in rows[1]["error"]
    summary = serving.rate_summary(rows)
    assert summary["requests"] == 2 and summary["answered"] == 1


def _rows(ttfts: list[float], status: int = 200) -> list[dict]:
    return [{"status": status, "ttft_s": t, "sent_s": float(i), "e2e_s": t + 1.0} for i, t in enumerate(ttfts)]


def test_rate_summary_percentiles_latency_and_throughput():
    s = serving.rate_summary(_rows([1.0, 2.0, 3.0, 4.0, 5.0]))
    assert (s["p50_ttft_s"], s["p95_ttft_s"]) == (3.0, pytest.approx(4.8)) and s["p99_ttft_s"] == pytest.approx(4.96)
    assert s["mean_e2e_s"] == 4.0 and s["answered_per_s"] == pytest.approx(5 / 10.0)  # sends 0..4, last ends at 10


def test_goodput_is_the_highest_rate_within_the_slo_with_every_lower_rate():
    ok, slow = serving.rate_summary(_rows([1.0] * 4)), serving.rate_summary(_rows([9.0] * 4))
    refused = serving.rate_summary([*_rows([1.0] * 3), {"status": 429, "ttft_s": None, "sent_s": 3.0, "e2e_s": 0.1}])
    assert serving.goodput({0.1: ok, 0.2: ok, 0.4: slow}, slo_s=2.0) == 0.2
    assert serving.goodput({0.1: ok, 0.2: slow, 0.4: ok}, slo_s=2.0) == 0.1  # a miss ends the ladder
    assert serving.goodput({0.1: refused, 0.2: ok}, slo_s=2.0) is None  # an unanswered request misses
    assert serving.goodput({0.1: slow}, slo_s=2.0) is None


def test_the_ladder_alternates_sides_and_summarises_each():
    order: list[str] = []

    def side(name: str):
        def send(i: int) -> dict:
            order.append(name)
            return {"status": 200, "ttft_s": 0.5 if name == "direct" else 0.2}
        return send

    result = serving.ladder({"direct": side("direct"), "gateway": side("gateway")}, [50.0, 100.0], 2, seed=0)
    assert order == ["direct", "direct", "gateway", "gateway", "gateway", "gateway", "direct", "direct"]
    assert result["per_rate"]["gateway"][100.0]["p95_ttft_s"] == pytest.approx(0.2)
    assert len(result["rows"]) == 8 and {r["side"] for r in result["rows"]} == {"direct", "gateway"}


def test_options_and_defaults():
    args = serving.parse_args([])
    assert args.rates == sorted(args.rates) and args.keep_rate == 0.1
    assert args.sides == ["direct", "gateway", "gateway_skip"]
    assert serving.parse_args(["--rates", "0.1", "0.2", "--sides", "direct", "gateway"]).sides == ["direct", "gateway"]


def test_three_sides_rotate_and_paths_are_counted_per_side_and_rate():
    order = []

    def side(name):
        def send(i):
            order.append(name)
            return {"status": 200, "ttft_s": 0.1, "path": None if name == "direct" else "pruned"}
        return send

    result = serving.ladder({n: side(n) for n in ("direct", "gateway", "gateway_skip")}, [50.0, 100.0, 150.0], 1, 0)
    assert order == ["direct", "gateway", "gateway_skip", "gateway", "gateway_skip", "direct",
                     "gateway_skip", "direct", "gateway"]
    counts = serving.paths(result["rows"])
    assert set(counts) == {"gateway", "gateway_skip"} and counts["gateway"]["100.0"] == {"pruned": 1}


def test_vllm_clients_prompt_is_one_the_gateway_splits_into_the_passages():
    """vLLM's client sends the LlamaIndex QA prompt in one user message; the gateway must find the
    same passages and question in it, or the two sides would not be the same requests."""
    from benchmarks.lib.vllm_client import client_command, llamaindex_prompt, summary
    from specprefill_rag.gateway.messages import recognise

    passages = ["The passkey is 48213.", "The sky is blue.\nIt is often clear.", "Alpha beta."]
    found = recognise(llamaindex_prompt("what is the passkey?", passages), "user")
    assert found is not None and found.shape == "llamaindex_qa"
    assert found.rest == "what is the passkey?" and [p.text.strip() for p in found.passages] == passages
    command = client_command({"base_url": "http://127.0.0.1:1", "model": "x", "tokenizer": "/t", "max_tokens": 8,
                              "seed": 0}, Path("/d/p.jsonl"), 0.1, 5, Path("/d/out.json"))
    assert "--skip-chat-template" in command and command[command.index("--request-rate") + 1] == "0.1"
    assert command[command.index("--backend") + 1] == "openai-chat"
    assert summary({"completed": 5, "median_ttft_ms": 1500.0, "p95_ttft_ms": 3000.0})["p95_ttft_s"] == 3.0


@pytest.mark.full
def test_a_short_ladder_through_a_real_gateway_over_the_tiny_engine(tmp_path):
    """The gateway side of ``bench serving`` end to end, bounded: a gateway process over the tiny
    engine, two rates of four Poisson arrivals each, every request answered with its path."""
    from servers import START_TIMEOUT_S, GatewayProcess

    gateway = GatewayProcess(["--engine", "specprefill_rag.testing:tiny_engine"], tmp_path / "gateway.log")
    try:
        gateway.wait_ready(time.monotonic() + START_TIMEOUT_S)
        items = [{"question": "what is the passkey?", "ids": [0] * 40,
                  "passages": ["The grass is green. The sky is blue. " * 6, f"The passkey is {i}. " * 3]}
                 for i in range(3)]
        send = serving._senders(items, (0, "unused"), {"gateway": gateway.port}, max_tokens=2)["gateway"]
        result = serving.ladder({"gateway": send}, [20.0, 40.0], 4, seed=1)
    finally:
        gateway.stop()
    per_rate = result["per_rate"]["gateway"]
    assert all(s["answered"] == s["requests"] == 4 for s in per_rate.values())
    assert serving.goodput(per_rate, slo_s=60.0) == 40.0 and serving.goodput(per_rate, slo_s=0.0) is None
    assert serving.paths(result["rows"]) == {"gateway": {"20.0": {"pruned": 4}, "40.0": {"pruned": 4}}}


def _lexical_retriever():
    """A deterministic stand-in for the dense retriever (no embedder): the demo passages sharing
    the most words of four letters or more with the question, ties in collection order."""
    import re

    from specprefill_rag.tools.retrieval import demo_documents, split_passages

    texts = [p.text for p in split_passages(demo_documents())]
    words = [set(re.findall(r"[a-z]{4,}", t.lower())) for t in texts]

    def retrieve(question: str, k: int) -> list[str]:
        asked = set(re.findall(r"[a-z]{4,}", question.lower()))
        return [texts[i] for i in sorted(range(len(texts)), key=lambda i: (-len(asked & words[i]), i))[:k]]

    return retrieve


def test_the_reuse_mix_draws_recurring_passages_from_a_seeded_stream():
    """A default-size mix (the default ladder's requests) retrieves every passage it sends at
    least twice, popular passages across many sessions; the same seed gives the same requests."""
    from benchmarks.lib import reuse_mix

    args = serving.parse_args(["--mix", "reuse"])
    mix, pool, retrieve = serving.mix_of(args), reuse_mix.question_pool(args.pool), _lexical_retriever()
    assert len(pool) == len(set(pool)) == 32 and pool[0].startswith("Which vehicle")  # the demo questions first
    n = args.requests * len(args.rates)
    items = reuse_mix.draw(mix, pool, retrieve, n)
    stats = reuse_mix.mix_stats(items)
    assert stats["requests"] == n == 80 and stats["sessions"] == 40
    assert stats["min_draws"] >= 2 and stats["mean_draws"] > 4 and stats["mean_sessions_per_passage"] > 2
    assert stats["repeat_share"] > 0.5 and stats["distinct_prompts"] < n  # popular openers come again
    # a follow-up re-sends its session's retrieved set, after the next session's opener
    assert [(i["session"], i["turn"]) for i in items[:5]] == [(0, 0), (1, 0), (0, 1), (2, 0), (1, 1)]
    assert items[2]["passages"] == items[0]["passages"] and items[2]["question"] != items[0]["question"]
    assert all(len(i["passages"]) == args.top_k for i in items)
    assert reuse_mix.draw(mix, pool, retrieve, n) == items
    assert reuse_mix.draw(serving.mix_of(serving.parse_args(["--mix", "reuse", "--seed", "1"])), pool, retrieve,
                          n) != items
    uniform = reuse_mix.mix_stats(reuse_mix.draw(reuse_mix.ReuseMix(zipf=0.0), pool, retrieve, n))
    assert uniform["distinct_prompts"] > stats["distinct_prompts"]  # popularity makes prompts recur
    with pytest.raises(ValueError, match="follow_ups"):
        reuse_mix.ReuseMix(follow_ups=-1)


def test_the_passage_reading_side_reaches_the_gateway_command(monkeypatch):
    """--mix reuse runs direct, today's gateway (joint reading pinned) and gateway_apart (passages
    read apart, its disk tier where asked), each gateway process with its own flags."""
    from benchmarks.suites import gateway_load

    args = serving.parse_args(["--mix", "reuse", "--passage-store", "/tmp/ps", "--warm-passages"])
    assert args.sides == ["direct", "gateway", "gateway_apart"] and args.warm_passages
    assert serving.side_flags("gateway", args) == ["--read-passages", "joint"]
    assert serving.side_flags("gateway", serving.parse_args([])) == []  # the demo mix: today's command
    command = gateway_load.gateway_command(args, "http://127.0.0.1:1", 5, serving.side_flags("gateway_apart", args))
    at = command.index("--read-passages")
    assert command[at + 1] == "apart" and command[command.index("--passage-store") + 1] == "/tmp/ps"
    assert command[command.index("--port") + 1] == "5" and "--draft-memo" in command

    started = []

    class Recorded:
        def __init__(self, args, url, log, extra):
            self.port = 100 + len(started)
            started.append((url, log.name, list(extra)))

        def stop(self):
            started.append("stopped")

    monkeypatch.setattr(serving, "Gateway", Recorded)
    sides = serving.start_sides(args, "http://127.0.0.1:9")
    assert list(sides) == ["gateway_apart"]
    assert started == [("http://127.0.0.1:9", "gateway_apart.log", ["--read-passages", "apart", "--passage-store",
                                                                     "/tmp/ps"])]
    started.clear()
    both = serving.parse_args(["--sides", "direct", "gateway_skip", "gateway_apart"])
    assert list(serving.start_sides(both, "u")) == ["gateway_skip", "gateway_apart"]
    assert [flags for _, _, flags in started] == [["--skip-draft-when-slower"], ["--read-passages", "apart"]]

    class Failing(Recorded):
        def __init__(self, args, url, log, extra):
            if "apart" in extra:
                raise RuntimeError("the gateway exited with code 1")
            super().__init__(args, url, log, extra)

    started.clear()
    monkeypatch.setattr(serving, "Gateway", Failing)
    with pytest.raises(RuntimeError, match="exited"):
        serving.start_sides(both, "u")
    assert started[-1] == "stopped"  # the skip side started before it is not left running


@pytest.mark.full
def test_a_warmed_passage_reading_gateway_serves_the_ladder_from_its_store(tmp_path):
    """End to end, bounded: a gateway over the tiny engine whose draft reads passages apart,
    warmed through POST /v1/passages; every answer of a short ladder says its passages came
    from the store, and the summary sums them per side and rate."""
    from servers import START_TIMEOUT_S, GatewayProcess

    from benchmarks.lib import reuse_mix

    passages = ["The grass is green. The sky is blue. " * 4, "The passkey is 48213. " * 3, "The fox is quick. " * 5]
    gateway = GatewayProcess(["--engine", "specprefill_rag.testing:tiny_reading_engine"], tmp_path / "gateway.log")
    try:
        gateway.wait_ready(time.monotonic() + START_TIMEOUT_S)
        warmed = reuse_mix.warm_corpus(gateway.port, passages, serving.SYSTEM)
        items = [{"question": f"what is the passkey, {i}?", "ids": [0] * 40, "passages": passages[i:] + passages[:i]}
                 for i in range(3)]
        send = serving._senders(items, (0, "unused"), {"gateway_apart": gateway.port}, max_tokens=2)["gateway_apart"]
        result = serving.ladder({"gateway_apart": send}, [40.0], 3, seed=2)
    finally:
        gateway.stop()
    assert warmed["warmed"] and (warmed["read"], warmed["found"]) == (3, 0)
    rows = result["rows"]
    assert all(r["status"] == 200 and r["passages_cached"] == 3 and r["passages_read"] == 0 for r in rows), rows
    assert all("draft_cached_tokens" in r for r in rows)
    served = reuse_mix.served(rows)["gateway_apart"]["40.0"]
    assert served["answers"] == 3 and served["passages_cached"] == 9 and served["cached_share"] == 1.0
