"""Reading: does reading passages apart keep the evidence joint reading keeps? Draft only, paired.

Each example's prompt (``bench quality``'s layout, the same seeded examples as ``bench evidence``)
is scored by the library (``DraftModel.score``, the full pipeline: look-ahead, sentence units)
under joint reading and under each passage-local reading of ``READINGS`` (``DraftConfig.passages``:
each passage read against the anchor and itself, some tokens read again jointly by the
``recompute`` rule). The passage store is emptied per example, so each example pays its own cold
read, and the readings sharing one reading of the passages (every rule but ``"all"``) share it;
the prefix store and the score memo are off. Per example, reading and keep rate: ``recall``
(share of the gold evidence tokens kept), ``complete`` (every key span kept: both hops) and
``context_kept`` (``bench evidence``'s), the draft's seconds (cold for the first reading of the
passages, warm for the next) and the look-ahead tokens (which show whether the draft would answer
as it does reading jointly). ``summary`` prints each reading's paired difference to ``joint``
with a bootstrap 95% interval.

    specprefill-rag bench reading --tasks hotpotqa --n 200            # ~80 s per example here
    specprefill-rag bench reading --tasks squad near_miss needle --readings joint dev30
    specprefill-rag bench reading --summary
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.lib.machine import model_dtype_name
from benchmarks.lib.metrics import bootstrap_ci
from benchmarks.lib.results import append_jsonl, read_jsonl
from benchmarks.suites import evidence
from specprefill_rag import DraftConfig, PassageReading, SelectionConfig
from specprefill_rag.loading import DEFAULT_DRAFT, DEFAULT_MAIN, load_tokenizer

READINGS: dict[str, DraftConfig] = {
    "joint": DraftConfig(passages=None),
    "none": DraftConfig(passages=PassageReading(recompute="none")),
    "first8": DraftConfig(passages=PassageReading(recompute="first", first_tokens=8)),
    "scored15": DraftConfig(passages=PassageReading(recompute="scored", recompute_share=0.15)),
    "scored30": DraftConfig(passages=PassageReading(recompute="scored", recompute_share=0.3)),
    "dev15": DraftConfig(passages=PassageReading(recompute="deviation", recompute_share=0.15)),
    "dev30": DraftConfig(passages=PassageReading(recompute="deviation", recompute_share=0.3)),
    "dev50": DraftConfig(passages=PassageReading(recompute="deviation", recompute_share=0.5)),
    "all": DraftConfig(passages=PassageReading()),  # the library's default
    "all8": DraftConfig(passages=PassageReading(recompute="all", recompute_from=8)),
}


def score_example(draft: Any, tokenizer: Any, ex: Any, readings: Sequence[str], keep_rates: Sequence[float]
                  ) -> dict[str, Any]:
    """One example's row: each reading's metrics per keep rate, seconds and look-ahead tokens. The
    passages' layout is the engine's (``DraftScorer.layout``: the anchor it reads them after)."""
    from specprefill_rag.draft import DraftScorer
    from specprefill_rag.types import SegmentKind

    prompt = evidence.assemble(tokenizer, ex)
    scorer = DraftScorer(draft, tokenizer, READINGS["none"])
    layout = scorer.layout(scorer.render(prompt))
    question = prompt.positions_of(SegmentKind.QUESTION)
    gold = evidence.gold_mask(prompt, ex)
    row: dict[str, Any] = {"task": ex.task, "id": ex.id, "n": prompt.n_tokens,
                           "units": 0 if layout is None else len(layout.units), "res": {}, "sec": {}, "look": {}}
    draft.passages.clear()
    for name in readings:
        config = dataclasses.replace(READINGS[name], memo_entries=0, prefix_cache_entries=0)
        started = time.perf_counter()
        scores = draft.score(prompt.token_ids, question=question, context=~prompt.protected, config=config,
                             layout=layout)
        row["sec"][name] = round(time.perf_counter() - started, 3)
        row["look"][name] = list(scores.lookahead_token_ids)
        for keep in keep_rates:
            sel = SelectionConfig(min_prompt_tokens=0, keep_rate=keep)
            row["res"][f"{name}@{keep:g}"] = evidence.kept_metrics(prompt, ex, scores.scores, sel, None, gold)
    return row


def paired(rows: list[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """Per (task, reading, keep rate): n, the reading's mean recall and complete share, joint's, and
    the paired difference of recall with its bootstrap 95% interval, on the rows holding both."""
    out = []
    for task in sorted({r["task"] for r in rows}):
        mine = [r for r in rows if r["task"] == task]
        names = list(dict.fromkeys(k for r in mine for k in r["res"]))
        for name in names:
            reading, keep = name.split("@")
            base = f"joint@{keep}"
            if reading == "joint":
                continue
            both = [r for r in mine if name in r["res"] and base in r["res"]]
            diffs = [r["res"][name][0] - r["res"][base][0] for r in both]
            mean, low, high = bootstrap_ci(diffs, seed=seed)
            out.append({
                "task": task, "reading": reading, "keep": float(keep), "n": len(both),
                "recall": sum(r["res"][name][0] for r in both) / len(both),
                "joint": sum(r["res"][base][0] for r in both) / len(both),
                "complete": sum(r["res"][name][1] for r in both) / len(both),
                "joint_complete": sum(r["res"][base][1] for r in both) / len(both),
                "diff": mean, "ci": [low, high],
                "same_lookahead": sum(r["look"][reading] == r["look"]["joint"] for r in both) / len(both),
            })
    return out


def print_paired(entries: list[dict[str, Any]]) -> None:
    print(f"{'task':14s} {'reading':9s} {'keep':>4s} {'n':>4s} {'recall':>6s} {'joint':>6s} "
          f"{'diff [95% CI]':>24s} {'both hops':>11s} {'same look':>9s}")
    for e in entries:
        low, high = e["ci"]
        print(f"{e['task']:14s} {e['reading']:9s} {e['keep']:4.1f} {e['n']:4d} {e['recall']:6.3f} {e['joint']:6.3f} "
              f"{e['diff']:+7.3f} [{low:+.3f}, {high:+.3f}] {e['complete']:5.2f}/{e['joint_complete']:.2f} "
              f"{e['same_lookahead']:9.2f}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specprefill-rag bench reading", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--main", default=DEFAULT_MAIN, help="tokenizer and prompt layout come from the main model")
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--draft-dtype", default="auto")
    evidence.add_task_args(p, tasks=["hotpotqa"], n=200, n_needle=60)
    p.add_argument("--readings", nargs="+", default=["joint", "none", "dev15", "dev30", "dev50"],
                   choices=list(READINGS), help="joint first: the others are paired with it")
    p.add_argument("--keep-rates", type=float, nargs="+", default=[0.1, 0.3])
    p.add_argument("--summary", action="store_true", help="print the paired table of the results file and stop")
    p.add_argument("--out", default=None, help="results file (default benchmarks/results/reading.jsonl)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    path, rows = evidence.open_results(args, args.out or "reading.jsonl")
    if args.summary:
        print_paired(paired(rows))
        return 0
    if args.readings[0] != "joint":
        raise SystemExit("--readings must begin with joint: every other reading is paired with it")
    from specprefill_rag.draft import DraftModel

    tokenizer = load_tokenizer(args.main)
    draft = DraftModel.from_pretrained(args.draft, dtype=args.draft_dtype)
    done = {(r["task"], r["id"]) for r in rows}
    for ex in evidence.examples(args, lambda text: len(tokenizer(text)["input_ids"])):
        if (ex.task, ex.id) in done:
            continue
        row = score_example(draft, tokenizer, ex, args.readings, args.keep_rates)
        append_jsonl(path, {**row, "draft_dtype": model_dtype_name(draft.model)})
        cells = " ".join(f"{k} {v[0]:.2f}" for k, v in row["res"].items())
        print(f"{ex.task} {ex.id} {row['n']} tokens: {cells}", flush=True)
    print_paired(paired(read_jsonl(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
