"""TTFT at real model sizes on one GPU: Llama-3.2-1B-shaped draft → Llama-3.1-8B-shaped main.

A prepared, self-contained script for one H200 (torch + transformers, no vLLM, no network,
no input files): both models are built from their published configs with random bf16 weights,
so only the timings mean anything (the kept tokens are whatever random attention picks; the
cost of scoring and of a prefill does not depend on the weights). The draft runs through the
library's real capture path (``DraftModel.score``: SDPA + hooks + look-ahead + scoring), the
selection is the library's ``selection.select``, and the main prefill feeds the kept tokens at
their original position ids exactly like the transformers backend.

Per length (4k/8k/16k/32k) and repetition, interleaved with a rotated order: full prefill, then
SpecPrefill at each keep rate with the library's default draft config (draft scoring + selection
+ main prefill of the kept tokens), SpecPrefill at 10% with the compared look-ahead
(``common.compared_lookahead``: greedy 8 over full forwards beside the early-exit default), a
plain draft forward, a draft forward with capture and no look-ahead, and the scoring of each
look-ahead variant of ``common.lookahead_variants`` (greedy or siblings after a full forward or
with early exit, greedy after an early exit one step per token beside the default's verified
guesses on CUDA, each replayed from CUDA graphs and eager, look-ahead 1 with early exit). The
look-ahead's CUDA graphs are captured once before any timing, as the engine's warm-up does
(``capture_graphs``: seconds and GPU memory reported). Then 8 concurrent 8k requests in
one batched draft pass. Reported like ``benchmarks/ttft.py``: TTFT full / spec, speedup,
breakdown, r, ideal 1/(r+k), efficiency, capture overhead per variant, and peak GPU memory of
scoring vs a plain draft forward. Stops before a length that would pass ``--time-budget-s``
(6 minutes), so one call of a lent GPU answers it. Where vLLM is installed, the plugin's position
rewrite in vLLM's V2 model runner is checked on the GPU against V2's own Triton kernel first
(``runner_v2_check.gpu_check``: "skipped" with the reason elsewhere).

    python benchmarks/gpu_ttft.py                       # H200: <= 6 min, writes benchmarks/results/gpu_ttft.json
    python benchmarks/gpu_ttft.py --tiny                # CPU dry run with tiny shapes (~1 min)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # `python benchmarks/gpu_ttft.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import runner_v2_check
from benchmarks.common import (
    cold,
    compared_lookahead,
    lookahead_label,
    lookahead_variants,
    machine_info,
    summarise_length,
    write_results,
)

# Published shapes (config.json of meta-llama/Llama-3.2-1B and Llama-3.1-8B).
LLAMA_3_2_1B: dict[str, Any] = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128256,
    tie_word_embeddings=True,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)
LLAMA_3_1_8B: dict[str, Any] = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
    tie_word_embeddings=False,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)
TINY_DRAFT: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
TINY_MAIN: dict[str, Any] = dict(TINY_DRAFT, hidden_size=128, intermediate_size=256, num_hidden_layers=4, head_dim=32)

INSTRUCTION_TOKENS = 32  # protected head of the prompt (system instructions)
QUESTION_TOKENS = 64  # protected tail (question + generation prompt)
PASSAGE_TOKENS = 512  # passage size; chunks never cross a passage boundary


def build(shape: dict[str, Any], dtype: torch.dtype, device: str, seed: int) -> Any:
    """A LlamaForCausalLM with ``shape`` and random weights, built directly on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**shape)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def synthetic_prompt(n: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token ids, protected mask, segment index) shaped like an assembled RAG prompt."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n,), generator=g)
    protected = torch.zeros(n, dtype=torch.bool)
    protected[:INSTRUCTION_TOKENS] = True
    protected[-QUESTION_TOKENS:] = True
    segment = torch.arange(n) // PASSAGE_TOKENS + 1
    segment[:INSTRUCTION_TOKENS] = 0
    segment[-QUESTION_TOKENS:] = int(segment.max()) + 1
    return ids, protected, segment


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def prefill(model: Any, ids: torch.Tensor, positions: torch.Tensor) -> int:
    """Main-model prefill of ``ids`` at ``positions`` (as the transformers backend does); first token."""
    device = next(model.parameters()).device
    ids = ids.to(device).reshape(1, -1)
    out = model(
        input_ids=ids,
        position_ids=positions.to(device).reshape(1, -1),
        attention_mask=torch.ones_like(ids),
        use_cache=True,
        logits_to_keep=1,
    )
    return int(out.logits[0, -1].argmax())  # .item() waits for the GPU


@torch.inference_mode()
def plain_forward(model: Any, ids: torch.Tensor) -> None:
    device = next(model.parameters()).device
    ids = ids.to(device).reshape(1, -1)
    model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1)
    sync(device)


def timed(fn: Any, *args: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def spec_ttft(
    draft: Any, main: Any, ids: torch.Tensor, protected: torch.Tensor, segment: torch.Tensor, keep: float,
    config: Any = None,
) -> dict[str, float]:
    """SpecPrefill's TTFT at ``keep`` with the draft's default config, or ``config``."""
    from specprefill_rag import SelectionConfig
    from specprefill_rag import selection as selection_lib

    start = time.perf_counter()
    n = ids.numel()
    # The engine's path: the question's tokens query the context (ends with .cpu(): synchronised).
    scores = draft.score(
        ids, question=torch.arange(n - QUESTION_TOKENS, n), context=~protected.to(ids.device),
        config=cold(config or draft.config),  # repetitions: the instructions read anew each time
    )
    scored = time.perf_counter()
    sel = SelectionConfig(keep_rate=keep, unit="chunk", min_prompt_tokens=0)  # synthetic ids: no sentences
    kept = selection_lib.select(scores.scores, protected, segment, sel)
    selected = time.perf_counter()
    prefill(main, ids[kept], kept)
    end = time.perf_counter()
    return {
        "ttft_s": end - start,
        "draft_s": scored - start,
        "selection_s": selected - scored,
        "prefill_s": end - selected,
        "keep_ratio": kept.numel() / ids.numel(),
    }


def scoring_s(draft: Any, ids: torch.Tensor, protected: torch.Tensor, config: Any) -> float:
    """Seconds of the draft's scoring with ``config`` (a look-ahead variant)."""
    n = ids.numel()
    start = time.perf_counter()
    draft.score(ids, question=torch.arange(n - QUESTION_TOKENS, n), context=~protected.to(ids.device),
                config=cold(config))
    return time.perf_counter() - start  # .cpu() at the end of scoring synchronises


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
    print(
        f"{batch} concurrent {n}-token requests: one batched draft pass {row['batch_s'] * 1e3:.0f} ms ="
        f" {row['ratio']:.2f}x one request's {row['one_s'] * 1e3:.0f} ms (target <= 3x)",
        flush=True,
    )
    return row


def attention_rows(draft: Any, args: argparse.Namespace, vocab: int, lengths: Sequence[int]) -> list[dict[str, Any]]:
    """The default scoring with the look-ahead's attention through SDPA (before 2026-12-04) and
    through ``attention.short_query_attention`` (the default since), side by side per length, the
    graphs captured anew for each path; with whether both picked the same look-ahead tokens and
    their largest score difference (bf16: within rounding, not zero)."""
    from specprefill_rag import attention

    saved, graphs = attention.SHORT_QUERY_TOKENS, draft.graphs
    one = argparse.Namespace(**{**vars(args), "concurrency": 0, "lengths": list(lengths)})
    seconds: dict[str, dict[int, float]] = {}
    scores: dict[str, dict[int, Any]] = {}
    try:
        for path, tokens in (("sdpa", 0), ("short", saved)):
            attention.SHORT_QUERY_TOKENS, draft.graphs = tokens, None
            capture_graphs(draft, one)
            for n in lengths:
                ids, protected, _ = synthetic_prompt(n, vocab, seed=n)
                scores.setdefault(path, {})[n] = draft.score(
                    ids, question=torch.arange(n - QUESTION_TOKENS, n), context=~protected, config=cold(draft.config))
                times = [scoring_s(draft, ids, protected, draft.config) for _ in range(args.reps)]
                seconds.setdefault(path, {})[n] = statistics.median(times)
    finally:
        attention.SHORT_QUERY_TOKENS, draft.graphs = saved, graphs
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
            plain_forward(draft.model, ids)
        else:
            draft.score(ids)
        sync(device)
        out[kind] = {"delta_bytes": torch.cuda.max_memory_allocated(device) - before}
    p, s = out["plain"]["delta_bytes"], out["score"]["delta_bytes"]
    out["delta_ratio"] = s / max(p, 1)
    out["peak_ratio"] = (weights + s) / (weights + p)  # as if the draft ran alone: weights + activations
    return out


def run_length(draft: Any, main: Any, n: int, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """Every measurement at ``n`` tokens, ``args.reps`` times, the order rotating per repetition."""
    ids, protected, segment = synthetic_prompt(n, vocab, seed=n)
    positions = torch.arange(n)

    def full(keep: float | None) -> dict[str, float]:
        seconds = timed(prefill, main, ids, positions)[0]
        return {"ttft_s": seconds, "prefill_s": seconds}

    def capture_once() -> None:
        draft.capture(ids, lookahead=1)
        sync(draft.device)

    variants = lookahead_variants(draft.device.type)
    measures: dict[str, Callable[[Any], Any]] = {
        "full": full,
        "spec": lambda keep: spec_ttft(draft, main, ids, protected, segment, keep),
        "spec_compared": lambda keep: spec_ttft(draft, main, ids, protected, segment, keep, compared_lookahead()[1]),
        "plain": lambda _: timed(plain_forward, draft.model, ids)[0],
        "capture": lambda _: timed(capture_once)[0],
        "lookahead": lambda name: scoring_s(draft, ids, protected, variants[name]),
    }
    items: list[tuple[str, Any]] = [
        ("full", None), *(("spec", k) for k in args.keep_rates), *(("spec_compared", k) for k in COMPARED_KEEP),
        ("plain", None), ("capture", None), *(("lookahead", name) for name in variants),
    ]
    raw: dict[tuple[str, Any], list[Any]] = {}
    for rep in range(args.reps):
        shift = rep % len(items)
        for what, arg in items[shift:] + items[:shift]:
            raw.setdefault((what, arg), []).append(measures[what](arg))
    row = summarise_length(n, n, raw, args.keep_rates, COMPARED_KEEP)
    report_length(row)
    return row


COMPARED_KEEP = (0.1,)  # keep rates also run with the compared look-ahead (common.compared_lookahead)


def report_length(row: dict[str, Any]) -> None:
    n, r, scoring = row["n_tokens"], row["r"], row["draft_scoring_s"]
    main_plain, draft_plain = row["main_plain_s"], row["draft_plain_s"]
    print(
        f"{n} tokens: main {main_plain * 1e3:.0f} ms, draft {draft_plain * 1e3:.0f} ms (r = {r:.3f}),"
        f" default scoring {scoring * 1e3:.0f} ms ({row['capture_overhead']:.2f}x, r of the scoring"
        f" {row['r_scoring']:.3f}; hooks alone {row['hook_overhead']:.2f}x)",
        flush=True,
    )
    for name, v in row["lookahead_scoring"].items():
        print(f"  scoring with {name}: {v['scoring_s'] * 1e3:.0f} ms = {v['overhead']:.2f}x, r = {v['r']:.3f}",
              flush=True)
    cells = [("", c) for c in row["cells"]] + [(f", {row['compared_label']}", c) for c in row["cells_compared"]]
    for label, c in cells:
        print(
            f"  keep {c['keep_rate']:.0%}{label}: spec {c['ttft_spec_s'] * 1e3:.0f} ms (draft {c['draft_s'] * 1e3:.0f}"
            f" + sel {c['selection_s'] * 1e3:.1f} + prefill {c['prefill_s'] * 1e3:.0f})  speedup {c['speedup']:.2f}x"
            f"  ideal {c['ideal']:.2f}x  efficiency {c['efficiency']:.2f}",
            flush=True,
        )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=None,
                   help="default 4096 8192 16384 32768 (tiny: 256 512)")
    p.add_argument("--keep-rates", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.5])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--lookahead", type=int, default=None, help="look-ahead L (default: the library's)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, CPU allowed: a dry run of the whole script")
    p.add_argument(
        "--time-budget-s",
        type=float,
        default=360.0,
        help="stop before a length whose estimated cost would pass this (default: 6 min)",
    )
    p.add_argument("--concurrency", type=int, default=8, help="requests scored in one batch (0: skip)")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def build_models(args: argparse.Namespace, device: str) -> tuple[Any, Any, int]:
    """(main model, DraftModel, vocabulary size) with random bf16 weights, warmed up on ``device``."""
    from specprefill_rag import DraftConfig
    from specprefill_rag.draft import DraftModel

    draft_shape, main_shape = (TINY_DRAFT, TINY_MAIN) if args.tiny else (LLAMA_3_2_1B, LLAMA_3_1_8B)
    print(f"building {'tiny' if args.tiny else 'Llama-3.2-1B / Llama-3.1-8B'}-shaped models"
          f" (random bf16) on {device} ...", flush=True)
    main_model = build(main_shape, torch.bfloat16, device, seed=1)
    config = cold(DraftConfig() if args.lookahead is None else DraftConfig(lookahead=args.lookahead))
    draft = DraftModel(build(draft_shape, torch.bfloat16, device, seed=2), None, config)
    vocab = int(draft_shape["vocab_size"])
    ids, protected, segment = synthetic_prompt(min(args.lengths), vocab, seed=0)
    prefill(main_model, ids, torch.arange(ids.numel()))
    spec_ttft(draft, main_model, ids, protected, segment, 0.3)
    for variant in lookahead_variants(draft.device.type).values():  # each look-ahead's kernels chosen before timing
        scoring_s(draft, ids, protected, variant)
    plain_forward(draft.model, ids)
    return main_model, draft, vocab


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


def new_payload(args: argparse.Namespace, device: str) -> dict[str, Any]:
    from specprefill_rag import DraftConfig

    config = DraftConfig() if args.lookahead is None else DraftConfig(lookahead=args.lookahead)
    return {
        "benchmark": "ttft",
        "command": "python benchmarks/gpu_ttft.py" + (" --tiny" if args.tiny else ""),
        "tiny": args.tiny,
        "reduced": False,
        "machine": machine_info(),
        "models": {
            "main": "tiny-llama (random)" if args.tiny else "Llama-3.1-8B-shaped (random bf16)",
            "draft": "tiny-llama (random)" if args.tiny else "Llama-3.2-1B-shaped (random bf16)",
        },
        "settings": {"lengths": args.lengths, "keep_rates": args.keep_rates, "reps": args.reps,
                     "lookahead": config.lookahead, "device": device, "dtype": "bfloat16",
                     "draft_config": dataclasses.asdict(config),
                     "lookahead_label": lookahead_label(config, torch.device(device).type),
                     "compared_keep_rates": list(COMPARED_KEEP)},
        "targets": {"efficiency": 0.85, "capture_overhead": 1.10, "memory": 1.15},
        "memory": None,
        "complete": False,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        print("no GPU: run with --tiny for a CPU dry run", file=sys.stderr)
        return 2
    device = "cuda" if cuda else "cpu"
    args.lengths = args.lengths or ([256, 512] if args.tiny else [4096, 8192, 16384, 32768])
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    main_model, draft, vocab = build_models(args, device)
    print(f"built and warmed up in {time.perf_counter() - started:.1f} s", flush=True)
    payload = new_payload(args, device)
    payload["graphs"] = capture_graphs(draft, args)
    payload["graphs"]["variant_shapes"] = capture_variant_graphs(draft, args)
    payload["vllm_v2_runner"] = v2 = runner_v2_check.gpu_check()  # the plugin's V2 rewrite, where vLLM is here
    print(f"vLLM V2 runner position rewrite: {v2['status']}" + (f" ({v2['why']})" if "why" in v2 else ""), flush=True)
    name = "gpu_ttft_tiny" if args.tiny else "gpu_ttft"
    rows: list[dict[str, Any]] = []
    last_s, last_n = 0.0, 1
    for n in args.lengths:
        # Cost grows between linearly and quadratically with n: skip what would not fit the budget.
        estimate = last_s * (n / last_n) ** 1.5
        if time.perf_counter() - started + estimate > args.time_budget_s:
            print(f"skipping {n} tokens: estimated {estimate:.0f} s would pass the {args.time_budget_s:.0f} s budget")
            break
        t0 = time.perf_counter()
        rows.append(run_length(draft, main_model, n, args, vocab))
        last_s, last_n = time.perf_counter() - t0, n
        payload["runs"] = [{"backend": "transformers", "status": "partial", "lengths": rows}]
        write_results(name, payload, args.out)
    if rows and args.concurrency > 1:
        payload["concurrency"] = concurrency_row(draft, concurrency_length(args), vocab, args.concurrency, args.reps)
        write_results(name, payload, args.out)
    if rows:  # on a CPU (--tiny) both paths are SDPA: a dry run of the comparison
        payload["attention"] = attention_rows(draft, args, vocab, [row["n_tokens"] for row in rows])
        write_results(name, payload, args.out)
    if cuda and rows:
        mem = memory_row(draft, synthetic_prompt(rows[-1]["n_tokens"], vocab, seed=1)[0])
        print(f"memory at {mem['length']} tokens: plain +{mem['plain']['delta_bytes'] / 2**20:.0f} MiB, scoring"
              f" +{mem['score']['delta_bytes'] / 2**20:.0f} MiB ({mem['delta_ratio']:.2f}x of activations;"
              f" {mem['peak_ratio']:.2f}x with the draft's weights)")
        payload["memory"] = mem
    payload["runs"] = [{"backend": "transformers", "status": "ok", "lengths": rows}]
    payload["complete"] = True
    payload["elapsed_s"] = time.perf_counter() - started
    path = write_results(name, payload, args.out)
    print(f"wrote {path} after {payload['elapsed_s']:.0f} s")
    return 0 if math.isfinite(payload["elapsed_s"]) else 1


if __name__ == "__main__":
    sys.exit(main())
