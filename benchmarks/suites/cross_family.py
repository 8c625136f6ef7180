"""Cross-family drafts side by side: TTFT and answers, full prefill vs SpecPrefill per draft.

Default: main Qwen2.5-Coder-1.5B; drafts SmolLM2-135M (another family: scores mapped through
character offsets) and Qwen2.5-Coder-0.5B (same tokenizer: direct path); a passkey needle
prompt plus demo-collection questions (retrieved top-k passages); keep 10% and 20%.

For every prompt the modes run back to back (full, then each draft), so load on a shared
machine hits them alike. The draft scores a prompt once; each keep rate then prefills its own
plan, and its TTFT is draft + selection + main prefill to the first token. Every model runs in
one precision, ``--dtype`` (auto: the fastest the device offers); the file records each one's.
Run:

    .venv/bin/python -m benchmarks.suites.cross_family            # table on stdout, JSON in benchmarks/results/
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from benchmarks.lib.machine import add_dtype_arg, cold, command_line, machine_info, model_dtype_name
from benchmarks.lib.results import write_results
from specprefill_rag import (
    DraftConfig,
    DraftModel,
    GenerationConfig,
    Passage,
    SelectionConfig,
    SpecPrefillConfig,
    SpecPrefillEngine,
)
from specprefill_rag.backends.transformers import TransformersBackend
from specprefill_rag.loading import DEFAULT_DRAFT, DEFAULT_MAIN, load_model

PASSKEY = "68413"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = f"The pass key is {PASSKEY}. Remember it. {PASSKEY} is the pass key. "
INSTRUCTIONS = "Answer the question in one short sentence, using only the context."


def needle_case(n_passages: int, repeats: int) -> dict[str, Any]:
    passages = []
    for i in range(n_passages):
        text = FILLER * repeats
        if i == (2 * n_passages) // 3:
            text = FILLER * (repeats // 2) + NEEDLE + FILLER * (repeats // 2)
        passages.append(Passage(text, id=f"p{i}"))
    question = "What is the pass key? Answer with the number only."
    return {"name": "needle", "question": question, "passages": passages, "answer": PASSKEY, "evidence": NEEDLE}


def demo_cases(n: int, top_k: int) -> list[dict[str, Any]]:
    from specprefill_rag.tools.retrieval import Retriever, demo_documents, demo_questions

    retriever = Retriever.from_documents(demo_documents())
    cases = []
    for q in demo_questions()[:n]:
        cases.append(
            {
                "name": q.source.removesuffix(".md"),
                "question": q.question,
                "passages": retriever.retrieve(q.question, top_k=top_k),
                "answer": q.answer,
                "evidence": q.answer,
            }
        )
    return cases


def correct(text: str, answer: str) -> bool:
    norm = lambda s: " ".join(s.lower().replace(",", "").split())  # noqa: E731
    return norm(answer) in norm(text)


def evidence_kept(prompt: Any, plan: Any, evidence: str) -> float | None:
    """Fraction of the main tokens over the first occurrence of ``evidence`` that were prefilled."""
    at = prompt.text.find(evidence)
    if at < 0:
        return None
    offsets = prompt.offsets
    over = ((offsets[:, 0] < at + len(evidence)) & (offsets[:, 1] > at)).nonzero().flatten()
    kept = torch.isin(over, plan.position_ids)
    return float(kept.float().mean())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--main", default=DEFAULT_MAIN)
    parser.add_argument("--drafts", nargs="+", default=["smollm2-135m-instruct", DEFAULT_DRAFT])
    parser.add_argument("--keep-rates", nargs="+", type=float, default=[0.1, 0.2])
    parser.add_argument("--questions", type=int, default=3, help="demo questions (0 = needle only)")
    parser.add_argument("--top-k", type=int, default=10, help="passages retrieved per demo question")
    parser.add_argument("--needle-passages", type=int, default=8)
    parser.add_argument("--needle-repeats", type=int, default=8, help="filler sentences per needle passage")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=None)
    add_dtype_arg(parser, whose="the main model and every draft")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/cross_family-<time>.json)")
    return parser.parse_args(argv)


def build_engines(args: argparse.Namespace, config: SpecPrefillConfig) -> dict[str, SpecPrefillEngine]:
    """One engine per draft, all on one main-model backend; each warmed up once."""
    model, tokenizer = load_model(args.main, dtype=args.dtype)
    backend = TransformersBackend(model, tokenizer, name=args.main)
    engines = {}
    for name in args.drafts:
        draft, draft_tok = load_model(name, dtype=args.dtype)
        engines[name] = SpecPrefillEngine(backend, DraftModel(draft, draft_tok), config)
    for engine in engines.values():  # first calls pay one-off costs
        engine.warm_up()
    return engines


def dtypes_of(engines: dict[str, SpecPrefillEngine]) -> dict[str, Any]:
    """What each model ran in: {"main": "bfloat16", "drafts": {name: "bfloat16", ...}}."""
    main = next(iter(engines.values())).backend
    return {"main": model_dtype_name(main.model),  # type: ignore[attr-defined]
            "drafts": {name: model_dtype_name(e.draft.model) for name, e in engines.items() if e.draft}}


def row(case: dict[str, Any], prompt: Any, result: Any, **fields: Any) -> dict[str, Any]:
    return {"case": case["name"], "n_prompt": prompt.n_tokens, "prefill_s": result.timings.prefill_s,
            "prefilled": result.prefilled_tokens, "correct": correct(result.text, case["answer"]),
            "answer": result.text.strip(), **fields}


def measure_case(case: dict[str, Any], engines: dict[str, SpecPrefillEngine], config: SpecPrefillConfig,
                 keep_rates: list[float]) -> list[dict[str, Any]]:
    """Full prefill, then each draft at each keep rate (the draft scores the prompt once)."""
    full_engine = next(iter(engines.values()))
    prompt = full_engine.assemble(case["question"], case["passages"])
    full_plan = full_engine.plan(prompt, mode="full").plan
    result = full_engine.execute(prompt, full_plan, generation=config.generation).wait()
    full_ttft = result.timings.ttft_s
    rows = [row(case, prompt, result, mode="full", draft=None, keep_rate=1.0, ttft_s=full_ttft, draft_s=None,
                speedup=1.0, evidence_kept=1.0)]
    print(f"{case['name']}: {prompt.n_tokens} tokens, full TTFT {full_ttft:.1f} s", flush=True)
    for name, engine in engines.items():
        scores = engine.score(prompt)
        for keep in keep_rates:
            t0 = time.perf_counter()
            plan = engine.plan(prompt, selection=dataclasses.replace(config.selection, keep_rate=keep),
                               scores=scores).plan
            selection_s = time.perf_counter() - t0
            result = engine.execute(prompt, plan, scores=scores, generation=config.generation).wait()
            ttft = scores.seconds + selection_s + result.timings.ttft_s
            rows.append(row(case, prompt, result, mode="specprefill", draft=name, keep_rate=keep, ttft_s=ttft,
                            draft_s=scores.seconds, speedup=full_ttft / ttft,
                            evidence_kept=evidence_kept(prompt, plan, case["evidence"]),
                            maps_tokens=engine.maps_tokens))
            print(f"  {name} keep {keep:.0%}: TTFT {ttft:.1f} s (draft {scores.seconds:.1f} s) "
                  f"x{full_ttft / ttft:.2f} correct={rows[-1]['correct']}", flush=True)
    return rows


def summarise(rows: list[dict[str, Any]], drafts: list[str], keep_rates: list[float]) -> list[dict[str, Any]]:
    """Per draft and keep rate: total-TTFT speedup over full prefill, answers right, r."""
    full_rows = [r for r in rows if r["mode"] == "full"]
    full_total = sum(r["ttft_s"] for r in full_rows)
    summary = []
    for name in drafts:
        for keep in keep_rates:
            mine = [r for r in rows if r["draft"] == name and r["keep_rate"] == keep]
            summary.append({
                "draft": name, "keep_rate": keep, "speedup": full_total / sum(r["ttft_s"] for r in mine),
                "correct": sum(r["correct"] for r in mine), "n": len(mine),
                "r": sum(r["draft_s"] for r in mine) / sum(r["prefill_s"] for r in full_rows),
            })
    return summary


def print_tables(rows: list[dict[str, Any]], summary: list[dict[str, Any]]) -> None:
    print("\n| case | tokens | mode | draft | keep | TTFT s | draft s | main prefill s | speedup | correct "
          "| evidence kept |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ev = "—" if r["evidence_kept"] is None else f"{r['evidence_kept']:.0%}"
        draft_s = "—" if r["draft_s"] is None else f"{r['draft_s']:.1f}"
        print(f"| {r['case']} | {r['n_prompt']} | {r['mode']} | {r['draft'] or '—'} | {r['keep_rate']:.0%} | "
              f"{r['ttft_s']:.1f} | {draft_s} | {r['prefill_s']:.1f} | {r['speedup']:.2f}x | "
              f"{'yes' if r['correct'] else 'no'} | {ev} |")
    full_rows = [r for r in rows if r["mode"] == "full"]
    print("\n| draft | keep | total TTFT speedup | correct | r = draft / full prefill |")
    print("|---|---|---|---|---|")
    print(f"| full | 100% | 1.00x | {sum(r['correct'] for r in full_rows)}/{len(full_rows)} | — |")
    for s in summary:
        print(f"| {s['draft']} | {s['keep_rate']:.0%} | {s['speedup']:.2f}x | {s['correct']}/{s['n']} | "
              f"{s['r']:.2f} |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cases = [needle_case(args.needle_passages, args.needle_repeats)]
    if args.questions:
        cases += demo_cases(args.questions, args.top_k)
    config = SpecPrefillConfig(
        draft=cold(DraftConfig()),  # every keep rate and repetition scored whole
        selection=SelectionConfig(keep_rate=args.keep_rates[0]),
        generation=GenerationConfig(max_new_tokens=args.max_new_tokens),
        instructions=INSTRUCTIONS,
    )
    engines = build_engines(args, config)
    print(f"main {args.main}; drafts {args.drafts}; dtypes {dtypes_of(engines)}; torch threads "
          f"{torch.get_num_threads()}", flush=True)
    rows = [r for case in cases for r in measure_case(case, engines, config, args.keep_rates)]
    summary = summarise(rows, args.drafts, args.keep_rates)
    print_tables(rows, summary)
    payload = {"benchmark": "cross_family", "command": command_line(argv, "cross_family"), "machine": machine_info(),
               "models": {"main": args.main, "drafts": args.drafts}, "keep_rates": args.keep_rates,
               "dtypes": dtypes_of(engines),
               "rows": rows, "summary": summary}
    path = write_results(f"cross_family-{time.strftime('%Y%m%d-%H%M%S')}", payload, args.out)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
