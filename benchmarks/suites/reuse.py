"""Reuse: time to first token when passages recur, cold and warm, beside full prefill.

The draft's cost is what caps SpecPrefill's speedup (1 / (r + k)), and most of it is reading
passages the draft has read before. Two workloads where they recur, each at every ``--lengths``:

- ``follow_up``: ``--questions`` questions over one retrieved set (the same passages in the
  same order), as a chat's follow-ups or a RAG app asked twice: the first is cold, the rest warm;
- ``indexed``: a corpus read at indexing time (``engine.read_passages``, timed apart), then each
  question over a random subset of it in a random order, about one prompt length each.

Per question, interleaved (the order rotating per question): full prefill (the baseline: the main
model's prefill of the whole prompt), and SpecPrefill at ``--keep-rate`` under each reading:

- ``joint``: the draft reads every token of every prompt (no stores: before read-once);
- ``prefix``: the library's joint reading with its prefix store (a prompt that begins as a stored
  one reads from where they part: exact, the follow-up's reuse);
- ``apart``: passages read apart into the passage store (``DraftConfig.passages``, the rule
  ``--recompute`` names), the prefix store on too.

Each reading has stores of its own, emptied when a workload begins; the score memo is off. The
row of a question records TTFT, the draft's seconds, the main prefill's and what the stores
served; ``summary`` gives medians per (workload, length, reading, cold/warm), the paired speedup
over full prefill with a bootstrap 95% interval, and r = draft seconds / full prefill seconds.
Rows are appended one question at a time; a rerun resumes (cells already done are skipped).

    specprefill-rag bench reuse --lengths 2048 4096             # CPU, Qwen 0.5B -> 1.5B, both one dtype
    specprefill-rag bench reuse --summary
    python -m benchmarks.suites.reuse --tiny --lengths 512 --questions 2   # smoke run, random models
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from benchmarks.lib.essay_prompts import build_passages, essay_passages
from benchmarks.lib.machine import add_dtype_arg, model_dtypes, offline
from benchmarks.lib.metrics import bootstrap_ci
from benchmarks.lib.results import RESULTS_DIR, append_jsonl, read_jsonl
from specprefill_rag import PassageReading
from specprefill_rag.loading import DEFAULT_DRAFT, DEFAULT_MAIN

QUESTIONS = (
    "According to these essays, what should the founders of a startup do first, and why?",
    "What do the essays say about how to find good startup ideas?",
    "Which mistakes do the essays warn founders against?",
    "How do the essays describe working with investors?",
    "What do the essays recommend about hiring early employees?",
    "What role does growth play in the essays' view of startups?",
    "How should a founder decide what to build, according to the essays?",
    "What do the essays say about competition between startups?",
)
READINGS = ("joint", "prefix", "apart")
WORKLOADS = ("follow_up", "indexed")
CORPUS_FACTOR = 3  # the indexed corpus holds this many prompts' worth of passages


def reading_config(base: Any, reading: str, recompute: str) -> Any:
    """The draft settings of one reading (module docstring), the score memo off."""
    from specprefill_rag import PassageReading

    draft = dataclasses.replace(base, memo_entries=0)
    if reading == "joint":
        return dataclasses.replace(draft, prefix_cache_entries=0, passages=None)
    if reading == "prefix":
        return dataclasses.replace(draft, passages=None)
    return dataclasses.replace(draft, passages=PassageReading(recompute=recompute))  # type: ignore[arg-type]


def engines(engine: Any, recompute: str) -> dict[str, Any]:
    """One engine per reading, sharing the models; each reading's draft stores its own (a draft
    model per engine would double the weights: the stores are emptied between workloads instead,
    and namespaced per reading so no reading finds another's)."""
    from specprefill_rag import SpecPrefillEngine

    return {name: SpecPrefillEngine(engine.backend, engine.draft,
                                    dataclasses.replace(engine.config,
                                                        draft=reading_config(engine.config.draft, name, recompute)))
            for name in READINGS}


def _measure(engine: Any, question: str, passages: Sequence[str], mode: str, keep: float, salt: str
             ) -> dict[str, Any]:
    from specprefill_rag import GenerationConfig, SelectionConfig

    res = engine.generate(question, list(passages), mode=mode,
                          selection=SelectionConfig(keep_rate=keep, min_prompt_tokens=0),
                          generation=GenerationConfig(max_new_tokens=1, cache_salt=salt))
    t = res.timings
    return {"ttft_s": t.ttft_s, "draft_s": t.draft_s or 0.0, "prefill_s": t.prefill_s, "keep_ratio": res.keep_ratio,
            "prompt_tokens": res.prompt_tokens, "draft_cached_tokens": res.draft_cached_tokens,
            "passages_cached": res.passages_cached, "passages_read": res.passages_read}


def workload_prompts(engine: Any, workload: str, length: int, questions: int, seed: int
                     ) -> tuple[list[str], list[list[str]]]:
    """(the corpus read ahead, or [] for follow-ups; each question's passages in order)."""
    passages, _ = build_passages(engine, length)
    if workload == "follow_up":
        return [], [passages] * questions
    corpus = essay_passages(engine.tokenizer, CORPUS_FACTOR * length)
    rng = random.Random(seed)
    return corpus, [rng.sample(corpus, min(len(passages), len(corpus))) for _ in range(questions)]


def run_workload(engine: Any, readers: dict[str, Any], workload: str, length: int, args: argparse.Namespace,
                 done: set[tuple[str, int, int]]) -> Iterator[dict[str, Any]]:
    """Every question of one workload at one length: a row for each question not in ``done``, as it
    finishes. A question done before is read again untimed by the readings with stores when a later
    one is still to come, so that a resumed run finds them as warm as an unbroken one would."""
    corpus, sets = workload_prompts(engine, workload, length, args.questions, args.seed)
    for reader in readers.values():
        reader.draft.prefixes.clear()
        reader.draft.passages.clear()
    salt = {name: f"bench-reuse-{name}" for name in READINGS}  # the readings never share an entry
    read_ahead = {}
    if corpus:
        started = time.perf_counter()
        read = readers["apart"].read_passages(corpus, cache_salt=salt["apart"])
        read_ahead = {"read_ahead_s": time.perf_counter() - started, "corpus": len(corpus), "read": read.read}
    items = ["full", *READINGS]
    for i, passages in enumerate(sets):
        question = QUESTIONS[i % len(QUESTIONS)]
        if (workload, length, i) in done:
            if any((workload, length, later) not in done for later in range(i + 1, len(sets))):
                for what in ("prefix", "apart"):
                    _measure(readers[what], question, passages, "specprefill", args.keep_rate, salt[what])
            continue
        row: dict[str, Any] = {"workload": workload, "length": length, "question": i, "warm": i > 0 or bool(corpus),
                               **read_ahead}
        for what in items[i % len(items):] + items[: i % len(items)]:
            mode = "full" if what == "full" else "specprefill"
            reader = readers["joint" if what == "full" else what]
            row[what] = _measure(reader, question, passages, mode, args.keep_rate, f"{salt.get(what, 'full')}-{i}"
                                 if what in ("full", "joint") else salt[what])
        print(_line(row), flush=True)
        yield row


def _line(row: dict[str, Any]) -> str:
    full = row["full"]["ttft_s"]
    cells = " ".join(f"{r} {row[r]['ttft_s']:.1f}s ({full / row[r]['ttft_s']:.2f}x, draft {row[r]['draft_s']:.1f}s)"
                     for r in READINGS)
    return f"{row['workload']} {row['length']} q{row['question']}: full {full:.1f}s | {cells}"


def summarize(rows: list[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """Per (workload, length, reading, warm): n, median TTFT and draft seconds, the paired speedup
    over full prefill with its bootstrap 95% interval, and r = draft / full prefill."""
    out = []
    keys = sorted({(r["workload"], r["length"], r["warm"]) for r in rows})
    for workload, length, warm in keys:
        mine = [r for r in rows if (r["workload"], r["length"], r["warm"]) == (workload, length, warm)]
        for reading in READINGS:
            speed = [r["full"]["ttft_s"] / r[reading]["ttft_s"] for r in mine]
            share = [r[reading]["draft_s"] / r["full"]["prefill_s"] for r in mine]
            mean, low, high = bootstrap_ci(speed, seed=seed)
            out.append({"workload": workload, "length": length, "warm": warm, "reading": reading, "n": len(mine),
                        "speedup": mean, "speedup_ci": [low, high], "r": bootstrap_ci(share, seed=seed)[0],
                        "ttft_s": _median([r[reading]["ttft_s"] for r in mine]),
                        "full_ttft_s": _median([r["full"]["ttft_s"] for r in mine]),
                        "draft_s": _median([r[reading]["draft_s"] for r in mine])})
    return out


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else float("nan")


def print_summary(entries: list[dict[str, Any]]) -> None:
    print(f"{'workload':10s} {'length':>6s} {'state':5s} {'reading':7s} {'n':>3s} {'speedup [95% CI]':>22s} "
          f"{'r':>6s} {'TTFT':>7s} {'full':>7s}")
    for e in entries:
        low, high = e["speedup_ci"]
        print(f"{e['workload']:10s} {e['length']:6d} {'warm' if e['warm'] else 'cold':5s} {e['reading']:7s} "
              f"{e['n']:3d} {e['speedup']:6.2f} [{low:5.2f}, {high:5.2f}] {e['r']:6.3f} {e['ttft_s']:6.1f}s "
              f"{e['full_ttft_s']:6.1f}s")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--main", default=DEFAULT_MAIN)
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--questions", type=int, default=5, help="questions per workload and length")
    p.add_argument("--keep-rate", type=float, default=0.1)
    p.add_argument("--recompute", default=PassageReading().recompute,
                   help="PassageReading.recompute of the 'apart' reading (default: the library's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    add_dtype_arg(p)
    p.add_argument("--tiny", action="store_true", help="tiny random models (smoke runs, tests)")
    p.add_argument("--out", default=None, help="results file (default benchmarks/results/reuse[_tiny].jsonl)")
    p.add_argument("--summary", action="store_true", help="print the table from the results file and stop")
    return p.parse_args(argv)


def build_engine(args: argparse.Namespace) -> Any:
    from specprefill_rag import DraftConfig, SpecPrefillConfig, SpecPrefillEngine

    if args.tiny:
        from benchmarks.lib.tiny import tiny_engine

        return tiny_engine(draft_layers=8)
    config = SpecPrefillConfig(draft=DraftConfig())
    return SpecPrefillEngine.from_pretrained(args.main, args.draft, config=config, device=args.device,
                                             dtype=args.dtype)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    path = RESULTS_DIR / (args.out or f"reuse{'_tiny' if args.tiny else ''}.jsonl")
    if args.summary:
        print_summary(summarize(read_jsonl(path)))
        return 0
    offline()
    engine = build_engine(args)
    engine.warm_up()
    readers = engines(engine, args.recompute)
    done = {(r["workload"], r["length"], r["question"]) for r in read_jsonl(path)}
    dtypes = model_dtypes(engine)
    for length in args.lengths:
        for workload in args.workloads:
            for row in run_workload(engine, readers, workload, length, args, done):
                append_jsonl(path, {**row, "dtypes": dtypes, "keep_rate": args.keep_rate,
                                    "recompute": args.recompute})
    print_summary(summarize(read_jsonl(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
