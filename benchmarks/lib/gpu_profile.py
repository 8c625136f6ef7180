"""What ``gpu_ttft`` checks once per pair and what ``--profile`` looks at: the backend's pruned
prefill against the all-ones-mask path it took before, the host synchronisations inside a pruned
prefill and a scoring call (CUDA's sync debug mode), and the torch profiler's tables over one
pruned prefill, one scoring call and one plain draft forward.
"""

from __future__ import annotations

import re
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.lib.gpu_pair import QUESTION_TOKENS, Context, synthetic_prompt
from benchmarks.lib.gpu_timing import first_token, plan_of, sync, timed
from benchmarks.lib.machine import cold


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
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
SYNC_CAUSES = ("aten::_local_scalar_dense", "aten::nonzero", "aten::_unique2", "aten::unique_consecutive",
                "aten::masked_select", "aten::repeat_interleave")
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
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
        if runtime_name(e.name) in LAUNCHES:
            launches += 1
            parent = e.cpu_parent.name if e.cpu_parent is not None else "(no operation)"
            ops.setdefault(parent, {"calls": 0, "launches": 0, "self_device_ms": 0.0, "self_cpu_ms": 0.0})
            ops[parent]["launches"] += 1
    by_kernel: dict[str, list[float]] = {}
    for e in kernels:
        by_kernel.setdefault(e.name, []).append((e.time_range.end - e.time_range.start) / 1e3)
    syncs = {name: {"count": 0, "cpu_ms": 0.0} for name in (*SYNC_CALLS, *SYNC_CAUSES, "cudaMemcpyAsync")}
    for e in cpu:
        name = runtime_name(e.name)
        if name in syncs:
            syncs[name]["count"] += 1
            syncs[name]["cpu_ms"] += float(e.cpu_time_total) / 1e3
    waits = {name: v for name, v in syncs.items() if v["count"] and name in SYNC_CALLS}
    causes = {name: v for name, v in syncs.items() if v["count"] and name in SYNC_CAUSES}
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
