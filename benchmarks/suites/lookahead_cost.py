"""What the draft's look-ahead costs on real RAG prompts: forwards, and seconds beside a plain forward.

The TTFT benches time one essay prompt per length, whose question asks for a long answer; how
many look-ahead forwards the default runs depends on the draft's answer when the look-ahead
stops at its end (``DraftConfig.lookahead_stop_at_eos``). So this times the draft on the
evidence bench's RAG prompts (HotpotQA, SQuAD, near-miss) with real weights: per example a
plain draft forward (KV cache on, last logits only: what a server runs), and the library's
default scoring beside the same look-ahead with its stop toggled, in alternating order. It
records each one's seconds, its look-ahead forwards (counted at the first decoder layer) and
tokens. ``--main-forward`` also times the main model's plain forward (for r = scoring / main
prefill). ``--dtypes float32 bfloat16`` times the default scoring with the draft in each dtype
instead (the plain forward is the first dtype's). Every prompt is read whole (no memo, no prefix
store). Resumable.

    specprefill-rag bench lookahead_cost --n 10 --threads 2    # ~1 min per example on 2 CPU cores
    specprefill-rag bench lookahead_cost --dtypes float32 bfloat16 --main-forward \
        --out benchmarks/results/lookahead_cost_dtypes.jsonl    # the draft's dtype on this CPU
    specprefill-rag bench lookahead_cost --summary
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.lib.lookahead import lookahead_label
from benchmarks.lib.machine import cold
from benchmarks.lib.metrics import bootstrap_ci
from benchmarks.lib.results import append_jsonl
from benchmarks.lib.ttft_timing import plain_forward_s
from benchmarks.suites import evidence, guesses
from specprefill_rag import DraftConfig, DraftModel
from specprefill_rag.loading import DEFAULT_DRAFT, DEFAULT_MAIN, load_model, load_tokenizer


def configs(device: str = "cpu", dtype: Any = None) -> dict[str, DraftConfig]:
    """The library's default and the same look-ahead with its stop at the draft's end toggled,
    by ``lookahead_label`` (on ``device`` in ``dtype``); both read every prompt whole."""
    default = cold(DraftConfig())
    other = dataclasses.replace(default, lookahead_stop_at_eos=not default.lookahead_stop_at_eos)
    return {lookahead_label(c, device, dtype): c for c in (default, other)}


def timed(draft: Any, prompt: Any, config: DraftConfig) -> dict[str, Any]:
    """Seconds, look-ahead forwards and tokens of the draft scoring ``prompt`` with ``config``."""
    start = time.perf_counter()
    forwards, tokens = guesses.forwards_and_tokens(draft, prompt, config)
    return {"seconds": time.perf_counter() - start, "forwards": forwards, "tokens": tokens}


def runs(drafts: dict[str, Any]) -> list[tuple[str, Any, DraftConfig]]:
    """(label, draft, config) to time: the two ``configs`` on one draft, or, with a draft per
    dtype, the library's default on each ("<label>, <dtype>")."""
    if len(drafts) == 1:
        [draft] = drafts.values()
        return [(label, draft, config) for label, config in configs(draft.device.type, draft.dtype).items()]
    return [(f"{lookahead_label(cold(DraftConfig()), d.device.type, d.dtype)}, {dtype}", d, cold(DraftConfig()))
            for dtype, d in drafts.items()]


def measure(drafts: dict[str, Any], prompt: Any, index: int, main: Any = None) -> dict[str, Any]:
    """One example: the first draft's plain forward and each run's scoring (``runs``), in an
    order that alternates with ``index``."""
    named = runs(drafts)
    if index % 2:
        named.reverse()
    out: dict[str, Any] = {"plain_s": plain_forward_s(next(iter(drafts.values())).model, prompt.token_ids)}
    out["configs"] = {label: timed(draft, prompt, config) for label, draft, config in named}
    if main is not None:
        out["main_plain_s"] = plain_forward_s(main, prompt.token_ids)
    return out


def summarize(rows: list[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """Per config, per task and over all: mean scoring / plain draft forward, forwards, the
    ratio to the first config's seconds (paired), and r where the main forward was timed."""
    out = []
    labels = list(dict.fromkeys(label for r in rows for label in r["configs"]))
    for task in sorted({r["task"] for r in rows}) + ["all"]:
        chosen = [r for r in rows if task in ("all", r["task"])]
        for label in labels:
            have = [r for r in chosen if label in r["configs"]]
            entry: dict[str, Any] = {"task": task, "config": label, "n": len(have)}
            mine = [r["configs"][label] for r in have]
            entry["overhead"] = bootstrap_ci([m["seconds"] / r["plain_s"] for m, r in zip(mine, have, strict=True)],
                                             seed=seed)
            entry["forwards"] = bootstrap_ci([float(m["forwards"]) for m in mine], seed=seed)
            entry["vs_first"] = bootstrap_ci(
                [m["seconds"] / r["configs"][labels[0]]["seconds"] for m, r in zip(mine, have, strict=True)],
                seed=seed)
            timed_main = [(m, r) for m, r in zip(mine, have, strict=True) if r.get("main_plain_s")]
            entry["r"] = bootstrap_ci([m["seconds"] / r["main_plain_s"] for m, r in timed_main], seed=seed)
            out.append(entry)
    return out


def print_summary(summary: list[dict[str, Any]]) -> None:
    def ci(value: tuple[float, float, float], digits: int = 2) -> str:
        return f"{value[0]:.{digits}f} [{value[1]:.{digits}f}, {value[2]:.{digits}f}]"

    print("| set | look-ahead | n | forwards | scoring × plain draft forward | seconds × the first row's | r |")
    print("|---|---|---|---|---|---|---|")
    for s in summary:
        print(f"| {s['task']} | {s['config']} | {s['n']} | {ci(s['forwards'])} | {ci(s['overhead'])} | "
              f"{ci(s['vs_first'])} | {ci(s['r'], 3)} |")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="specprefill-rag bench lookahead_cost", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--main", default=DEFAULT_MAIN, help="tokenizer and prompt layout come from the main model")
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    evidence.add_task_args(p, tasks=["hotpotqa", "squad", "near_miss"], n=10, n_needle=10)
    p.add_argument("--main-forward", action="store_true", help="also time the main model's plain forward (r)")
    p.add_argument("--dtypes", nargs="+", default=None, choices=("float32", "bfloat16"),
                   help="time the default scoring with the draft in each of these dtypes (default: the draft's "
                   "auto dtype, with the look-ahead's stop toggled)")
    p.add_argument("--tiny", action="store_true", help="tiny random models (smoke run; numbers mean nothing)")
    p.add_argument("--summary", action="store_true", help="print the table of the results file and exit")
    p.add_argument("--out", default=None, help="results file (default benchmarks/results/lookahead_cost.jsonl)")
    return p.parse_args(argv)


def _models(args: argparse.Namespace) -> tuple[Any, dict[str, Any], Any]:
    """(tokenizer, {dtype: draft}, main model or None)."""
    if args.tiny:
        from benchmarks.suites import quality

        engine = quality.build_engine(
            argparse.Namespace(tiny=True, main=args.main, draft=args.draft, lookahead=None, max_new_tokens=8)
        )
        return engine.tokenizer, {"tiny": engine.draft}, engine.draft.model if args.main_forward else None
    main = load_model(args.main)[0] if args.main_forward else None
    drafts = {dtype: DraftModel.from_pretrained(args.draft, dtype=dtype) for dtype in args.dtypes or ["auto"]}
    return load_tokenizer(args.main), drafts, main


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    path, rows = evidence.open_results(args, "lookahead_cost.jsonl")
    if args.summary:
        print_summary(summarize(rows, args.seed))
        return 0
    tokenizer, drafts, main_model = _models(args)
    draft = next(iter(drafts.values()))

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    done = {(r["task"], r["id"]) for r in rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    for i, ex in enumerate(evidence.examples(args, count_tokens)):
        if (ex.task, ex.id) in done:
            continue
        prompt = evidence.assemble(tokenizer, ex)
        if not draft.fits(prompt.n_tokens, DraftConfig().extra_positions(DraftConfig().lookahead)):
            continue
        record = {"task": ex.task, "id": ex.id, "n_prompt": prompt.n_tokens, **measure(drafts, prompt, i, main_model)}
        append_jsonl(path, record)
        print(f"[{i + 1}] {ex.task} n={prompt.n_tokens} "
              + ", ".join(f"{c['forwards']} forwards {c['seconds']:.1f} s" for c in record["configs"].values())
              + f", plain {record['plain_s']:.1f} s, elapsed {time.perf_counter() - started:.0f} s", flush=True)
    print_summary(summarize(evidence.load_rows(path), args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
