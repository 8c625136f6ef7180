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
import gc
import math
import os
import re
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks.lib import runner_v2_check, warm_ttft
from benchmarks.lib.gpu_timing import TimedPrompt, first_token, full_prefill_s, plan_of, pruned_ttft, sync, timed
from benchmarks.lib.lookahead import compared_lookahead, lookahead_label, lookahead_variants, summarise_length
from benchmarks.lib.machine import cold, dtype_name, machine_info
from benchmarks.lib.results import write_results

# Published shapes (config.json of meta-llama/Llama-3.2-1B and Llama-3.1-8B).
LLAMA_3_2_1B: dict[str, Any] = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
    head_dim=64, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)
LLAMA_3_1_8B: dict[str, Any] = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, vocab_size=128256, tie_word_embeddings=False, max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)
# Published shapes (config.json of Qwen/Qwen2.5-0.5B-Instruct and Qwen2.5-32B-Instruct; q/k/v
# projections with biases, as in every Qwen2).
QWEN2_5_0_5B: dict[str, Any] = dict(
    hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
    vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768, rms_norm_eps=1e-6,
    use_sliding_window=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)
QWEN2_5_32B: dict[str, Any] = dict(
    hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
    vocab_size=152064, tie_word_embeddings=False, max_position_embeddings=32768, rms_norm_eps=1e-6,
    use_sliding_window=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)
TINY_DRAFT: dict[str, Any] = dict(  # 8 layers: its early exit sits below its last, so it reads passages apart
    hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=512, tie_word_embeddings=True, max_position_embeddings=8192,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
TINY_MAIN: dict[str, Any] = dict(TINY_DRAFT, hidden_size=128, intermediate_size=256, num_hidden_layers=4, head_dim=32)


@dataclass(frozen=True)
class Pair:
    """A draft → main pair: model family and the two shapes."""

    key: str
    draft_name: str
    main_name: str
    family: str  # "llama" or "qwen2"
    draft: dict[str, Any]
    main: dict[str, Any]
    extras: bool  # also the earlier runs' measurements (look-ahead variants, concurrency, ...)


PAIRS = (
    Pair("llama-1b-8b", "Llama-3.2-1B-shaped (random bf16)", "Llama-3.1-8B-shaped (random bf16)", "llama",
         LLAMA_3_2_1B, LLAMA_3_1_8B, extras=True),
    Pair("qwen-0.5b-32b", "Qwen2.5-0.5B-shaped (random bf16)", "Qwen2.5-32B-shaped (random bf16)", "qwen2",
         QWEN2_5_0_5B, QWEN2_5_32B, extras=False),
)
TINY_PAIRS = (
    Pair("llama-1b-8b", "tiny-llama (random)", "tiny-llama (random)", "llama", TINY_DRAFT, TINY_MAIN, extras=True),
    Pair("qwen-0.5b-32b", "tiny-qwen2 (random)", "tiny-qwen2 (random)", "qwen2",
         dict(TINY_DRAFT, head_dim=16), dict(TINY_MAIN, head_dim=32), extras=False),
)

INSTRUCTION_TOKENS = 32  # protected head of the prompt (system instructions)
QUESTION_TOKENS = 64  # protected tail (question + generation prompt)
PASSAGE_TOKENS = 512  # passage size; chunks never cross a passage boundary
HEADROOM = 256  # positions left after the prompt (look-ahead, answer) where a window caps a length
PROFILE_TOKENS = 4096  # the length --profile looks at (the nearest measured one otherwise)
COMPARED_KEEP = (0.1,)  # keep rates also run with the compared look-ahead (lookahead.compared_lookahead)
QWEN_SHARE = 0.5  # of the time budget, the part by which the Qwen pair (run first) must be done


def build(family: str, shape: dict[str, Any], dtype: torch.dtype, device: str, seed: int) -> Any:
    """A causal LM of ``family`` with ``shape`` and random weights, built directly on ``device``
    in ``dtype`` (no float32 copy: a 32B model's bf16 weights alone fill most of one GPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    config_class, model_class = classes[family]
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_class._from_config(config_class(**shape), dtype=dtype, attn_implementation="sdpa")
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


@dataclass
class Context:
    """One pair, built: the main model behind the library's backend, the draft, its plain-forward
    backend (the draft's weights served like the main model, for r) and the vocabulary."""

    pair: Pair
    main: Any  # TransformersBackend
    draft: Any  # DraftModel
    draft_plain: Any  # TransformersBackend over the draft's weights
    vocab: int
    window: int  # the longest prompt both models take, with HEADROOM positions after it

    @property
    def device(self) -> torch.device:
        return self.draft.device


def spec_ttft(ctx: Context, ids: torch.Tensor, protected: torch.Tensor, segment: torch.Tensor, keep: float,
              config: Any = None) -> dict[str, Any]:
    """SpecPrefill's TTFT at ``keep`` with the draft's config (or ``config``), phase by phase;
    nothing read from a store (repetitions send the same prompt)."""
    n = ids.numel()
    prompt = TimedPrompt(ids, protected, segment, torch.arange(n - QUESTION_TOKENS, n))
    return pruned_ttft(ctx.draft, ctx.main, prompt, keep, cold(config or ctx.draft.config))


def scoring_s(draft: Any, ids: torch.Tensor, protected: torch.Tensor, config: Any) -> float:
    """Seconds of the draft's scoring with ``config`` (a look-ahead variant)."""
    n = ids.numel()
    start = time.perf_counter()
    draft.score(ids, question=torch.arange(n - QUESTION_TOKENS, n), context=~protected, config=cold(config))
    return time.perf_counter() - start  # .cpu() at the end of scoring synchronises


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


# -- checks and the profiler ------------------------------------------------------------------


def mask_check(ctx: Context, n: int, keep: float) -> dict[str, Any]:
    """The backend's pruned prefill (no mask: ``MASK_FREE``) against the path it took before (an
    explicit all-ones mask) at ``n`` tokens: the largest logit difference and the first token."""
    ids, protected, segment = synthetic_prompt(n, ctx.vocab, seed=n)
    kept = torch.cat([torch.arange(0, n, max(2, round(1 / keep))), torch.tensor([n - 1])]).unique()
    plan = plan_of(ids, kept, n)
    model, device = ctx.main.model, ctx.device
    with torch.inference_mode():
        ours = ctx.main.prefill(plan).logits
        before = model(input_ids=plan.token_ids.reshape(1, -1).to(device),
                       position_ids=plan.position_ids.reshape(1, -1).to(device),
                       attention_mask=torch.ones(1, plan.n_kept, dtype=torch.int64, device=device),
                       use_cache=True, logits_to_keep=1).logits[0, -1].float()
    return {"n_tokens": n, "n_kept": plan.n_kept, "mask_free": bool(ctx.main.mask_free),
            "max_abs_logit_diff": float((ours - before).abs().max()), "max_abs_logit": float(before.abs().max()),
            "same_first_token": int(ours.argmax()) == int(before.argmax())}


def host_syncs(device: torch.device, fn: Callable[[], Any]) -> dict[str, Any]:
    """The host synchronisations ``fn`` makes on a CUDA device (``torch.cuda.set_sync_debug_mode``
    warns at each), with where each was made; not countable on a CPU."""
    if device.type != "cuda":
        return {"count": None, "why": "not a CUDA device"}
    sync(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    found = [w for w in caught if "synchroniz" in str(w.message).lower()]
    sites = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in found)
    return {"count": len(found), "where": dict(sites.most_common())}


def checks(ctx: Context, n: int, keep: float) -> dict[str, Any]:
    """What the backend's prefill computes and where the host waits, at ``n`` tokens."""
    ids, protected, segment = synthetic_prompt(n, ctx.vocab, seed=n)
    kept = torch.arange(0, n, max(2, round(1 / keep)))
    plan = plan_of(ids, kept, n)
    question = torch.arange(n - QUESTION_TOKENS, n)
    with torch.inference_mode():
        prefill = host_syncs(ctx.device, lambda: ctx.main.prefill(plan))
    scoring = host_syncs(ctx.device, lambda: ctx.draft.score(ids, question=question, context=~protected,
                                                              config=cold(ctx.draft.config)))
    return {"mask_free_vs_ones_mask": mask_check(ctx, n, keep),
            "host_syncs": {"pruned_prefill_without_first_token": prefill, "draft_scoring": scoring}}


# Where the host waits (the runtime calls) and what makes it wait (the operations: ``item``,
# ``bool``, ``int`` of a tensor all reach ``_local_scalar_dense``; sizes that depend on data).
_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
_SYNC_CAUSES = ("aten::_local_scalar_dense", "aten::nonzero", "aten::_unique2", "aten::unique_consecutive",
                "aten::masked_select", "aten::repeat_interleave")
_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
             "cuGraphLaunch", "cudaLaunchCooperativeKernel")


def runtime_name(name: str) -> str:
    """A CUDA runtime/driver call's name without the suffixes some CUPTI versions report
    (``cudaLaunchKernel_v7000``, ``cudaMemcpy_ptds``), so the tables above match it."""
    return re.sub(r"(_v\d+|_ptsz|_ptds)+$", "", name)


def profile_table(prof: Any, wall_s: float, top: int = 15) -> dict[str, Any]:
    """One profiled call in numbers: the wall time, the GPU's busy time (kernels), kernel launches
    and which operation made them, the top operations by GPU time and by launches, the top
    kernels, and every host synchronisation the profiler saw."""
    events = [e for e in prof.events() if not getattr(e, "is_async", False)]
    kernels = [e for e in events if e.device_type != torch.autograd.DeviceType.CPU]
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    ops: dict[str, dict[str, float]] = {}
    for e in cpu:
        if e.name.startswith(("cuda", "cu")):
            continue
        row = ops.setdefault(e.name, {"calls": 0, "launches": 0, "self_device_ms": 0.0, "self_cpu_ms": 0.0})
        row["calls"] += 1
        row["self_device_ms"] += float(getattr(e, "self_device_time_total", 0.0)) / 1e3
        row["self_cpu_ms"] += float(e.self_cpu_time_total) / 1e3
    launches = 0
    for e in cpu:
        if runtime_name(e.name) in _LAUNCHES:
            launches += 1
            parent = e.cpu_parent.name if e.cpu_parent is not None else "(no operation)"
            ops.setdefault(parent, {"calls": 0, "launches": 0, "self_device_ms": 0.0, "self_cpu_ms": 0.0})
            ops[parent]["launches"] += 1
    by_kernel: dict[str, list[float]] = {}
    for e in kernels:
        by_kernel.setdefault(e.name, []).append((e.time_range.end - e.time_range.start) / 1e3)
    syncs = {name: {"count": 0, "cpu_ms": 0.0} for name in (*_SYNC_CALLS, *_SYNC_CAUSES, "cudaMemcpyAsync")}
    for e in cpu:
        name = runtime_name(e.name)
        if name in syncs:
            syncs[name]["count"] += 1
            syncs[name]["cpu_ms"] += float(e.cpu_time_total) / 1e3
    waits = {name: v for name, v in syncs.items() if v["count"] and name in _SYNC_CALLS}
    causes = {name: v for name, v in syncs.items() if v["count"] and name in _SYNC_CAUSES}
    top_level_cpu = sum(float(e.cpu_time_total) for e in cpu if e.cpu_parent is None) / 1e6
    busy = sum(sum(v) for v in by_kernel.values()) / 1e3

    def ranked(key: str) -> list[dict[str, Any]]:
        rows = sorted(ops.items(), key=lambda kv: -kv[1][key])[:top]
        return [{"op": name, **{k: round(v, 4) for k, v in row.items()}} for name, row in rows if row[key] > 0]

    return {
        "wall_s": wall_s,
        "gpu_busy_s": busy,
        "gpu_busy_share": busy / wall_s if wall_s else None,
        "kernels": len(kernels),
        "launches": launches,
        "host_time_outside_ops_s": wall_s - top_level_cpu,  # Python and framework code between operations
        "top_ops_by_device_time": ranked("self_device_ms"),
        "top_ops_by_launches": ranked("launches"),
        "top_ops_by_host_time": ranked("self_cpu_ms"),
        "top_kernels": [{"kernel": name[:160], "count": len(v), "total_ms": round(sum(v), 4)}
                        for name, v in sorted(by_kernel.items(), key=lambda kv: -sum(kv[1]))[:top]],
        "host_syncs": waits,  # the runtime calls that block the host (a CUDA device only)
        "host_sync_causes": causes,  # the operations that make them (a scalar read, a data-dependent size)
        "copies": syncs["cudaMemcpyAsync"]["count"],  # host<->device copies, blocking or not
    }


def profile_rows(ctx: Context, n: int, keep: float) -> dict[str, Any]:
    """The torch profiler over one pruned prefill (the plan the draft's scores give at ``keep``),
    one scoring call and one plain draft forward at ``n`` tokens, each after an unprofiled run."""
    from torch.profiler import ProfilerActivity, profile

    from specprefill_rag import SelectionConfig
    from specprefill_rag import selection as selection_lib

    n = min(n, ctx.window)
    ids, protected, segment = synthetic_prompt(n, ctx.vocab, seed=n)
    question = torch.arange(n - QUESTION_TOKENS, n)
    config = cold(ctx.draft.config)
    scores = ctx.draft.score(ids, question=question, context=~protected, config=config)
    kept = selection_lib.select(scores.scores, protected, segment,
                                SelectionConfig(keep_rate=keep, unit="chunk", min_prompt_tokens=0))
    plan, full = plan_of(ids, kept, n), plan_of(ids, torch.arange(n), n)
    calls: dict[str, Callable[[], Any]] = {
        "pruned_prefill": lambda: first_token(ctx.main, plan),
        "draft_scoring": lambda: ctx.draft.score(ids, question=question, context=~protected, config=config),
        "plain_draft_forward": lambda: first_token(ctx.draft_plain, full),
    }
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
    out: dict[str, Any] = {"n_tokens": n, "n_kept": int(kept.numel()),
                           "note": "wall times under the profiler are inflated; compare counts and shares"}
    for name, call in calls.items():
        call()
        sync(ctx.device)
        with profile(activities=activities) as prof:  # each call ends on a host read: nothing left queued
            wall, _ = timed(call)
        sync(ctx.device)  # outside: the harness's own wait is not the call's
        out[name] = profile_table(prof, wall)
        t = out[name]
        print(f"[{ctx.pair.key}] profile of {name} at {n} tokens: {t['wall_s'] * 1e3:.1f} ms wall, GPU busy"
              f" {t['gpu_busy_s'] * 1e3:.1f} ms, {t['launches']} launches, host waits"
              f" {sum(v['count'] for v in t['host_syncs'].values())} (scalar reads and data-dependent sizes:"
              f" {sum(v['count'] for v in t['host_sync_causes'].values())})", flush=True)
    return out


# -- the earlier runs' measurements (the first pair) ------------------------------------------


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


# -- one pair ---------------------------------------------------------------------------------


def build_pair(pair: Pair, args: argparse.Namespace, device: str, dtype: torch.dtype) -> Context:
    """The pair on ``device`` in ``dtype`` behind the library's classes, warmed up."""
    from specprefill_rag import DraftConfig
    from specprefill_rag.backends.transformers import TransformersBackend
    from specprefill_rag.draft import DraftModel

    print(f"[{pair.key}] building {pair.draft_name} → {pair.main_name} on {device} ...", flush=True)
    main = TransformersBackend(build(pair.family, pair.main, dtype, device, seed=1), None, name=pair.main_name)
    config = DraftConfig() if args.lookahead is None else DraftConfig(lookahead=args.lookahead)
    draft = DraftModel(build(pair.family, pair.draft, dtype, device, seed=2), None, config)
    window = min(draft.max_context, main.max_context) - HEADROOM
    ctx = Context(pair, main, draft, TransformersBackend(draft.model, None, name=pair.draft_name),
                  min(int(pair.draft["vocab_size"]), int(pair.main["vocab_size"])), window)
    n = min(min(args.lengths), window)
    ids, protected, segment = synthetic_prompt(n, ctx.vocab, seed=0)
    full_prefill_s(ctx.main, ids)
    spec_ttft(ctx, ids, protected, segment, args.keep_rates[0])
    full_prefill_s(ctx.draft_plain, ids)
    if pair.extras and args.extras:
        for variant in lookahead_variants(ctx.device.type).values():  # kernels chosen before timing
            scoring_s(draft, ids, protected, variant)
    return ctx


def precision(ctx: Context) -> dict[str, Any]:
    """Every dtype the run computes in: weights, KV caches, the scoring's softmax, TF32, SDPA's
    kernels allowed."""
    state = ctx.main.prefill(plan_of(torch.zeros(8, dtype=torch.int64), torch.arange(8), 8))
    out: dict[str, Any] = {
        "main_weights": dtype_name(next(ctx.main.model.parameters()).dtype),
        "draft_weights": dtype_name(next(ctx.draft.model.parameters()).dtype),
        "main_kv_cache": dtype_name(state.cache.layers[0].keys.dtype),
        "main_logits": dtype_name(state.logits.dtype),
        "scoring": "float32 (the library's logits and softmax)",
        "attention": ctx.main.model.config._attn_implementation,
        "draft_attention": ctx.draft.model.config._attn_implementation,
    }
    if ctx.device.type == "cuda":
        out["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
        out["sdpa_backends"] = {"flash": torch.backends.cuda.flash_sdp_enabled(),
                                "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                                "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
                                "math": torch.backends.cuda.math_sdp_enabled()}
    return out


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


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
    if args.profile and run["lengths"]:
        measured = [row["target_tokens"] for row in run["lengths"]]
        n = min(measured, key=lambda t: abs(math.log(t / PROFILE_TOKENS)))
        run["profile"] = guarded("profile", lambda: profile_rows(ctx, n, args.keep_rates[0]), args, payload)
    run["status"] = "ok" if run["lengths"] else "skipped"
    if not run["lengths"]:
        run["reason"] = "; ".join(sorted({s["why"] for s in run["skipped_lengths"]})) or "no length measured"
    write()
    return ctx


def warm_length(ctx: Context, n: int, args: argparse.Namespace) -> dict[str, Any]:
    """The warm cells at ``n`` tokens (``warm_ttft.warm_length``), printed."""
    row = warm_ttft.warm_length(ctx.draft, ctx.main, n, args.keep_rates, args.reps)
    warm_ttft.report(ctx.pair.key, row)
    return row


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
