"""The gateway under concurrent load: TTFT of N streaming clients at once, SpecPrefill through the
gateway vs the same prompts sent straight to vLLM (full prefill), side by side in one run.

One vLLM server with the plugin (started here unless ``--vllm-url``; prefix caching off so that
every prefill is cold) and one ``specprefill-rag gateway --backend vllm_server`` in front of it.
Each round starts ``--clients`` requests together (a barrier), each with its own RAG prompt (a
demo question and its top-k retrieved demo passages, the system prompt of the gateway docs):

    direct   POST vLLM /v1/completions, the prompt's token ids, streamed (full prefill)
    gateway  POST gateway /v1/chat/completions with the same question and passages, streamed

Rounds alternate direct, gateway, direct, ... TTFT is the time from sending the request to the
first streamed chunk that carries text. Every request must be answered (HTTP 200) or refused
with 429; each gateway answer is checked against the same prompt sent alone (no mixed outputs).
vLLM's main model and the gateway's draft run in one precision, ``--dtype`` (auto: the fastest
the machine offers, bfloat16 on a CPU with native bf16), so the direct baseline is vLLM served
at its best; the result file records both sides' dtypes.

    specprefill-rag bench gateway_load                      # → benchmarks/results/gateway_load.json
    specprefill-rag bench gateway_load --clients 4 --rounds 1 --main smollm2-135m-instruct \\
        --draft smollm2-135m-instruct --out /tmp/g.json    # a quick run
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.lib.machine import add_dtype_arg, command_line, machine_info, resolved_dtype, served_dtype
from benchmarks.lib.results import ROOT, write_results
from benchmarks.lib.reuse_mix import ANSWER_FACTS
from specprefill_rag.loading import DEFAULT_DRAFT, DEFAULT_MAIN, DTYPES

SYSTEM = "Answer the question using the context. Be concise."
READY_TIMEOUT_S = 900.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation, as numpy's default."""
    data = sorted(values)
    if not data:
        return float("nan")
    at = q * (len(data) - 1)
    low = int(at)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (at - low)


def stream(port: int, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
           ) -> dict[str, Any]:
    """POST an SSE request; returns status, TTFT (first chunk with text), the whole text and, from
    the gateway, the path the request took (``specprefill.path``: None from vLLM) and what its
    draft found in its stores (``ANSWER_FACTS`` of the ``specprefill`` object, when present)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=READY_TIMEOUT_S)
    began = time.perf_counter()
    ttft: float | None = None
    text = ""
    taken = None  # the gateway's specprefill.path
    facts: dict[str, Any] = {}
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        if response.status != 200:
            return {"status": response.status, "ttft_s": None, "text": response.read().decode()[:300]}
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            extension = chunk.get("specprefill") or {}
            taken = extension.get("path", taken)
            facts.update({k: extension[k] for k in ANSWER_FACTS if k in extension})
            for choice in chunk.get("choices", []):
                piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - began
                text += piece
        return {"status": 200, "ttft_s": ttft, "text": text, "path": taken, **facts}
    finally:
        conn.close()


def prompts(tokenizer: Any, n: int, top_k: int) -> list[dict[str, Any]]:
    """``n`` RAG prompts over the demo documents: question, passages and the full prompt's ids."""
    from specprefill_rag.tools.retrieval import Retriever, demo_documents, demo_questions, split_passages

    retriever = Retriever(split_passages(demo_documents()))
    questions = demo_questions()
    out = []
    for i in range(n):
        question = questions[i % len(questions)].question
        passages = [p.text for p in retriever.retrieve(question, top_k=top_k + i // len(questions))]
        out.append({"question": question, "passages": passages, "ids": rag_ids(tokenizer, question, passages)})
    return out


def rag_ids(tokenizer: Any, question: str, passages: Sequence[str]) -> list[int]:
    """The token ids of the RAG prompt the gateway builds of ``SYSTEM``, ``question`` and
    ``passages``: what the direct side sends vLLM."""
    from specprefill_rag import prompt as prompt_lib

    segments = prompt_lib.chat_segments([("system", SYSTEM), ("user", question)], list(passages))
    return [int(i) for i in prompt_lib.assemble(tokenizer, segments).token_ids.tolist()]


def gateway_command(args: argparse.Namespace, vllm_url: str, port: int, extra: Sequence[str] = ()) -> list[str]:
    """The command line of ``specprefill-rag gateway`` over ``vllm_url`` on ``port`` for these
    ``args`` (models, keep rate, concurrency, dtype, threads), then the flags ``extra``."""
    command = [sys.executable, "-m", "specprefill_rag.tools.cli", "gateway", "--backend", "vllm_server",
               "--vllm-url", vllm_url, "--main", args.main, "--draft", args.draft,
               "--keep-rate", str(args.keep_rate), "--max-concurrency", str(args.clients),
               "--max-queue", str(max(64, args.clients)), "--port", str(port), "--log-level", "warning",
               "--dtype", args.dtype, "--draft-memo", "0"]  # rounds repeat their prompts: every request is scored
    if args.gateway_threads:
        command += ["--threads", str(args.gateway_threads)]
    return command + list(extra)


class Gateway:
    """``specprefill-rag gateway`` in a subprocess (this interpreter), stopped when done."""

    def __init__(self, args: argparse.Namespace, vllm_url: str, log: Path, extra: Sequence[str] = ()) -> None:
        self.port = free_port()
        self._log = open(log, "wb")  # noqa: SIM115
        command = gateway_command(args, vllm_url, self.port, extra)
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the gateway exited with code {self.process.returncode} (log: {log})")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the gateway was not ready in {READY_TIMEOUT_S:.0f} s (log: {log})")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self._log.close()


def run_round(mode: str, items: list[dict[str, Any]], vllm: tuple[int, str], gateway_port: int,
              max_tokens: int) -> list[dict[str, Any]]:
    """All requests of one round, started together."""
    barrier = threading.Barrier(len(items))

    def one(item: dict[str, Any]) -> dict[str, Any]:
        if mode == "direct":
            body = {"model": vllm[1], "prompt": item["ids"], "max_tokens": max_tokens, "temperature": 0,
                    "stream": True}
            barrier.wait()
            return stream(vllm[0], "/v1/completions", body)
        body = {"model": "x", "messages": [{"role": "system", "content": SYSTEM},
                                            {"role": "user", "content": item["question"]}],
                "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "specprefill": {"passages": item["passages"]}}
        barrier.wait()
        return stream(gateway_port, "/v1/chat/completions", body)

    with ThreadPoolExecutor(len(items)) as pool:
        results = list(pool.map(one, items))
    return [{"mode": mode, "prompt_tokens": len(item["ids"]), **r} for item, r in zip(items, results, strict=True)]


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ("direct", "gateway"):
        mine = [r for r in rows if r["mode"] == mode]
        ttfts = [r["ttft_s"] for r in mine if r["status"] == 200 and r["ttft_s"] is not None]
        out[mode] = {
            "requests": len(mine), "answered": len(ttfts), "refused_429": sum(r["status"] == 429 for r in mine),
            "other_errors": sum(r["status"] not in (200, 429) for r in mine),
            "p50_ttft_s": percentile(ttfts, 0.5), "p95_ttft_s": percentile(ttfts, 0.95),
            "mean_ttft_s": statistics.fmean(ttfts) if ttfts else float("nan"),
        }
    direct, gateway = out["direct"], out["gateway"]
    out["p50_speedup"] = direct["p50_ttft_s"] / gateway["p50_ttft_s"] if gateway["answered"] else None
    out["p95_speedup"] = direct["p95_ttft_s"] / gateway["p95_ttft_s"] if gateway["answered"] else None
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specprefill-rag bench gateway_load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--main", default=DEFAULT_MAIN)
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--clients", type=int, default=16, help="concurrent streaming clients per round (%(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="rounds per mode, alternating (%(default)s)")
    p.add_argument("--top-k", type=int, default=8, help="retrieved demo passages per prompt (%(default)s)")
    p.add_argument("--keep-rate", type=float, default=0.2, help="the gateway's keep rate (%(default)s)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--vllm-url", default=None, help="an existing vLLM server with the plugin (default: start one)")
    add_dtype_arg(p, whose="vLLM's main model (a server started here) and the gateway's draft")
    p.add_argument("--server-dtype", default=None, choices=DTYPES,
                   help="with --vllm-url: the dtype that server runs the main model in (vLLM's --dtype; it does not "
                   "report it), recorded as the main model's")
    p.add_argument("--gateway-threads", type=int, default=None, help="torch threads of the gateway process")
    p.add_argument("--gateway-flag", action="append", default=[], dest="gateway_flags",
                   help="one more flag for the gateway, e.g. --gateway-flag=--no-draft-passes-in-order (repeatable)")
    p.add_argument("--out", default=None, help="result JSON (default benchmarks/results/gateway_load.json)")
    return p.parse_args(argv)


@dataclass
class Stack:
    """What a load benchmark runs against: vLLM (``server``, None for ``--vllm-url``), its port and
    served model id (``vllm``), and a gateway in front of it."""

    server: Any
    vllm: tuple[int, str]
    gateway: Gateway


@contextmanager
def serving_stack(args: argparse.Namespace, name: str, extra: Sequence[str] = ()) -> Iterator[Stack]:
    """vLLM with the plugin (started here unless ``--vllm-url``; prefix caching off, so that every
    prefill is cold) and ``specprefill-rag gateway`` in front of it (``extra``: more gateway flags),
    stopped at exit; their logs in benchmarks/.cache/``name``/."""
    from urllib.parse import urlparse

    from specprefill_rag.tools.vllm_process import LaunchOptions, VLLMServer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logs = ROOT / "benchmarks" / ".cache" / name
    logs.mkdir(parents=True, exist_ok=True)
    server = None
    if args.vllm_url is None:
        server = VLLMServer(args.main, launch=LaunchOptions(port=free_port(), log_path=logs / "vllm.log"),
                            max_model_len=4096, dtype=args.dtype,
                            extra_args=["--max-num-seqs", str(args.clients), "--no-enable-prefix-caching"])
        print("starting vLLM ...", flush=True)
        server.start(timeout=READY_TIMEOUT_S)
    url = server.url if server else args.vllm_url
    gateway = None
    try:
        gateway = Gateway(args, url, logs / "gateway.log", extra)
        models = json.loads(_get(url, "/v1/models"))["data"][0]["id"]
        yield Stack(server, (urlparse(url).port or 80, models), gateway)
    finally:
        if gateway is not None:
            gateway.stop()
        if server is not None:
            server.stop()


def main(argv: Sequence[str] | None = None) -> int:
    from specprefill_rag.loading import load_tokenizer, resolve_model_dir

    args = parse_args(argv)
    rows: list[dict[str, Any]] = []
    with serving_stack(args, "gateway_load", args.gateway_flags) as stack:
        items = prompts(load_tokenizer(resolve_model_dir(args.main)), args.clients, args.top_k)
        vllm, port = stack.vllm, stack.gateway.port
        print(f"{args.clients} clients, prompts of {min(len(i['ids']) for i in items)}–"
              f"{max(len(i['ids']) for i in items)} tokens", flush=True)
        # Each prompt alone through the gateway: the reference for mixed outputs; the first three
        # also straight to vLLM, for the single-request speedup of this run.
        lone = {i: run_round("gateway", [item], vllm, port, args.max_tokens)[0] for i, item in enumerate(items)}
        alone = {i: row["text"] for i, row in lone.items()}
        lone_direct = [run_round("direct", [items[i]], vllm, port, args.max_tokens)[0]["ttft_s"] for i in range(3)]
        alone_speedup = statistics.median(lone_direct) / statistics.median(lone[i]["ttft_s"] for i in range(3))
        print(f"one request alone: {alone_speedup:.2f}x sooner through the gateway", flush=True)
        for r in range(args.rounds):
            for mode in ("direct", "gateway") if r % 2 == 0 else ("gateway", "direct"):
                done = run_round(mode, items, vllm, port, args.max_tokens)
                for i, row in enumerate(done):
                    row["round"], row["client"] = r, i
                    if mode == "gateway" and row["status"] == 200:
                        row["same_as_alone"] = row["text"] == alone[i]
                rows += done
                s = summarise(done)[mode]
                print(f"round {r} {mode:8s} p50 {s['p50_ttft_s']:.2f} s  p95 {s['p95_ttft_s']:.2f} s  "
                      f"answered {s['answered']}/{s['requests']}", flush=True)
    summary = summarise(rows)
    gateway_rows = [r for r in rows if r["mode"] == "gateway" and r["status"] == 200]
    summary["gateway_same_as_alone"] = sum(r.get("same_as_alone", False) for r in gateway_rows)
    summary["gateway_answered"] = len(gateway_rows)
    summary["alone_speedup"] = alone_speedup
    summary["p50_vs_alone"] = summary["p50_speedup"] / alone_speedup if summary.get("p50_speedup") else None
    payload = {
        "benchmark": "gateway_load", "command": command_line(argv, "gateway_load"), "machine": machine_info(),
        "models": {"main": args.main, "draft": args.draft},
        "dtypes": served_dtypes(args, stack.server),
        "settings": {k: getattr(args, k) for k in ("clients", "rounds", "top_k", "keep_rate", "max_tokens", "dtype",
                                                    "gateway_flags")},
        "summary": summary, "rows": rows,
    }
    path = write_results("gateway_load", payload, args.out)
    print(json.dumps(summary, indent=1))
    print(f"wrote {path}")
    return 0


def served_dtypes(args: argparse.Namespace, server: Any) -> dict[str, str]:
    """Each side's precision: the draft's as the gateway resolves ``--dtype``; vLLM's main model's
    as the server started here logs it (``machine.served_dtype``), or ``--server-dtype`` for one
    started elsewhere (unrecorded without it)."""
    dtypes = {"draft": resolved_dtype(args.dtype)}
    main = served_dtype(server) if server is not None else args.server_dtype
    if main:
        dtypes["main"] = resolved_dtype(main)
    return dtypes


def _get(url: str, path: str) -> str:
    from urllib.parse import urlparse

    parsed = urlparse(url)
    conn = http.client.HTTPConnection(parsed.hostname or "127.0.0.1", parsed.port or 80, timeout=30)
    try:
        conn.request("GET", path)
        return conn.getresponse().read().decode()
    finally:
        conn.close()


if __name__ == "__main__":
    sys.exit(main())
