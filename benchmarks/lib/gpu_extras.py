"""The earlier runs' measurements ``gpu_ttft`` repeats for its first pair (``pair_extras``):
concurrent requests in one batched draft pass, the look-ahead's attention through SDPA and through
the short path, the draft's peak memory, and the CUDA graphs the engine's warm-up captures (the
default's and each look-ahead variant's). Each runs ``guarded``: a failure on the GPU is recorded,
not raised, so it does not cost the TTFT tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from benchmarks.lib.gpu_pair import QUESTION_TOKENS, Context, free, scoring_s, synthetic_prompt
from benchmarks.lib.gpu_timing import sync, timed
from benchmarks.lib.lookahead import lookahead_variants
from benchmarks.lib.machine import cold


def concurrency_row(draft: Any, n: int, vocab: int, batch: int, reps: int) -> dict[str, Any]:
    """``batch`` concurrent requests of ``n`` tokens scored in one batched draft pass, against one."""
    prompts = [synthetic_prompt(n, vocab, seed=100 + b) for b in range(batch)]
    questions = [torch.arange(n - QUESTION_TOKENS, n) for _ in prompts]
    contexts = [~protected for _, protected, _ in prompts]
    one, many = [], []
    for _ in range(reps):
        one.append(timed(lambda: draft.score(prompts[0][0], question=questions[0], context=contexts[0]))[0])
        many.append(
            timed(lambda: draft.score_batch([p[0] for p in prompts], questions=questions, contexts=contexts))[0]
        )
    med = statistics.median
    row = {"n_tokens": n, "batch": batch, "one_s": med(one), "batch_s": med(many), "ratio": med(many) / med(one)}
    print(f"{batch} concurrent {n}-token requests: one batched draft pass {row['batch_s'] * 1e3:.0f} ms ="
          f" {row['ratio']:.2f}x one request's {row['one_s'] * 1e3:.0f} ms (target <= 3x)", flush=True)
    return row


def attention_rows(draft: Any, args: argparse.Namespace, vocab: int, lengths: Sequence[int]) -> list[dict[str, Any]]:
    """The default scoring with the look-ahead's attention through SDPA (before 2026-12-04) and
    through ``draft.attend_short_queries`` (the default since), side by side per length, the
    graphs captured anew for each path; with whether both picked the same look-ahead tokens and
    their largest score difference (bf16: within rounding, not zero)."""
    from specprefill_rag.draft.probe import SHORT_QUERY_TOKENS, short_query_limit

    graphs = draft.graphs
    one = argparse.Namespace(**{**vars(args), "concurrency": 0, "lengths": list(lengths)})
    seconds: dict[str, dict[int, float]] = {}
    scores: dict[str, dict[int, Any]] = {}
    try:
        for path, tokens in (("sdpa", 0), ("short", SHORT_QUERY_TOKENS)):
            draft.graphs = None
            with short_query_limit(tokens):
                capture_graphs(draft, one)
                for n in lengths:
                    ids, protected, _ = synthetic_prompt(n, vocab, seed=n)
                    scores.setdefault(path, {})[n] = draft.score(ids, question=torch.arange(n - QUESTION_TOKENS, n),
                                                                 context=~protected, config=cold(draft.config))
                    times = [scoring_s(draft, ids, protected, draft.config) for _ in range(args.reps)]
                    seconds.setdefault(path, {})[n] = statistics.median(times)
    finally:
        draft.graphs = graphs
    rows = []
    for n in lengths:
        a, b = scores["sdpa"][n], scores["short"][n]
        row = {"n_tokens": n, "sdpa_s": seconds["sdpa"][n], "short_s": seconds["short"][n],
               "ratio": seconds["short"][n] / seconds["sdpa"][n],
               "same_lookahead_tokens": a.lookahead_token_ids == b.lookahead_token_ids,
               "max_score_diff": float((a.scores - b.scores).abs().max()), "max_score": float(a.scores.abs().max())}
        rows.append(row)
        print(f"{n} tokens: default scoring with the look-ahead's attention through SDPA {row['sdpa_s'] * 1e3:.0f} ms,"
              f" short path {row['short_s'] * 1e3:.0f} ms ({row['ratio']:.2f}x); same look-ahead tokens:"
              f" {row['same_lookahead_tokens']}, largest score difference {row['max_score_diff']:.2e}"
              f" (largest score {row['max_score']:.2e})", flush=True)
    return rows


def memory_row(draft: Any, ids: torch.Tensor) -> dict[str, Any]:
    """Peak GPU memory added by a plain draft forward vs by scoring (same process, peaks reset)."""
    device = draft.device
    weights = sum(p.numel() * p.element_size() for p in draft.model.parameters())
    out: dict[str, Any] = {"length": int(ids.numel()), "source": "cuda", "draft_weight_bytes": weights}
    for kind in ("plain", "score"):
        gc.collect()
        torch.cuda.empty_cache()
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        if kind == "plain":
            with torch.inference_mode():
                draft.model(input_ids=ids.to(device).reshape(1, -1), use_cache=True, logits_to_keep=1)
        else:
            draft.score(ids)
        sync(device)
        out[kind] = {"delta_bytes": torch.cuda.max_memory_allocated(device) - before}
    p, s = out["plain"]["delta_bytes"], out["score"]["delta_bytes"]
    out["delta_ratio"] = s / max(p, 1)
    out["peak_ratio"] = (weights + s) / (weights + p)  # as if the draft ran alone: weights + activations
    return out


def concurrency_length(args: argparse.Namespace) -> int:
    """The prompt length of the concurrent-requests row."""
    return 8192 if 8192 in args.lengths else args.lengths[0]


def capture_graphs(draft: Any, args: argparse.Namespace) -> dict[str, Any]:
    """What the engine's warm-up does on a GPU (``DraftModel.capture_graphs``), for every length
    this run measures and for the concurrent batch at its length: the CUDA graphs of the
    look-ahead's forwards, timed, with the GPU memory their buffers hold. Nothing on a CPU."""
    device = draft.device
    cuda = device.type == "cuda"
    before = torch.cuda.memory_allocated(device) if cuda else 0
    start = time.perf_counter()
    config = dataclasses.replace(draft.config, graph_max_tokens=max(args.lengths))
    shapes = draft.capture_graphs(config)
    if args.concurrency > 1:
        batch = dataclasses.replace(config, graph_max_tokens=concurrency_length(args))
        shapes += draft.capture_graphs(batch, batches=(args.concurrency,))
    sync(device)
    row = {"shapes": shapes, "seconds": time.perf_counter() - start,
           "bytes": torch.cuda.memory_allocated(device) - before if cuda else 0}
    print(f"captured the look-ahead's CUDA graphs for {shapes} loop shapes in {row['seconds']:.1f} s,"
          f" holding {row['bytes'] / 2**20:.0f} MiB", flush=True)
    return row


def capture_variant_graphs(draft: Any, args: argparse.Namespace) -> int:
    """The graphs of each look-ahead variant whose label says "CUDA graphs" and whose loops have
    another shape than the default's (one token per forward): without them that variant would
    run eagerly under its label. Captured apart from the default's (``capture_graphs``), whose
    time and memory stay its own; returns the loop shapes captured (none on a CPU)."""
    return sum(draft.capture_graphs(dataclasses.replace(variant, graph_max_tokens=max(args.lengths)))
               for variant in lookahead_variants("cuda").values())  # labelled as on a GPU


def guarded(what: str, measure: Callable[[], Any], args: argparse.Namespace, payload: dict[str, Any]) -> Any:
    """``measure()``; where it fails on a GPU run, None, with the error in ``payload["errors"]``: a
    check, a profile or an extra must not cost the lent call the TTFT tables after it. A dry run
    (``--tiny``, what the tests run) raises it."""
    try:
        return measure()
    except Exception as error:
        if args.tiny:
            raise
        traceback.print_exc()
        payload["errors"].append({"what": what, "error": f"{type(error).__name__}: {str(error)[:500]}"})
        free(torch.device(payload["settings"]["device"]))
        return None


def pair_extras(ctx: Context, args: argparse.Namespace, payload: dict[str, Any], deadline: float,
                write: Callable[[], Any]) -> None:
    """The earlier runs' whole-run measurements for the first pair, each while time is left."""
    rows = payload["runs"][0]["lengths"]
    if not rows:
        return
    lengths = [row["n_tokens"] for row in rows]
    left = deadline - time.perf_counter()
    if args.concurrency > 1 and left > 30:
        payload["concurrency"] = guarded("concurrency", lambda: concurrency_row(
            ctx.draft, concurrency_length(args), ctx.vocab, args.concurrency, args.reps), args, payload)
        write()
    if deadline - time.perf_counter() > 60 or args.tiny:  # on a CPU (--tiny) both paths are SDPA: a dry run
        payload["attention"] = guarded("attention", lambda: attention_rows(ctx.draft, args, ctx.vocab, lengths),
                                       args, payload)
        write()
    if ctx.device.type == "cuda" and deadline - time.perf_counter() > 10:
        mem = guarded("memory", lambda: memory_row(ctx.draft, synthetic_prompt(lengths[-1], ctx.vocab, seed=1)[0]),
                      args, payload)
        if mem is not None:
            print(f"memory at {mem['length']} tokens: plain +{mem['plain']['delta_bytes'] / 2**20:.0f} MiB, scoring"
                  f" +{mem['score']['delta_bytes'] / 2**20:.0f} MiB ({mem['delta_ratio']:.2f}x of activations;"
                  f" {mem['peak_ratio']:.2f}x with the draft's weights)", flush=True)
        payload["memory"] = mem
        write()
