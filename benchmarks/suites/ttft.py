"""TTFT benchmark: full prefill vs SpecPrefill on one backend, in one run, interleaved.

For every prompt length, each repetition runs (in an order rotated per repetition, so slow
drift of a shared machine spreads over all rows): the full-prefill baseline, SpecPrefill at
every keep rate, a plain draft forward (no capture) and a draft forward with capture on and
no look-ahead. Both models run in one precision, ``--dtype`` (auto: the fastest the device
offers), so the baseline is the main model at its best; each run records each side's dtype and
the file the machine's best (``settings.best_dtype``, ``machine.cpu_native_bf16``), which the
report checks before it headlines a speedup. Reported per cell (medians over repetitions):

    TTFT full, TTFT SpecPrefill, speedup = full / spec, breakdown (draft scoring, selection,
    main prefill), r = plain draft forward / plain main forward (both measured here),
    ideal = 1 / (r + k) with k the share of the prompt actually prefilled, efficiency = speedup / ideal.

Per length: capture overhead = draft scoring (prefill + look-ahead + scoring) / plain draft
forward, and hook-only overhead = capture without look-ahead / plain draft forward. At the
longest length, peak memory of scoring vs a plain draft forward, each measured in a fresh
subprocess: on GPU torch.cuda.max_memory_allocated; on CPU the same quantity, the weights plus
the peak of what the run allocated (glibc malloc statistics sampled every millisecond; process
RSS is recorded beside it, and used where glibc is missing).

    specprefill-rag bench ttft --lengths 1024 2048 --keep-rates 0.1 0.3 --reps 1
    python -m benchmarks.suites.ttft --tiny --lengths 256 --reps 1          # smoke run, random models
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from benchmarks.lib.essay_prompts import QUESTION, build_passages, essay_passages
from benchmarks.lib.lookahead import compared_lookahead, lookahead_label, lookahead_variants, summarise_length
from benchmarks.lib.machine import (
    add_dtype_arg,
    best_dtype,
    cold,
    command_line,
    machine_info,
    model_dtypes,
    offline,
    resolved_dtype,
)
from benchmarks.lib.peak_memory import memory_child, memory_run, replace_memory
from benchmarks.lib.results import result_name, write_results
from benchmarks.lib.tiny import tiny_engine
from benchmarks.lib.ttft_timing import capture_only_s, generation_config, plain_forward_s, scoring_s
from specprefill_rag.loading import DEFAULT_DRAFT, DEFAULT_MAIN, DTYPES, resolve_device, resolve_dtype

# The prompts, single measurements and memory runs live in benchmarks/lib/ (essay_prompts,
# ttft_timing, peak_memory); the names the other benches and the tests read here stay here.
__all__ = [
    "QUESTION", "build_draft_config", "build_passages", "draft_token_ids", "essay_passages", "main", "memory_child",
    "parse_args", "plain_forward_s", "run_dtypes", "with_draft_config",
]

TARGETS = {"efficiency": 0.85, "capture_overhead": 1.10, "memory": 1.15}


# -- the benchmark ---------------------------------------------------------------------------


def build_draft_config(args: argparse.Namespace) -> Any:
    from specprefill_rag import DraftConfig

    # Repetitions send the same prompt again: no score memo or prefix store, every one is scored whole.
    return cold(DraftConfig() if args.lookahead is None else DraftConfig(lookahead=args.lookahead))


def with_draft_config(engine: Any, draft: Any) -> Any:
    """An engine on the same backend and draft model, scoring with ``draft`` (a look-ahead variant),
    every request scored whole (``machine.cold``)."""
    from specprefill_rag import SpecPrefillEngine

    return SpecPrefillEngine(engine.backend, engine.draft, dataclasses.replace(engine.config, draft=cold(draft)))


def build_engine(args: argparse.Namespace, backend: str) -> Any:
    from specprefill_rag import SelectionConfig, SpecPrefillConfig, SpecPrefillEngine
    from specprefill_rag.backends import create_backend, loads_torch_model
    from specprefill_rag.draft import DraftModel
    from specprefill_rag.tools.vllm_process import server_dtype

    config = SpecPrefillConfig(
        draft=build_draft_config(args),
        selection=SelectionConfig(min_prompt_tokens=0),
        generation=generation_config(),
    )
    if args.tiny:
        return tiny_engine(config)
    if backend == "vllm_server":
        main = create_backend("vllm_server", args.main, base_url=args.server_url)
    elif loads_torch_model(backend):
        main = create_backend(backend, args.main, device=args.device, dtype=args.dtype)
    else:  # vLLM in this process: the precision a server started here gets
        main = create_backend(backend, args.main, dtype=server_dtype(args.dtype) or "auto")
    draft = DraftModel.from_pretrained(args.draft, config.draft, device=args.device, dtype=args.dtype)
    return SpecPrefillEngine(main, draft, config)


def run_dtypes(engine: Any, backend: str, args: argparse.Namespace) -> dict[str, str]:
    """Each side's precision: the torch models' own; a vLLM main model's as vLLM was asked for it
    (``--server-dtype`` for a server started elsewhere, which does not report it). A main model
    whose precision is not known here goes unrecorded, and the report does not headline its run."""
    from specprefill_rag.tools.vllm_process import server_dtype

    dtypes = model_dtypes(engine)
    if "main" not in dtypes:
        asked = args.server_dtype if backend == "vllm_server" else server_dtype(args.dtype)
        if asked:
            dtypes["main"] = resolved_dtype(asked)
    return dtypes


def draft_token_ids(engine: Any, prompt: Any) -> torch.Tensor:
    """The prompt as the draft reads it: the main tokens, or its own rendering for a cross-family draft."""
    from specprefill_rag import prompt as prompt_lib

    if not engine.maps_tokens:
        return prompt.token_ids
    return prompt_lib.assemble(engine.draft.tokenizer, prompt.segments).token_ids


@dataclass
class _Length:
    """One prompt length under measurement: its passages, prompt and the draft's token ids."""

    engine: Any
    passages: list[Any]
    assembled: Any
    ids: Any
    gen: Any


def _measure_full(c: _Length, keep: float | None) -> dict[str, float]:
    res = c.engine.generate(QUESTION, c.passages, mode="full", generation=c.gen)
    return {"ttft_s": res.timings.ttft_s, "prefill_s": res.timings.prefill_s}


def _measure_spec(c: _Length, keep: float | None, draft: Any = None) -> dict[str, float]:
    """SpecPrefill at ``keep`` with the engine's draft config, or ``draft`` instead."""
    from specprefill_rag import SelectionConfig

    assert keep is not None
    engine = c.engine if draft is None else with_draft_config(c.engine, draft)
    res = engine.generate(QUESTION, c.passages, selection=SelectionConfig(keep_rate=keep, min_prompt_tokens=0),
                          generation=c.gen)
    t = res.timings
    return {"ttft_s": t.ttft_s, "draft_s": t.draft_s or 0.0, "selection_s": t.selection_s or 0.0,
            "prefill_s": t.prefill_s, "keep_ratio": res.keep_ratio}


# What is timed, by name: each returns one repetition's measurement (arg: the spec keep rate, or
# the name of a look-ahead variant).
MEASURES: dict[str, Callable[[_Length, Any], Any]] = {
    "full": _measure_full,
    "spec": _measure_spec,
    "spec_compared": lambda c, keep: _measure_spec(c, keep, compared_lookahead()[1]),
    "plain": lambda c, keep: plain_forward_s(c.engine.draft.model, c.ids),
    "capture": lambda c, keep: capture_only_s(c.engine.draft, c.ids),
    "lookahead": lambda c, name: scoring_s(c.engine, c.assembled, lookahead_variants()[name]),
}


def run_length(engine: Any, target: int, args: argparse.Namespace, bar: Any) -> dict[str, Any]:
    """Every measurement of one prompt length, ``args.reps`` times, the order rotating per repetition."""
    passages, n_tokens = build_passages(engine, target)
    assembled = engine.assemble(QUESTION, passages)
    case = _Length(engine, passages, assembled, draft_token_ids(engine, assembled), generation_config())
    raw: dict[tuple[str, Any], list[Any]] = {}
    items = measured_items(args)
    for rep in range(args.reps):
        shift = rep % len(items)
        for what, arg in items[shift:] + items[:shift]:
            shown = "" if arg is None else f" {arg:.0%}" if isinstance(arg, float) else f" {arg}"
            bar.set_postfix_str(f"{target} tok, rep {rep + 1}, {what}{shown}")
            if hasattr(engine.backend, "cache_salt"):
                # vLLM's prefix cache would serve a repeated prompt from memory: every request gets a
                # salt of its own, so each prefill is measured cold.
                engine.backend.cache_salt = f"bench-{target}-{rep}-{what}-{arg}-{time.time_ns()}"
            raw.setdefault((what, arg), []).append(MEASURES[what](case, arg))
            bar.update(1)
    return summarise_length(target, n_tokens, raw, args.keep_rates, args.compared_keep_rates)


def measured_items(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """What one repetition of a length runs, in order (rotated per repetition)."""
    items: list[tuple[str, Any]] = [("full", None), *(("spec", k) for k in args.keep_rates), ("plain", None)]
    items += [("spec_compared", k) for k in args.compared_keep_rates]
    if not args.no_capture_breakdown:
        items += [("capture", None), *(("lookahead", name) for name in lookahead_variants())]
    return items


def run_backend(backend: str, args: argparse.Namespace, save: Any = None) -> dict[str, Any]:
    from specprefill_rag.backends import available_backends

    if backend not in available_backends():
        reason = f"backend {backend!r} is not registered in this checkout (available: {available_backends()})"
        print(f"[{backend}] skipped: {reason}", flush=True)
        return {"backend": backend, "status": "skipped", "reason": reason}
    if backend == "vllm_server" and not args.server_url:
        reason = "--server-url was not given (start the server first, see docs/vllm.md)"
        print(f"[{backend}] skipped: {reason}", flush=True)
        return {"backend": backend, "status": "skipped", "reason": reason}
    started = time.perf_counter()
    try:
        engine = build_engine(args, backend)
    except Exception as error:  # a missing server or optional dependency: report, do not crash the run
        reason = f"{type(error).__name__}: {error}"
        print(f"[{backend}] skipped: {reason}", flush=True)
        return {"backend": backend, "status": "skipped", "reason": reason}
    dtypes = run_dtypes(engine, backend, args)
    print(f"[{backend}] models ready in {time.perf_counter() - started:.1f} s ({dtypes}); warming up ...", flush=True)
    warm = ["Warm-up context about essays and startups. " * 30]
    engine.generate("Warm-up?", warm, mode="full", generation=generation_config())
    engine.generate("Warm-up?", warm, keep_rate=0.5, generation=generation_config())
    per_rep = len(measured_items(args))
    lengths = []
    with tqdm(total=len(args.lengths) * args.reps * per_rep, desc=f"ttft [{backend}]", unit="run") as bar:
        for target in args.lengths:
            lengths.append(run_length(engine, target, args, bar))
            print_length(lengths[-1])
            if save is not None:  # partial results survive an interrupted run
                save({"backend": backend, "status": "partial", "dtypes": dtypes, "lengths": lengths})
    del engine
    gc.collect()
    return {"backend": backend, "status": "ok", "dtypes": dtypes, "lengths": lengths}


def print_length(row: dict[str, Any]) -> None:
    print(
        f"\n{row['n_tokens']} tokens: main plain {row['main_plain_s']:.2f} s, draft plain {row['draft_plain_s']:.2f} s,"
        f" r = {row['r']:.3f}, draft scoring {row['draft_scoring_s']:.2f} s"
        f" (capture overhead {row['capture_overhead']:.2f}x)",
        flush=True,
    )
    compared = [(f", {row.get('compared_label')}", c) for c in row.get("cells_compared", [])]
    for label, c in [("", c) for c in row["cells"]] + compared:
        print(
            f"  keep {c['keep_rate']:.0%}{label}: full {c['ttft_full_s']:.2f} s  spec {c['ttft_spec_s']:.2f} s"
            f" (draft {c['draft_s']:.2f} + sel {c['selection_s']:.3f} + prefill {c['prefill_s']:.2f})"
            f"  speedup {c['speedup']:.2f}x  ideal {c['ideal']:.2f}x  efficiency {c['efficiency']:.2f}",
            flush=True,
        )
    for name, v in row.get("lookahead_scoring", {}).items():
        print(f"  scoring with {name}: {v['scoring_s']:.2f} s = {v['overhead']:.2f}x a plain draft forward,"
              f" r = {v['r']:.3f}", flush=True)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="specprefill-rag bench ttft", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--main", default=DEFAULT_MAIN, help="main model (%(default)s)")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model (%(default)s)")
    p.add_argument(
        "--backend",
        nargs="+",
        default=["transformers"],
        help="main-model backends to run, in turn: transformers and/or vllm_server (%(default)s)",
    )
    p.add_argument("--server-url", default=None, help="vllm_server backend: http://HOST:PORT of `vllm serve`")
    p.add_argument(
        "--server-dtype", default=None, choices=DTYPES,
        help="vllm_server backend: the dtype the server at --server-url runs the main model in (vLLM's --dtype; "
        "`specprefill-rag serve` gives the CPU's fastest: bfloat16 where it multiplies bf16 natively). vLLM does "
        "not report it: recorded as the main model's; without it the report does not headline the run",
    )
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096], help="prompt lengths (tokens)")
    p.add_argument("--keep-rates", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.5])
    p.add_argument("--reps", type=int, default=3, help="repetitions per cell; medians are reported")
    p.add_argument("--lookahead", type=int, default=None, help="look-ahead L (default: the library's)")
    p.add_argument(
        "--compared-keep-rates", type=float, nargs="*", default=[0.1],
        help="keep rates also run with the compared look-ahead (benchmarks/lib/lookahead.compared_lookahead: "
        "greedy 8 over full forwards beside the early-exit default), side by side",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_dtype_arg(p)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument(
        "--memory-length", type=int, default=None, help="prompt length of the memory runs (default: longest)"
    )
    p.add_argument(
        "--memory-only",
        action="store_true",
        help="only the peak-memory subprocesses; their result replaces the memory entry of the existing result file",
    )
    p.add_argument(
        "--no-capture-breakdown", action="store_true",
        help="skip the capture-without-look-ahead run and the scoring runs of the other look-ahead variants",
    )
    p.add_argument("--tiny", action="store_true", help="tiny random models (smoke run; numbers mean nothing)")
    p.add_argument(
        "--out",
        default=None,
        help="result JSON (default benchmarks/results/ttft.json; another draft, main model or backend "
        "gets its own file: ttft_draft-NAME.json, ttft_vllm_server.json, ...)",
    )
    p.add_argument("--_memory-child", dest="memory_child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    offline(args.threads)
    if args.memory_child:
        print(json.dumps(memory_child(args.memory_child, args.draft, args.lengths[-1], args.tiny, args.device,
                                      args.dtype)))
        return 0
    command = command_line(argv, "ttft")
    payload = new_payload(args, command)
    name = result_name("ttft", main=args.main, draft=args.draft, backends=args.backend, tiny=args.tiny)
    if not args.no_memory or args.memory_only:
        payload["memory"] = memory_run(args, payload["settings"]["memory_length"])
    if args.memory_only:
        return replace_memory(name, payload, command, args.out)
    runs: list[dict[str, Any]] = []

    def save(partial: dict[str, Any]) -> None:
        write_results(name, {**payload, "runs": [*runs, partial]}, args.out)

    for backend in args.backend:
        runs.append(run_backend(backend, args, save))
    payload.update(runs=runs, complete=True)
    path = write_results(name, payload, args.out)
    print(f"\nwrote {path}")
    return 0


def new_payload(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """The results file before any measurement: what was asked for, on which machine."""
    draft = build_draft_config(args)
    return {
        "benchmark": "ttft",
        "command": command,
        "reduced": args.lengths != [1024, 2048, 4096] or args.keep_rates != [0.1, 0.2, 0.3, 0.5] or args.reps < 3,
        "tiny": args.tiny,
        "machine": machine_info(),
        "models": {
            "main": "tiny-random-llama" if args.tiny else args.main,
            "draft": "tiny-random-llama" if args.tiny else args.draft,
        },
        "settings": {
            "lengths": args.lengths,
            "keep_rates": args.keep_rates,
            "reps": args.reps,
            "lookahead": draft.lookahead,
            "draft_config": dataclasses.asdict(draft),
            "lookahead_label": lookahead_label(draft, resolve_device(args.device).type,
                                               resolve_dtype(args.dtype, args.device)),
            "compared_keep_rates": args.compared_keep_rates,
            "device": args.device,
            "dtype_asked": args.dtype,  # both models'; each run's ``dtypes`` says what each side ran in
            "best_dtype": best_dtype(args.device),  # the machine's fastest on the device: a fair baseline's
            "memory_length": args.memory_length or max(args.lengths),
        },
        "targets": TARGETS,
        "complete": False,
        "runs": [],
        "memory": None,
    }


if __name__ == "__main__":
    sys.exit(main())
