"""What reading a prompt in windows costs in evidence (``DraftConfig.on_overflow="windows"``).

A draft whose window is shorter than the prompt reads it in windows that each hold the
protected tokens and one run of the context (``DraftModel.windows``). This measures the loss
against reading the same prompt in one pass, with the same draft: per example the library's
default scoring in one pass, and again with the draft's window set to ``--window`` tokens
(so the prompt is read in windows); both select with the library's selection at each keep rate
and are scored like ``bench evidence`` (recall of the gold evidence, every key span kept,
context kept). Paired, resumable; long tasks as ``bench evidence`` builds them.

    specprefill-rag bench windows --tasks hotpotqa_long --long-lengths 8192 --window 4096
    specprefill-rag bench windows --summary
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.lib.metrics import bootstrap_ci, share_ci
from benchmarks.lib.results import append_jsonl
from benchmarks.suites import evidence
from specprefill_rag import DraftConfig, DraftModel, SelectionConfig
from specprefill_rag.loading import SMALL_MODEL, load_tokenizer

MODES = ("one pass", "windows")


def measure(draft: Any, prompt: Any, ex: Any, window: int, keep_rates: Sequence[float]) -> dict[str, Any]:
    """One example in both modes: windows read, seconds, and the metrics per keep rate."""
    gold = evidence.gold_mask(prompt, ex)
    out: dict[str, Any] = {}
    for mode, limit in zip(MODES, (None, window), strict=True):
        scores, windows, seconds = evidence.default_scores(draft, prompt, limit)
        metrics = {f"{keep:g}": evidence.kept_metrics(prompt, ex, scores, SelectionConfig(min_prompt_tokens=0,
                                                                                          keep_rate=keep), gold=gold)
                   for keep in keep_rates}
        out[mode] = {"windows": windows, "seconds": seconds, "metrics": metrics}
    return out


def summarize(rows: list[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """Per task and keep rate: n, one-pass recall, and windows − one pass (paired, 95% CI)."""
    out = []
    for task in sorted({r["task"] for r in rows}):
        mine = [r for r in rows if r["task"] == task]
        for keep in mine[0]["one pass"]["metrics"]:
            entry: dict[str, Any] = {"task": task, "keep_rate": float(keep), "n": len(mine),
                                     "windows": sum(r["windows"]["windows"] for r in mine) / len(mine)}
            for column, metric in enumerate(evidence.METRICS[:2]):
                entry[metric] = share_ci([r["one pass"]["metrics"][keep][column] for r in mine], seed=seed)
                entry[f"{metric}_diff"] = bootstrap_ci(
                    [r["windows"]["metrics"][keep][column] - r["one pass"]["metrics"][keep][column] for r in mine],
                    seed=seed)
            out.append(entry)
    return out


def print_summary(summary: list[dict[str, Any]]) -> None:
    def ci(value: Any) -> str:
        return f"{value[0]:+.3f} [{value[1]:+.3f}, {value[2]:+.3f}]"

    print("| task | keep | n | windows read | recall, one pass | recall: windows − one pass | "
          "complete: windows − one pass |")
    print("|---|---|---|---|---|---|---|")
    for e in summary:
        print(f"| {e['task']} | {e['keep_rate']:g} | {e['n']} | {e['windows']:.1f} | {e['recall'][0]:.3f} | "
              f"{ci(e['recall_diff'])} | {ci(e['complete_diff'])} |")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specprefill-rag bench windows", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", default=SMALL_MODEL, help="draft; it also lays out the prompt (%(default)s)")
    p.add_argument("--window", type=int, default=4096, help="the draft's window for the windowed reading")
    evidence.add_task_args(p, tasks=["hotpotqa_long"], n=30, n_needle=10)
    p.add_argument("--keep-rates", type=float, nargs="+", default=[0.1, 0.3])
    p.add_argument("--summary", action="store_true", help="print the table of the results file and exit")
    p.add_argument("--out", default=None, help="results file (default benchmarks/results/windows.jsonl)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    path, rows = evidence.open_results(args, "windows.jsonl")
    if args.summary:
        print_summary(summarize(rows, args.seed))
        return 0
    tokenizer, draft = load_tokenizer(args.draft), DraftModel.from_pretrained(args.draft)

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    done = {(r["task"], r["id"]) for r in rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    extra = DraftConfig().extra_positions(DraftConfig().lookahead)
    for i, ex in enumerate(evidence.examples(args, count_tokens)):
        if (ex.task, ex.id) in done:
            continue
        prompt = evidence.assemble(tokenizer, ex)
        if not draft.fits(prompt.n_tokens, extra) or prompt.n_tokens + extra <= args.window:
            continue  # one pass must fit its own window, and the windowed reading must need windows
        record = {"task": ex.task, "id": ex.id, "n_prompt": prompt.n_tokens,
                  **measure(draft, prompt, ex, args.window, args.keep_rates)}
        append_jsonl(path, record)
        print(f"[{i + 1}] {ex.task} n={prompt.n_tokens} windows {record['windows']['windows']}, "
              f"elapsed {time.perf_counter() - started:.0f} s", flush=True)
    print_summary(summarize(evidence.load_rows(path), args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())

