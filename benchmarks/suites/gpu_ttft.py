"""TTFT at real model sizes on one GPU, two draft → main pairs, every phase timed apart.

A prepared, self-contained script for one H100 or H200 (torch + transformers, no vLLM, no
network, no input files). Both pairs are built from their published configs with random
weights, directly on the GPU in bfloat16 (nothing is materialised in float32), so only the
timings mean anything; the cost of scoring and of a prefill does not depend on the weights:

- ``llama-1b-8b``: a Llama-3.2-1B-shaped draft → a Llama-3.1-8B-shaped main model;
- ``qwen-0.5b-32b``: a Qwen2.5-0.5B-shaped draft → a Qwen2.5-32B-shaped main model (64 GB in
  bf16: a realistic one-GPU serving pair). Its 32k point is 32,512 tokens: the published
  window is 32,768 and the look-ahead and the answer need positions after the prompt.

Both run the library's own path: ``DraftModel.score`` with whatever ``DraftConfig()`` holds at
run time (its fields are in the results; nothing reused between repetitions: ``machine.cold``),
``selection.select``, and ``TransformersBackend.prefill`` plus the first token for the main
model, pruned and full. Per length (2k … 32k) and repetition, in a rotated order: full prefill,
SpecPrefill at each keep rate (default 10%), a plain draft forward. Each phase is timed apart:
the draft's prompt forward, its look-ahead and its scoring (CUDA events recorded around the
draft's own steps, no synchronisation added), the selection, the main model's pruned prefill and
its full prefill (synchronised ``perf_counter``); medians of ``--reps`` after a warm-up. Speedup =
full TTFT / (draft + selection + pruned prefill); efficiency = speedup / (1 / (r + k)), r = plain
draft forward / full main prefill, k = the share prefilled. A length that would pass the time
budget or that does not fit the GPU's memory is skipped, and the results say so.

Per length, the warm cells beside the cold ones (``benchmarks/lib/warm_ttft.py``; ``--no-warm``
leaves them out): a RAG prompt built through segments, its passages read apart
(``DraftConfig.passages``) on first sight, then served from the passage store, then a follow-up
over them from the prefix store; each with its TTFT, speedup over the full prefill of that prompt
and the draft's share r, and the store's bytes per cached token.

Per pair, once: the pruned prefill's logits against the all-ones-mask path the backend took
before, and the host synchronisations inside a pruned prefill and a scoring call (CUDA's sync
debug mode). ``--profile``: the torch profiler over one pruned prefill, one scoring call and one
plain draft forward at 4k: top operations by GPU time and by kernel launches, kernels, host
synchronisations, and how much of the wall time the GPU was busy.

The first pair also measures what earlier runs did (``--no-extras`` leaves it out): SpecPrefill
with the compared look-ahead (``lookahead.compared_lookahead``), the scoring cost of each look-ahead
variant (``lookahead.lookahead_variants``), the capture hooks alone, 8 concurrent requests in one
batched draft pass, the look-ahead's attention through SDPA and through the short path
(``attention_rows``) and the draft's peak memory; and where vLLM is installed, the plugin's
position rewrite in vLLM's V2 runner (``runner_v2_check.gpu_check``).

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \\
    python -m benchmarks.suites.gpu_ttft --profile --out $OUT/gpu_ttft.json   # H100/H200: <= 6 min
    python -m benchmarks.suites.gpu_ttft --tiny                # both pairs, tiny shapes, CPU: seconds
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python -m benchmarks.suites.gpu_ttft \\
        --pairs llama-1b-8b --lengths 2048 4096 8192 --no-extras --out $OUT/gpu_ttft_warm.json
        # the read-once issue's GPU target: 1B -> 8B, keep 10%, warm >= 4x at 4k (H100: ~2 min)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from benchmarks.lib import runner_v2_check, warm_ttft
from benchmarks.lib.gpu_extras import attention_rows, capture_graphs, capture_variant_graphs, guarded, pair_extras
from benchmarks.lib.gpu_pair import (
    HEADROOM,
    PAIRS,
    TINY_DRAFT,
    TINY_PAIRS,
    Context,
    Pair,
    build_pair,
    free,
    out_of_memory,
    precision,
    scoring_s,
    spec_ttft,
    synthetic_prompt,
)
from benchmarks.lib.gpu_profile import checks, profile_rows, runtime_name
from benchmarks.lib.gpu_timing import full_prefill_s, sync, timed
from benchmarks.lib.lookahead import compared_lookahead, lookahead_label, lookahead_variants, summarise_length
from benchmarks.lib.machine import cold, dtype_name, machine_info
from benchmarks.lib.results import write_results

# The pairs, their checks and the first pair's extras live in benchmarks/lib/gpu_*.py; the names
# the other benches, the report and the tests read through this module stay here.
__all__ = [
    "HEADROOM", "TINY_DRAFT", "attention_rows", "capture_graphs", "capture_variant_graphs", "guarded", "main",
    "run_length", "runtime_name",
]

PROFILE_TOKENS = 4096  # the length --profile looks at (the nearest measured one otherwise)
COMPARED_KEEP = (0.1,)  # keep rates also run with the compared look-ahead (lookahead.compared_lookahead)
QWEN_SHARE = 0.5  # of the time budget, the part by which the Qwen pair (run first) must be done


def phase_medians(rows: list[dict[str, Any]], full: list[dict[str, float]]) -> dict[str, float | None]:
    """Each phase's median over the repetitions of one cell (None where it was not marked)."""
    med = statistics.median
    out: dict[str, float | None] = {}
    for name in ("draft_prefill_s", "lookahead_s", "scoring_s", "draft_other_s"):
        values = [r["phases"][name] for r in rows if r["phases"].get(name) is not None]
        out[name] = med(values) if values else None
    out["draft_s"] = med([r["draft_s"] for r in rows])
    out["selection_s"] = med([r["selection_s"] for r in rows])
    out["pruned_prefill_s"] = med([r["prefill_s"] for r in rows])
    out["full_prefill_s"] = med([f["prefill_s"] for f in full])
    return out


def run_length(ctx: Context, target: int, args: argparse.Namespace, extras: bool) -> dict[str, Any]:
    """Every measurement at ``target`` tokens (capped by the window), ``args.reps`` times, the
    order rotating per repetition; with ``extras`` the earlier runs' measurements too."""
    n = min(target, ctx.window)
    ids, protected, segment = synthetic_prompt(n, ctx.vocab, seed=n)
    draft = ctx.draft

    def capture_once() -> None:
        from specprefill_rag.draft.probe import LookaheadSpec

        draft.capture(ids, spec=LookaheadSpec(lookahead=1))
        sync(ctx.device)

    def full(_: Any) -> dict[str, float]:
        seconds = full_prefill_s(ctx.main, ids)
        return {"ttft_s": seconds, "prefill_s": seconds}

    variants = lookahead_variants(ctx.device.type) if extras else {}
    measures: dict[str, Callable[[Any], Any]] = {
        "full": full,
        "spec": lambda keep: spec_ttft(ctx, ids, protected, segment, keep),
        "plain": lambda _: full_prefill_s(ctx.draft_plain, ids),
        "spec_compared": lambda keep: spec_ttft(ctx, ids, protected, segment, keep, compared_lookahead()[1]),
        "capture": lambda _: timed(capture_once)[0],
        "lookahead": lambda name: scoring_s(draft, ids, protected, variants[name]),
    }
    items: list[tuple[str, Any]] = [("full", None), *(("spec", k) for k in args.keep_rates), ("plain", None)]
    if extras:
        items += [*(("spec_compared", k) for k in COMPARED_KEEP), ("capture", None),
                  *(("lookahead", name) for name in variants)]
    raw: dict[tuple[str, Any], list[Any]] = {}
    for rep in range(args.reps):
        shift = rep % len(items)
        for what, arg in items[shift:] + items[:shift]:
            raw.setdefault((what, arg), []).append(measures[what](arg))
    row = summarise_length(target, n, raw, args.keep_rates, COMPARED_KEEP if extras else ())
    for cell in row["cells"]:
        cell["phases"] = phase_medians(cell["raw"], raw[("full", None)])
        cell["n_kept"] = statistics.median([r["n_kept"] for r in cell["raw"]])
    report_length(ctx.pair, row)
    return row


def report_length(pair: Pair, row: dict[str, Any]) -> None:
    n, r = row["n_tokens"], row["r"]
    ms = 1e3
    print(f"[{pair.key}] {n} tokens: main {row['main_plain_s'] * ms:.0f} ms, draft {row['draft_plain_s'] * ms:.0f} ms"
          f" (r = {r:.3f}), default scoring {row['draft_scoring_s'] * ms:.0f} ms ({row['capture_overhead']:.2f}x)",
          flush=True)
    for name, v in row["lookahead_scoring"].items():
        print(f"  scoring with {name}: {v['scoring_s'] * ms:.0f} ms = {v['overhead']:.2f}x, r = {v['r']:.3f}",
              flush=True)
    cells = [("", c) for c in row["cells"]] + [(f", {row['compared_label']}", c) for c in row["cells_compared"]]
    for label, c in cells:
        p = c.get("phases") or {}
        split = "" if p.get("draft_prefill_s") is None else (
            f" = prompt {p['draft_prefill_s'] * ms:.0f} + look-ahead {p['lookahead_s'] * ms:.0f}"
            f" + scoring {p['scoring_s'] * ms:.0f} + rest {p['draft_other_s'] * ms:.0f}")
        print(f"  keep {c['keep_rate']:.0%}{label}: spec {c['ttft_spec_s'] * ms:.0f} ms (draft {c['draft_s'] * ms:.0f}"
              f"{split}; sel {c['selection_s'] * ms:.1f}; pruned prefill {c['prefill_s'] * ms:.0f} of"
              f" {c['keep_ratio']:.1%}) vs full {c['ttft_full_s'] * ms:.0f}: speedup {c['speedup']:.2f}x,"
              f" ideal {c['ideal']:.2f}x, efficiency {c['efficiency']:.2f}", flush=True)


# -- one pair ---------------------------------------------------------------------------------


def run_pair(pair: Pair, args: argparse.Namespace, device: str, dtype: torch.dtype, deadline: float,
             payload: dict[str, Any], write: Callable[[], Any]) -> Context | None:
    """Measure ``pair`` at every length that fits ``deadline`` and the GPU's memory into its run
    (``payload["runs"]``); returns the built pair (None where it could not be built)."""
    run: dict[str, Any] = {"backend": "transformers", "pair": pair.key, "status": "partial",
                           "models": {"draft": pair.draft_name, "main": pair.main_name},
                           "dtypes": {"main": dtype_name(dtype), "draft": dtype_name(dtype)},
                           "lengths": [], "skipped_lengths": []}
    payload["runs"][[p.key for p in args.pairs].index(pair.key)] = run
    try:
        started = time.perf_counter()
        ctx = build_pair(pair, args, device, dtype)
        run["built_s"] = time.perf_counter() - started
    except Exception as error:
        if not out_of_memory(error):
            raise
        run.update(status="skipped", reason=f"could not be built: {type(error).__name__}: {str(error)[:300]}")
        free(torch.device(device))
        write()
        return None
    run["precision"] = precision(ctx)
    extras = pair.extras and args.extras
    args_for_graphs = argparse.Namespace(**{**vars(args), "concurrency": args.concurrency if extras else 0})
    run["graphs"] = capture_graphs(ctx.draft, args_for_graphs)
    if extras:
        run["graphs"]["variant_shapes"] = capture_variant_graphs(ctx.draft, args)
        payload["graphs"] = run["graphs"]
    check_n = min(PROFILE_TOKENS if PROFILE_TOKENS in args.lengths else args.lengths[0], ctx.window)
    run["checks"] = guarded("checks", lambda: checks(ctx, check_n, args.keep_rates[0]), args, payload)
    write()
    run_lengths(ctx, run, args, deadline, payload, write)
    if args.profile and run["lengths"]:
        measured = [row["target_tokens"] for row in run["lengths"]]
        n = min(measured, key=lambda t: abs(math.log(t / PROFILE_TOKENS)))
        run["profile"] = guarded("profile", lambda: profile_rows(ctx, n, args.keep_rates[0]), args, payload)
    run["status"] = "ok" if run["lengths"] else "skipped"
    if not run["lengths"]:
        run["reason"] = "; ".join(sorted({s["why"] for s in run["skipped_lengths"]})) or "no length measured"
    write()
    return ctx


def run_lengths(ctx: Context, run: dict[str, Any], args: argparse.Namespace, deadline: float,
                payload: dict[str, Any], write: Callable[[], Any]) -> None:
    """Each of ``args.lengths`` into ``run["lengths"]``, shortest first, until the next would pass
    ``deadline`` (its cost estimated from the last) or the GPU's memory: it and the longer ones
    are then skipped, and ``run["skipped_lengths"]`` says why."""
    pair, extras = ctx.pair, ctx.pair.extras and args.extras
    last_s, last_n = 0.0, 1
    for target in args.lengths:
        estimate = last_s * (target / last_n) ** 1.5  # between linear and quadratic in n
        if time.perf_counter() + estimate > deadline:
            why = f"time budget: estimated {estimate:.0f} s would pass it"
            run["skipped_lengths"] += [{"n_tokens": t, "why": why} for t in args.lengths if t >= target]
            print(f"[{pair.key}] skipping {target} tokens and longer: {why}", flush=True)
            break
        t0 = time.perf_counter()
        try:
            row = run_length(ctx, target, args, extras)
            if args.warm:  # the same length with the passages read before (warm_ttft)
                row["warm"] = guarded(f"warm {target}", partial(warm_length, ctx, row["n_tokens"], args), args, payload)
        except Exception as error:
            if not out_of_memory(error):
                raise
            why = f"out of GPU memory: {str(error).splitlines()[0][:300]}"
            run["skipped_lengths"] += [{"n_tokens": t, "why": why} for t in args.lengths if t >= target]
            print(f"[{pair.key}] skipping {target} tokens and longer: {why}", flush=True)
            free(ctx.device)
            break
        run["lengths"].append(row)
        last_s, last_n = time.perf_counter() - t0, target
        free(ctx.device)
        write()


def warm_length(ctx: Context, n: int, args: argparse.Namespace) -> dict[str, Any]:
    """The warm cells at ``n`` tokens (``warm_ttft.warm_length``), printed."""
    row = warm_ttft.warm_length(ctx.draft, ctx.main, n, args.keep_rates, args.reps)
    warm_ttft.report(ctx.pair.key, row)
    return row


# -- the run ----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=None,
                   help="prompt lengths (default 2048 4096 8192 16384 32768; tiny: 256 512)")
    p.add_argument("--keep-rates", type=float, nargs="+", default=[0.1])
    p.add_argument("--reps", type=int, default=None, help="repetitions per cell, medians (default 3; tiny: 1)")
    p.add_argument("--lookahead", type=int, default=None, help="look-ahead L (default: the library's)")
    p.add_argument("--pairs", nargs="+", default=[p.key for p in PAIRS], choices=[p.key for p in PAIRS],
                   help="which pairs (default: both)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, CPU allowed: a dry run of the whole script")
    p.add_argument("--profile", action="store_true",
                   help="the torch profiler over a pruned prefill, a scoring call and a plain draft forward at 4k")
    p.add_argument("--no-extras", dest="extras", action="store_false",
                   help="leave out the first pair's look-ahead variants, concurrency, attention and memory rows")
    p.add_argument("--time-budget-s", type=float, default=360.0,
                   help="stop before a length whose estimated cost would pass this (default: 6 min)")
    p.add_argument("--concurrency", type=int, default=8, help="requests scored in one batch (0: skip)")
    p.add_argument("--no-warm", dest="warm", action="store_false",
                   help="leave out the warm cells (passages read before: benchmarks/lib/warm_ttft.py)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.lengths = sorted(args.lengths or ([256, 512] if args.tiny else [2048, 4096, 8192, 16384, 32768]))
    args.reps = args.reps or (1 if args.tiny else 3)
    return args


def new_payload(args: argparse.Namespace, device: str, dtype: torch.dtype, argv: Sequence[str] | None
                ) -> dict[str, Any]:
    from specprefill_rag import DraftConfig

    config = DraftConfig() if args.lookahead is None else DraftConfig(lookahead=args.lookahead)
    machine = machine_info()
    machine["cuda"] = torch.version.cuda
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        machine.update(gpu_memory_gib=round(props.total_memory / 2**30, 1), cudnn=torch.backends.cudnn.version(),
                       gpu_capability=f"{props.major}.{props.minor}")
    first = args.pairs[0]
    return {
        "benchmark": "ttft",
        "command": " ".join(["python -m benchmarks.suites.gpu_ttft", *(sys.argv[1:] if argv is None else argv)]),
        "tiny": args.tiny,
        "reduced": False,
        "machine": machine,
        "models": {"main": first.main_name, "draft": first.draft_name},
        "pairs": {p.key: {"draft": p.draft_name, "main": p.main_name} for p in args.pairs},
        "settings": {"lengths": args.lengths, "keep_rates": args.keep_rates, "reps": args.reps,
                     "lookahead": config.lookahead, "device": device, "dtype": dtype_name(dtype),
                     "draft_config": dataclasses.asdict(config),
                     "draft_config_timed": dataclasses.asdict(cold(config)),  # nothing reused between repetitions
                     "lookahead_label": lookahead_label(config, torch.device(device).type),
                     "compared_keep_rates": list(COMPARED_KEEP), "time_budget_s": args.time_budget_s,
                     "profile": args.profile, "extras": args.extras, "warm": args.warm,
                     "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") if device == "cuda" else None},
        "targets": {"efficiency": 0.85, "capture_overhead": 1.10, "memory": 1.15, "warm_speedup_at_4k": 4.0},
        "runs": [{"backend": "transformers", "pair": p.key, "status": "skipped", "reason": "not reached"}
                 for p in args.pairs],
        "memory": None,
        "errors": [],  # measurements beside the TTFT tables that failed on the GPU (``guarded``)
        "complete": False,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cuda = torch.cuda.is_available()
    if cuda:  # before the first allocation: the 32B model leaves ~15 GiB of an H100, fragments cost lengths
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if not cuda and not args.tiny:
        print("no GPU: run with --tiny for a CPU dry run", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    if not cuda:  # a dry run of tiny shapes: one thread (two on two shared cores spin ~80x slower)
        torch.set_num_threads(1)
    try:
        return _run(args, argv, "cuda" if cuda else "cpu")
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, argv: Sequence[str] | None, device: str) -> int:
    started = time.perf_counter()
    cuda = device == "cuda"
    # Both models in one precision: bf16 on a GPU (the fair comparison), the library's choice for
    # the CPU of a dry run (bf16 where it multiplies bf16 natively: ``loading.resolve_dtype``).
    from specprefill_rag.loading import resolve_dtype

    dtype = torch.bfloat16 if cuda else resolve_dtype("auto", "cpu")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    chosen = TINY_PAIRS if args.tiny else PAIRS
    args.pairs = [p for p in chosen if p.key in args.pairs]
    payload = new_payload(args, device, dtype, argv)
    name = "gpu_ttft_tiny" if args.tiny else "gpu_ttft"

    def write() -> Any:
        return write_results(name, payload, args.out)

    payload["vllm_v2_runner"] = v2 = runner_v2_check.gpu_check()  # the plugin's V2 rewrite, where vLLM is here
    print(f"vLLM V2 runner position rewrite: {v2['status']}" + (f" ({v2['why']})" if "why" in v2 else ""), flush=True)
    budget_end = started + args.time_budget_s
    # The pair without extras first (a fixed, predictable cost), then the one with them.
    for pair in sorted(args.pairs, key=lambda p: p.extras):
        deadline = budget_end if pair.extras else started + QWEN_SHARE * args.time_budget_s
        ctx = run_pair(pair, args, device, dtype, deadline, payload, write)
        if ctx is not None and pair.extras and args.extras and pair is args.pairs[0]:
            pair_extras(ctx, args, payload, budget_end, write)
        del ctx
        free(torch.device(device))
    payload["complete"] = True
    payload["elapsed_s"] = time.perf_counter() - started
    path = write()
    print(f"wrote {path} after {payload['elapsed_s']:.0f} s")
    return 0 if math.isfinite(payload["elapsed_s"]) else 1


if __name__ == "__main__":
    sys.exit(main())
