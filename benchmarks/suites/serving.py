"""Goodput: the request rate a server sustains under a TTFT SLO, SpecPrefill through the gateway
against the same prompts sent straight to vLLM (full prefill), under open-loop arrivals.

As vLLM's own serving benchmark does with ``--request-rate``, requests arrive as a Poisson
process (exponential gaps, a fixed seed) whatever the server's state: a slow server builds a
queue instead of slowing the client down. For each rate of the ladder (``--rates``, requests per
second) and each side, ``--requests`` RAG prompts (a demo question and its top-k retrieved demo
passages, ``gateway_load``'s prompts) are sent at their arrival times:

    direct        POST vLLM /v1/completions, the prompt's token ids, streamed (full prefill)
    gateway       POST gateway /v1/chat/completions with the same question and passages, streamed
    gateway_skip  the same to a second gateway run with ``--skip-draft-when-slower``, which
                  prefills a prompt whole when the draft's queue would cost more than pruning saves
    gateway_apart a third gateway run with ``--read-passages apart``: its draft reads each passage
                  once and keeps the reading (its passage store; ``--passage-store DIR`` adds the
                  disk tier), so a passage seen before costs it nothing (``--warm-passages``:
                  the whole demo collection read ahead through ``POST /v1/passages`` first)

``--sides`` picks them; the order rotates per rate. Per rate and side: TTFT p50/p95/p99,
end-to-end latency, answered requests per second. The SLO is ``--slo-multiple`` times one
request's full-prefill TTFT measured alone at the start (median of 3, stated in the file); the
goodput of a side is the highest rate of the ladder at which it, and every lower rate, keeps p95
TTFT within the SLO. vLLM's main model and the gateway's draft run in one precision (``--dtype``).
One request alone through the gateway is timed too (median of 3): the single-request speedup the
loaded rates are held against. Each gateway row records the path its request took and what its
draft found in its stores (``passages_cached``, ``passages_read``, ``draft_cached_tokens``; summed
per side and rate in ``summary.served``).

``--mix`` chooses the prompts. ``demo`` (default): gateway_load's, each demo question with its
retrieved passages, the same ``--requests`` prompts at every rate. ``reuse``: a workload where
passages recur as in real RAG traffic (``benchmarks/lib/reuse_mix.py``): sessions open with a
question drawn by popularity (Zipf, ``--zipf``) from a pool of ``--pool`` questions over the demo
collection and its top-k retrieved set, then ``--follow-ups`` other questions re-send that set;
one seeded stream of ``3 + --requests × rates`` requests, the first 3 timed alone and each rate
sending the next ``--requests`` of it (the stores carry over from rate to rate, as a server's
would), the same prompts to every side. Under it the sides are direct, gateway (pinned to
``--read-passages joint``, its prefix store on: today's gateway) and gateway_apart, each gateway
timed alone too; ``summary.mix`` says how much of the stream recurs, ``summary.warm`` whether
gateway_apart was warmed. Its file is ``results/serving_reuse.json``.

    specprefill-rag bench serving                       # → benchmarks/results/serving.json
    specprefill-rag bench serving --mix reuse --warm-passages --dtype auto  # → results/serving_reuse.json
        # the read-once issue's goodput under load: Qwen 0.5B -> 1.5B, both in one precision (auto:
        # bf16 on a CPU that multiplies bf16 natively, else fp32); without --warm-passages
        # gateway_apart warms itself on first sight
    specprefill-rag bench serving --rates 0.05 0.1 --requests 4 --main smollm2-135m-instruct \\
        --draft smollm2-135m-instruct --out /tmp/s.json    # a quick run
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.lib import reuse_mix
from benchmarks.lib.machine import add_dtype_arg, command_line, machine_info
from benchmarks.lib.results import write_results
from benchmarks.suites.gateway_load import (
    ROOT,
    SYSTEM,
    Gateway,
    percentile,
    prompts,
    rag_ids,
    served_dtypes,
    serving_stack,
    stream,
)
from specprefill_rag.loading import DEFAULT_DRAFT, DEFAULT_MAIN, DTYPES

Send = Callable[[int], dict[str, Any]]  # request i → {"status", "ttft_s", ...}
SIDES = ("direct", "gateway", "gateway_skip", "gateway_apart")
DEFAULT_SIDES = {"demo": ["direct", "gateway", "gateway_skip"], "reuse": ["direct", "gateway", "gateway_apart"]}
ALONE = 3  # requests timed alone before the ladder (their median)


def arrival_times(rate: float, n: int, seed: int) -> list[float]:
    """Seconds from the start at which ``n`` requests arrive as a Poisson process of ``rate`` per
    second (exponential gaps; the first arrives at 0)."""
    if rate <= 0 or n < 1:
        raise ValueError(f"need a positive rate and at least one request, got rate={rate}, n={n}")
    rng = random.Random(seed)
    times = [0.0]
    for _ in range(n - 1):
        times.append(times[-1] + rng.expovariate(rate))
    return times


def open_loop(send: Send, times: Sequence[float]) -> list[dict[str, Any]]:
    """Send request i at ``times[i]`` seconds from now, each in its own thread, whether or not the
    earlier ones were answered; each row adds when it was sent (``sent_s``, from the start) and its
    end-to-end latency (``e2e_s``)."""
    rows: list[dict[str, Any]] = [{} for _ in times]
    start = time.perf_counter()

    def one(i: int) -> None:
        began = time.perf_counter()
        try:
            row = send(i)
        except OSError as error:  # the server dropped the connection: counted, not raised
            row = {"status": None, "ttft_s": None, "error": str(error)}
        rows[i] = {**row, "sent_s": began - start, "e2e_s": time.perf_counter() - began}

    threads = []
    for i, at in enumerate(times):
        time.sleep(max(0.0, at - (time.perf_counter() - start)))
        thread = threading.Thread(target=one, args=(i,), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    return rows


def rate_summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One side at one rate: TTFT percentiles and mean end-to-end latency of the answered
    requests, and answered requests per second over the span from the first send to the last
    answer."""
    answered = [r for r in rows if r.get("status") == 200 and r.get("ttft_s") is not None]
    ttfts = [r["ttft_s"] for r in answered]
    span = max((r["sent_s"] + r["e2e_s"] for r in rows), default=0.0) - min((r["sent_s"] for r in rows), default=0.0)
    return {
        "requests": len(rows), "answered": len(answered),
        "p50_ttft_s": percentile(ttfts, 0.5), "p95_ttft_s": percentile(ttfts, 0.95),
        "p99_ttft_s": percentile(ttfts, 0.99),
        "mean_e2e_s": statistics.fmean(r["e2e_s"] for r in answered) if answered else float("nan"),
        "answered_per_s": len(answered) / span if span > 0 else float("nan"),
    }


def goodput(per_rate: dict[float, dict[str, Any]], slo_s: float) -> float | None:
    """The highest rate at which this side, and every lower rate of the ladder, answered every
    request with p95 TTFT within ``slo_s``; None when even the lowest rate misses."""
    best = None
    for rate in sorted(per_rate):
        s = per_rate[rate]
        if s["answered"] < s["requests"] or not s["p95_ttft_s"] <= slo_s:
            break
        best = rate
    return best


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specprefill-rag bench serving", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--main", default=DEFAULT_MAIN)
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--rates", type=float, nargs="+", default=[0.025, 0.05, 0.1, 0.15, 0.2],
                   help="request rates of the ladder, per second (%(default)s)")
    p.add_argument("--requests", type=int, default=16, help="requests per rate and side (%(default)s)")
    p.add_argument("--slo-multiple", type=float, default=3.0,
                   help="the p95 TTFT SLO as a multiple of one full-prefill request's TTFT alone (%(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times (%(default)s)")
    p.add_argument("--top-k", type=int, default=8, help="retrieved demo passages per prompt (%(default)s)")
    p.add_argument("--keep-rate", type=float, default=0.1, help="the gateway's keep rate (%(default)s)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--clients", type=int, default=16,
                   help="requests the gateway and vLLM run at once (the gateway's --max-concurrency, vLLM's "
                   "--max-num-seqs) (%(default)s)")
    p.add_argument("--sides", nargs="+", choices=SIDES, default=None,
                   help="what each rate is sent to (default: direct gateway gateway_skip; with --mix reuse: "
                   "direct gateway gateway_apart)")
    p.add_argument("--mix", choices=sorted(DEFAULT_SIDES), default="demo",
                   help="the prompts: demo (each demo question once, the same at every rate) or reuse (passages "
                   "recur: a popularity draw from a question pool, follow-ups; module docstring) (%(default)s)")
    mix = reuse_mix.ReuseMix()
    p.add_argument("--pool", type=int, default=mix.pool, help="--mix reuse: questions in the pool (%(default)s)")
    p.add_argument("--zipf", type=float, default=mix.zipf,
                   help="--mix reuse: popularity exponent of the openers' draw, 0 uniform (%(default)s)")
    p.add_argument("--follow-ups", type=int, default=mix.follow_ups,
                   help="--mix reuse: questions per session after its opener, over its retrieved set (%(default)s)")
    p.add_argument("--warm-passages", action="store_true",
                   help="read the demo collection into gateway_apart's passage store (POST /v1/passages) before "
                   "the first request")
    p.add_argument("--passage-store", default=None, metavar="DIR",
                   help="gateway_apart's --passage-store (the disk tier; default: memory only)")
    p.add_argument("--vllm-client-rate", type=float, default=None,
                   help="also send the ladder's prompts at this rate through vLLM's own benchmark client "
                   "(vllm.benchmarks.serve, openai-chat) to vLLM and to the gateway (default: skip)")
    p.add_argument("--vllm-url", default=None, help="an existing vLLM server with the plugin (default: start one)")
    add_dtype_arg(p, whose="vLLM's main model (a server started here) and the gateway's draft")
    p.add_argument("--server-dtype", default=None, choices=DTYPES,
                   help="with --vllm-url: the dtype that server runs the main model in, recorded as the main model's")
    p.add_argument("--gateway-threads", type=int, default=None, help="torch threads of the gateway process")
    p.add_argument("--out", default=None,
                   help="result JSON (default benchmarks/results/serving.json; --mix reuse: serving_reuse.json)")
    args = p.parse_args(argv)
    args.sides = args.sides or list(DEFAULT_SIDES[args.mix])
    return args


def mix_of(args: argparse.Namespace) -> reuse_mix.ReuseMix:
    """The reuse mix ``args`` ask for (seeded by ``--seed``, ``--top-k`` passages per session)."""
    return reuse_mix.ReuseMix(pool=args.pool, zipf=args.zipf, follow_ups=args.follow_ups, top_k=args.top_k,
                              seed=args.seed)


def side_flags(side: str, args: argparse.Namespace) -> list[str]:
    """The flags a gateway side adds to the stack's command (``gateway_load.gateway_command``):
    the base gateway pinned to joint reading under ``--mix reuse`` (today's gateway, whatever the
    library's default becomes), the skip and passage-reading sides their own."""
    if side == "gateway":
        return ["--read-passages", "joint"] if args.mix == "reuse" else []
    if side == "gateway_skip":
        return ["--skip-draft-when-slower"]
    if side == "gateway_apart":
        return ["--read-passages", "apart", *(["--passage-store", args.passage_store] if args.passage_store else [])]
    raise ValueError(f"{side!r} is not a gateway side")


def start_sides(args: argparse.Namespace, vllm_url: str) -> dict[str, Gateway]:
    """A gateway process per side of ``args.sides`` beyond the stack's own (side → its process);
    those started are stopped when a later one fails."""
    started: dict[str, Gateway] = {}
    try:
        for side in args.sides:
            if side not in ("direct", "gateway"):
                log = ROOT / "benchmarks" / ".cache" / "serving" / f"{side}.log"
                started[side] = Gateway(args, vllm_url, log, side_flags(side, args))
    except BaseException:
        for gateway in started.values():
            gateway.stop()
        raise
    return started


def ladder_items(args: argparse.Namespace, tokenizer: Any) -> tuple[list[dict[str, Any]], int]:
    """The prompts every side sends (question, passages, the full prompt's ``ids``) and the index
    of the ladder's first: demo, gateway_load's prompts (timed alone and cycled at every rate: 0);
    reuse, ``ALONE`` + requests × rates of the mix (the first ``ALONE`` timed alone)."""
    if args.mix == "demo":
        return prompts(tokenizer, args.requests, args.top_k), 0
    from specprefill_rag.tools.retrieval import Retriever, demo_documents, split_passages

    retriever = Retriever(split_passages(demo_documents()))

    def retrieve(question: str, k: int) -> list[str]:
        return [p.text for p in retriever.retrieve(question, top_k=k)]

    items = reuse_mix.draw(mix_of(args), reuse_mix.question_pool(args.pool), retrieve,
                           ALONE + args.requests * len(args.rates))
    return [{**item, "ids": rag_ids(tokenizer, item["question"], item["passages"])} for item in items], ALONE


def warm(args: argparse.Namespace, ports: dict[str, int]) -> dict[str, Any]:
    """``--warm-passages``: the demo collection read into gateway_apart's store before any request."""
    if not (args.warm_passages and "gateway_apart" in ports):
        return {"warmed": False}
    from specprefill_rag.tools.retrieval import demo_documents, split_passages

    done = reuse_mix.warm_corpus(ports["gateway_apart"], [p.text for p in split_passages(demo_documents())], SYSTEM)
    print(f"warmed gateway_apart: {done['read']} passages read, {done['found']} held, {done['seconds']:.1f} s",
          flush=True)
    return done


def _senders(items: list[dict[str, Any]], vllm: tuple[int, str], gateways: dict[str, int], max_tokens: int
             ) -> dict[str, Send]:
    """Request i of each side (i indexes ``items`` cyclically): "direct" to vLLM, and one per
    gateway of ``gateways`` (side → port)."""
    def direct(i: int) -> dict[str, Any]:
        item = items[i % len(items)]
        body = {"model": vllm[1], "prompt": item["ids"], "max_tokens": max_tokens, "temperature": 0, "stream": True}
        return {"prompt_tokens": len(item["ids"]), **stream(vllm[0], "/v1/completions", body)}

    def gateway(port: int) -> Send:
        def send(i: int) -> dict[str, Any]:
            item = items[i % len(items)]
            body = {"model": "x", "messages": [{"role": "system", "content": SYSTEM},
                                                {"role": "user", "content": item["question"]}],
                    "max_tokens": max_tokens, "temperature": 0, "stream": True,
                    "specprefill": {"passages": item["passages"]}}
            return {"prompt_tokens": len(item["ids"]), **stream(port, "/v1/chat/completions", body)}
        return send

    return {"direct": direct, **{side: gateway(port) for side, port in gateways.items()}}


def _shifted(send: Send, by: int) -> Send:
    """``send`` with request i sent as request ``by + i``."""
    return lambda i: send(by + i)


def ladder(senders: dict[str, Send], rates: Sequence[float], n: int, seed: int, first: int = 0) -> dict[str, Any]:
    """Every side at every rate (the order rotating per rate): rows and summaries. Rate k sends
    requests ``first + k·n`` … ``first + k·n + n - 1`` (a sender cycles over fewer prompts)."""
    rows: list[dict[str, Any]] = []
    per_rate: dict[str, dict[float, dict[str, Any]]] = {side: {} for side in senders}
    for step, rate in enumerate(rates):
        times = arrival_times(rate, n, seed + step)
        order = list(senders)[step % len(senders):] + list(senders)[:step % len(senders)]
        for side in order:
            done = open_loop(_shifted(senders[side], first + step * n), times)
            rows += [{"side": side, "rate": rate, **row} for row in done]
            s = per_rate[side][rate] = rate_summary(done)
            print(f"{rate:g}/s {side:12s} p50 {s['p50_ttft_s']:.2f} s  p95 {s['p95_ttft_s']:.2f} s  "
                  f"answered {s['answered']}/{s['requests']}", flush=True)
    return {"rows": rows, "per_rate": per_rate}


def main(argv: Sequence[str] | None = None) -> int:
    from specprefill_rag.loading import load_tokenizer, resolve_model_dir

    args = parse_args(argv)
    with serving_stack(args, "serving", side_flags("gateway", args)) as stack:
        others = start_sides(args, f"http://127.0.0.1:{stack.vllm[0]}")
        try:
            items, first = ladder_items(args, load_tokenizer(resolve_model_dir(args.main)))
            ports = {"gateway": stack.gateway.port, **{side: g.port for side, g in others.items()}}
            result = measure(args, stack, items, first, ports)
        finally:
            for gateway in others.values():
                gateway.stop()
    summary = summarise(args, result, items[first:] if first else items)
    name = "serving_reuse" if args.mix == "reuse" else "serving"
    keys = ["rates", "requests", "slo_multiple", "seed", "top_k", "keep_rate", "max_tokens", "clients", "sides",
            "dtype", "mix", *(("pool", "zipf", "follow_ups", "warm_passages", "passage_store") if first else ())]
    payload = {
        "benchmark": "serving", "command": command_line(argv, "serving"), "machine": machine_info(),
        "models": {"main": args.main, "draft": args.draft}, "dtypes": served_dtypes(args, stack.server),
        "settings": {k: getattr(args, k) for k in keys}, "summary": summary, "rows": result["rows"],
    }
    path = write_results(name, payload, args.out)
    print(json.dumps(summary["goodput_per_s"]))
    print(f"wrote {path}")
    return 0


def measure(args: argparse.Namespace, stack: Any, items: list[dict[str, Any]], first: int, ports: dict[str, int]
            ) -> dict[str, Any]:
    """gateway_apart warmed (``--warm-passages``), each request alone (direct and every gateway
    side but the skipping one), then the ladder (and vLLM's own client where asked)."""
    senders = _senders(items, stack.vllm, ports, args.max_tokens)
    warmed = warm(args, ports)
    alone = {side: alone_ttft(senders[side]) for side in senders if side != "gateway_skip"}
    slo_s = args.slo_multiple * alone["direct"]
    print("alone: full prefill TTFT " + f"{alone['direct']:.2f} s, " + ", ".join(
        f"{side} {t:.2f} s ({alone['direct'] / t:.2f}x)" for side, t in alone.items() if side != "direct")
        + f"; SLO p95 TTFT <= {slo_s:.2f} s", flush=True)
    result = ladder({side: senders[side] for side in args.sides}, args.rates, args.requests, args.seed, first)
    if args.vllm_client_rate:
        result["vllm_client"] = standard_client(args, stack, items)
    return {**result, "alone": alone, "slo_s": slo_s, "warm": warmed}


def summarise(args: argparse.Namespace, result: dict[str, Any], sent: list[dict[str, Any]]) -> dict[str, Any]:
    """The file's summary: the alone TTFTs and the SLO, each side's goodput, per-rate summaries,
    paths, what the gateways' stores served, and under ``--mix reuse`` how much of the requests
    the ladder ``sent`` recur and whether gateway_apart was warmed."""
    per_rate, alone, slo_s = result["per_rate"], result["alone"], result["slo_s"]
    summary = {"alone_ttft_s": alone["direct"], "alone_gateway_ttft_s": alone["gateway"],
               "alone_speedup": alone["direct"] / alone["gateway"], "alone_ttft_by_side": alone, "slo_s": slo_s,
               "goodput_per_s": {side: goodput(per_rate[side], slo_s) for side in per_rate},
               "paths": paths(result["rows"]), "served": reuse_mix.served(result["rows"]),
               "vllm_client": result.get("vllm_client"),
               "per_rate": {side: {str(r): v for r, v in per_rate[side].items()} for side in per_rate}}
    if args.mix == "reuse":
        summary.update(mix=reuse_mix.mix_stats(sent), warm=result["warm"])
    return summary


def standard_client(args: argparse.Namespace, stack: Any, items: list[dict[str, Any]]) -> dict[str, Any]:
    """vLLM's own benchmark client at ``--vllm-client-rate``, to vLLM and to the gateway."""
    from benchmarks.lib.vllm_client import run_client
    from specprefill_rag.loading import resolve_model_dir

    rate, out = args.vllm_client_rate, {}
    for side, port, model in (("direct", stack.vllm[0], stack.vllm[1]), ("gateway", stack.gateway.port, "x")):
        target = {"base_url": f"http://127.0.0.1:{port}", "model": model, "max_tokens": args.max_tokens,
                  "tokenizer": str(resolve_model_dir(args.main)), "seed": args.seed}
        out[side] = run_client(target, items, rate, ROOT / "benchmarks" / ".cache" / "serving" / side)
        print(f"vLLM's client at {rate:g}/s, {side}: {out[side]}", flush=True)
    return {"rate": rate, **out}


def alone_ttft(send: Send) -> float:
    """The median TTFT of requests 0, 1 and 2 sent one at a time; a failed one raises."""
    ttfts = []
    for i in range(3):
        row = send(i)
        if row.get("status") != 200 or row.get("ttft_s") is None:
            raise RuntimeError(f"request {i} sent alone failed: {row}")
        ttfts.append(row["ttft_s"])
    return sorted(ttfts)[1]


def paths(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, int]]]:
    """Per gateway side and rate, how many requests took each path (``specprefill.path``)."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for row in rows:
        if row.get("path") is not None:
            counts = out.setdefault(row["side"], {}).setdefault(str(row["rate"]), {})
            counts[row["path"]] = counts.get(row["path"], 0) + 1
    return out


if __name__ == "__main__":
    raise SystemExit(main())
