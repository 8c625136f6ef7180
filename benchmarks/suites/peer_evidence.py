"""Peer evidence: what each portable compressor keeps of the gold evidence, as text. No answers.

The cheap proxy of issue 51's end-to-end comparison (``bench quality --methods text llmlingua
ragcompress``), on many more examples: per example and keep rate, SpecPrefill's text mode
(``engine.compress``), LongLLMLingua and ragcompress compress the passages, all scoring with the
same draft LM, the peers under ``bench quality``'s budget (``quality_methods.Case.peer_budget``: the
passage tokens SpecPrefill keeps at that rate). Each compressed context, the text an LLM behind the
compressor would read, is then checked against the gold:

- ``answer``: an accepted answer appears in it (whole words, SQuAD-normalised, digit separators
  dropped); none for a yes/no answer, which no context spells out;
- ``evidence``: the share of the gold evidence's word bigrams found in it (HotpotQA: the
  supporting sentences; SQuAD: the answer span; needle: the needle sentence; near-miss: the
  evidence sentence): a sentence kept whole scores 1, a dropped one about 0, one whose words were
  thinned out (LongLLMLingua drops tokens inside sentences) in between;
- ``complete``: every key span kept at least ``key_share`` by that measure (HotpotQA: each
  supporting fact half kept, "both hops"; SQuAD: the answer; needle: the number);
- ``context_kept``: its tokens over the prompt's context tokens (the budget actually used);
- ``compress_s``: the compressor's seconds, draft scoring included.

Unlike ``bench evidence`` (token positions, SpecPrefill's own selection variants), this measures
text, so a compressor that rewrites is scored on what survives of the words. Rows are appended
one example at a time; a rerun of the same command resumes (a row records its prompt's digest,
and a resume that would build another prompt under an id the file holds is refused).

    specprefill-rag bench peer_evidence --dtype bfloat16            # 200 per task, ~45 s per example
    specprefill-rag bench peer_evidence --dtype bfloat16 --summary  # the table from the results file
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.lib.machine import add_dtype_arg
from benchmarks.lib.metrics import bootstrap_ci, share_ci
from benchmarks.lib.quality_methods import Case
from benchmarks.lib.results import append_jsonl, prompt_digest, read_jsonl, result_name, same_example
from benchmarks.suites import evidence, quality
from specprefill_rag.loading import DEFAULT_DRAFT, DEFAULT_MAIN

METHODS = ("text", "llmlingua", "ragcompress")
COLUMNS = ("answer", "evidence", "complete", "context_kept", "compress_s")  # of each result entry
YES_NO = {"yes", "no"}


# -- the measures ----------------------------------------------------------------------------


def bigrams(text: str) -> list[tuple[str, ...]]:
    """``text``'s adjacent word pairs (words as ``bench quality`` compares answers); a text of one
    word stands as that word alone."""
    ws = quality.answer_words(text)
    return [tuple(ws[i:i + 2]) for i in range(len(ws) - 1)] if len(ws) > 1 else [tuple(ws)] if ws else []


def span_kept(span: str, context: set[tuple[str, ...]]) -> tuple[float, int]:
    """(share of ``span``'s bigrams found among ``context``'s, how many bigrams it has)."""
    grams = bigrams(span)
    return (sum(g in context for g in grams) / len(grams), len(grams)) if grams else (1.0, 0)


def measure(ex: quality.Example, context: str) -> tuple[float | None, float, float]:
    """(answer, evidence, complete) of one compressed ``context`` for ``ex`` (module docstring)."""
    grams = set(bigrams(context)) | {(w,) for w in quality.answer_words(context)}  # one-word spans too

    def text_of(span: tuple[int, int, int]) -> str:
        index, start, end = span
        return ex.passages[index][1][start:end]

    kept = [span_kept(text_of(s), grams) for s in ex.evidence]
    total = sum(n for _, n in kept)
    recall = sum(share * n for share, n in kept) / total if total else 1.0
    complete = all(span_kept(text_of(s), grams)[0] >= ex.key_share for s in ex.key)
    spelled = [a for a in ex.answers if quality.normalize_answer(a) not in YES_NO]
    answer = quality.contains_answer(context, spelled) if spelled else None
    return answer, recall, float(complete)


def _passages(ex: quality.Example) -> list[Any]:
    from specprefill_rag import Passage

    return [Passage(text, id=pid) for pid, text in ex.passages]


def measure_example(engine: Any, ex: quality.Example, index: int, args: argparse.Namespace, peers: dict[str, Any],
                    count_tokens: Callable[[str], int]) -> dict[str, Any]:
    """One example's row: every method at every keep rate (``COLUMNS`` per ``method@keep``)."""
    passages = _passages(ex)
    case = Case(engine, ex, index, args, peers.get("llmlingua"), engine.assemble(ex.question, passages),
                passages, ragcompress=peers.get("ragcompress"))
    results: dict[str, list[Any]] = {}
    for keep in args.keep_rates:
        sel = dataclasses.replace(engine.config.selection, keep_rate=keep, token_budget=None)
        for method in args.methods:
            kept, extra = quality.COMPRESSORS[method](case, sel)
            context, seconds = "\n\n".join(p.text for p in kept), extra["compress_s"]
            answer, recall, complete = measure(ex, context)
            kept = count_tokens(context) / max(case.prompt.n_context, 1)
            results[f"{method}@{keep:g}"] = [answer, round(recall, 4), complete, round(kept, 4), round(seconds, 3)]
    return {"task": ex.task, "id": ex.id, "n_prompt": case.prompt.n_tokens, "n_context": case.prompt.n_context,
            "prompt_sha": prompt_digest(case.prompt), "results": results}


# -- the summary -----------------------------------------------------------------------------


def summarize(rows: list[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """Per (task, method, keep rate): the means of ``COLUMNS`` (95% CIs for the shares), the paired
    differences of text mode to each peer in answer and evidence, and seconds per 1k prompt tokens."""
    out = []
    for task in sorted({r["task"] for r in rows}):
        mine = [r for r in rows if r["task"] == task]
        for name in dict.fromkeys(k for r in mine for k in r["results"]):
            method, keep = name.rsplit("@", 1)
            have = [(r, r["results"][name]) for r in mine if name in r["results"]]
            entry: dict[str, Any] = {"task": task, "method": method, "keep_rate": float(keep), "n": len(have)}
            for column, metric in enumerate(COLUMNS[:3]):
                values = [float(v[column]) for _, v in have if v[column] is not None]
                entry[f"n_{metric}"] = len(values)
                entry[metric], lo, hi = share_ci(values, seed=seed) if values else (None, None, None)
                entry[f"{metric}_ci"] = None if not values else [lo, hi]
            entry["context_kept"] = sum(v[3] for _, v in have) / len(have)
            entry["s_per_1k"] = sum(v[4] for _, v in have) / sum(r["n_prompt"] / 1000 for r, _ in have)
            for peer in ("llmlingua", "ragcompress"):
                if method != "text":
                    continue
                theirs = f"{peer}@{keep}"
                for column, metric in enumerate(COLUMNS[:2]):
                    pairs = [float(v[column]) - float(r["results"][theirs][column]) for r, v in have
                             if theirs in r["results"] and None not in (v[column], r["results"][theirs][column])]
                    mean, lo, hi = bootstrap_ci(pairs, seed=seed) if pairs else (None, None, None)
                    entry[f"{metric}_vs_{peer}"] = mean
                    entry[f"{metric}_vs_{peer}_ci"] = None if not pairs else [lo, hi]
            out.append(entry)
    return out


def print_summary(entries: list[dict[str, Any]]) -> None:
    def ci(value: float | None, bounds: list[float] | None, sign: bool = False) -> str:
        if value is None or bounds is None:
            return "–"
        f = "+.3f" if sign else ".3f"
        return f"{value:{f}} [{bounds[0]:{f}}, {bounds[1]:{f}}]"

    for e in entries:
        vs = "".join(f"  evidence − {peer} {ci(e.get(f'evidence_vs_{peer}'), e.get(f'evidence_vs_{peer}_ci'), True)}"
                     for peer in ("llmlingua", "ragcompress") if e.get(f"evidence_vs_{peer}") is not None)
        print(f"{e['task']:<10} {e['method']:<12} keep {e['keep_rate']:<4g} n={e['n']:<4} "
              f"answer {ci(e['answer'], e['answer_ci'])} (n={e['n_answer']})  "
              f"evidence {ci(e['evidence'], e['evidence_ci'])}"
              f"  complete {ci(e['complete'], e['complete_ci'])}  ctx {e['context_kept']:.3f}  "
              f"{e['s_per_1k']:.2f} s/1k{vs}")


# -- the command -----------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specprefill-rag bench peer_evidence", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--main", default=None,
                   help="the model whose tokenizer and chat template lay out the prompt (default: the draft "
                        "itself, one set of weights, as SpecPrefillCompressor(model=...) runs; a model of the "
                        "draft's family lays it out the same)")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="the LM every compressor scores with")
    add_dtype_arg(p)
    evidence.add_task_args(p, tasks=["hotpotqa", "squad", "needle", "near_miss"], n=200, n_needle=100)
    p.add_argument("--keep-rates", type=float, nargs="+", default=[0.1, 0.3])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--tiny", action="store_true", help="tiny random models (smoke run; scores mean nothing)")
    p.add_argument("--summary", action="store_true", help="print the table from the results file and stop")
    p.add_argument("--out", default=None, help="results JSON lines (default benchmarks/results/peer_evidence*.jsonl)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    name = result_name("peer_evidence", main=args.main or DEFAULT_MAIN, draft=args.draft, tiny=args.tiny)
    path, rows = evidence.open_results(args, f"{name}.jsonl")
    if args.summary:
        print_summary(summarize(rows, args.seed))
        return 0
    # No answers here: the draft as its own main (SelfDrafting) loads one model, not two.
    layout = {"main": args.main or args.draft, "lookahead": None, "max_new_tokens": 8}
    engine = quality.build_engine(argparse.Namespace(**{**vars(args), **layout}))
    assert engine.draft is not None
    peers: dict[str, Any] = {}
    if "llmlingua" in args.methods:
        peers["llmlingua"] = quality.LinguaCompressor(engine.draft.model, engine.draft.tokenizer, args.draft)
    if "ragcompress" in args.methods:
        from benchmarks.lib.ragcompress_peer import RagCompressPeer

        peers["ragcompress"] = RagCompressPeer(engine.draft.model, engine.draft.tokenizer)

    def count_tokens(text: str) -> int:
        return len(engine.tokenizer.encode(text, add_special_tokens=False))

    todo = evidence.examples(args, count_tokens)
    done = {(r["task"], r["id"]): r for r in rows}
    for ex in todo:  # before any work: a resume that would mix two examples under one id is refused
        if (ex.task, ex.id) in done:
            same_example([done[(ex.task, ex.id)]], engine.assemble(ex.question, _passages(ex)), path)
    started = time.perf_counter()
    for i, ex in enumerate(todo):
        if (ex.task, ex.id) in done:
            continue
        row = measure_example(engine, ex, i, args, peers, count_tokens)
        append_jsonl(path, row)
        print(f"[{i + 1}/{len(todo)}] {ex.task} {ex.id[:16]} n={row['n_prompt']} "
              f"elapsed {time.perf_counter() - started:.0f} s", flush=True)
    print_summary(summarize(read_jsonl(path), args.seed))
    print(f"\nwrote {Path(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
