"""Tool-result RAG (issue 50): HotpotQA questions answered by an agent loop with a retriever tool.

Each example is one agent run, as LangChain's ``create_agent`` or LlamaIndex's ``FunctionAgent``
runs it: the model is offered a ``search`` tool (decoded under the calls' grammar), calls it
(the first turn with tool_choice "required", as an agent that retrieves first: under "auto" the
packaged 1.5B model mostly answers from memory), gets the retrieved paragraphs back as one tool
message (one prunable document each), and answers. The answering turn is offered no tools by
default, as the answer node of LangGraph's agentic-RAG graph (offered them, even under
tool_choice "none", the 1.5B model mostly writes another call as bare JSON text instead of an
answer); ``--answer-tools offered`` runs the full loop (tool_choice "auto", a further call
answered the same way, up to ``--max-steps`` model turns). The retriever ranks the example's own
10 paragraphs among ``--pad`` paragraphs of other examples with the packaged MiniLM embedder and
returns the top ``--top-k``.

The first turn (no tool result yet: nothing to prune) is shared by every mode; each later turn
runs once per mode: full prefill, then SpecPrefill at each ``--keep-rates``. Reported per mode:
answer F1/EM (HotpotQA's scoring), with the F1 retention against full prefill and its paired 95%
bootstrap interval; the share of runs whose calls all parsed and fit the tool's schema (no
``ToolCallError``); and the TTFT of the turn that reads the tool results, with its speedup over
full prefill measured side by side. Rows are appended per example and skipped when there, so an
interrupted run resumes::

    python -m benchmarks.suites.tool_rag --n 60          # Qwen2.5-Coder 0.5B drafts for 1.5B, bf16
    python -m benchmarks.suites.tool_rag --tiny --n 2    # smoke run on random tiny models
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.lib import datasets, machine, metrics
from benchmarks.lib.results import append_jsonl, read_jsonl
from benchmarks.suites.quality import score_prediction

RESULTS = Path(__file__).resolve().parents[1] / "results"
SYSTEM = ("You answer questions using the search tool. Call search once with a short query, then answer "
          "with just the answer: a few words, no sentence.")
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the encyclopedia; returns the most relevant paragraphs.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "what to look up"}},
                   "required": ["query"]}}}


class Retriever:
    """Cosine top-k over one example's paragraphs and ``pad`` paragraphs of other examples."""

    def __init__(self, example: datasets.Example, others: Sequence[datasets.Example], pad: int, seed: int,
                 embed: Any) -> None:
        pool = [text for other in others if other.id != example.id for _, text in other.passages]
        random.Random(f"{seed}:{example.id}").shuffle(pool)
        self.texts = [text for _, text in example.passages] + pool[:pad]
        self.embed = embed
        self.vectors = embed(self.texts)

    def __call__(self, query: str, k: int) -> list[str]:
        import torch

        scores = self.vectors @ self.embed([query])[0]
        return [self.texts[i] for i in torch.topk(scores, min(k, len(self.texts))).indices.tolist()]


def embedder() -> Any:
    import torch

    from specprefill_rag.tools.retrieval import load_embedder

    model = load_embedder()
    return lambda texts: torch.tensor(model.encode(list(texts), normalize_embeddings=True, show_progress_bar=False))


def build_engine(args: argparse.Namespace) -> Any:
    from specprefill_rag import DraftConfig, GenerationConfig, SelectionConfig, SpecPrefillConfig, SpecPrefillEngine

    # Each mode's reading turn is its own request, scored whole (``machine.cold``): no draft memo
    # between keep rates, so each TTFT counts its draft.
    config = SpecPrefillConfig(draft=machine.cold(DraftConfig()), selection=SelectionConfig(min_prompt_tokens=0),
                               generation=GenerationConfig(max_new_tokens=args.max_new_tokens))
    if args.tiny:
        from specprefill_rag.testing import tiny_engine

        return tiny_engine(config, max_position_embeddings=8192, tools=True)
    return SpecPrefillEngine.from_pretrained(args.main, args.draft, config=config, dtype=args.dtype)


def turn(engine: Any, messages: list[dict[str, Any]], mode: str, keep: float | None, choice: str = "auto",
         tools: Sequence[dict[str, Any]] = (SEARCH,)) -> dict[str, Any]:
    """One model turn: its calls (or answer) and timings; a ``ToolCallError`` is recorded, not raised."""
    from specprefill_rag import ToolCallError

    generation = engine.config.generation.with_overrides(tool_choice=choice if tools else "auto")
    try:
        result = engine.chat(messages, tools, mode=mode, keep_rate=keep, generation=generation)
    except ToolCallError as error:
        return {"error": str(error)}
    content = result.text if result.content is None else result.content  # None: no tools offered
    return {"text": result.text, "content": content,
            "calls": [{"id": c.id, "name": c.name, "arguments": dict(c.arguments)} for c in result.tool_calls],
            "ttft_s": result.timings.ttft_s, "draft_s": result.timings.draft_s,
            "prompt_tokens": result.prompt_tokens, "prefilled_tokens": result.prefilled_tokens}


def with_results(messages: list[dict[str, Any]], step: dict[str, Any], search: Retriever, k: int
                 ) -> list[dict[str, Any]]:
    """``messages`` followed by the turn's calls and one tool message per call (its documents)."""
    calls = [{"id": c["id"], "type": "function",
              "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}} for c in step["calls"]]
    out = [*messages, {"role": "assistant", "content": step["content"] or None, "tool_calls": calls}]
    for c in step["calls"]:
        documents = search(c["arguments"]["query"], k)
        out.append({"role": "tool", "tool_call_id": c["id"], "content": "\n\n".join(documents)})
    return out


def run_example(engine: Any, example: datasets.Example, search: Retriever, args: argparse.Namespace
                ) -> dict[str, Any]:
    """The agent loop of one example in every mode, sharing the first turn."""
    start = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": example.question}]
    first = turn(engine, start, "full", None, args.first_choice)
    row: dict[str, Any] = {"id": example.id, "question": example.question, "answers": list(example.answers),
                           "first": first, "modes": {}}
    for label, mode, keep in [("full", "full", None), *[(f"keep_{k:g}", "specprefill", k) for k in args.keep_rates]]:
        step, messages, reading = first, start, None
        steps: list[dict[str, Any]] = []
        while "error" not in step and step["calls"] and len(steps) + 1 < args.max_steps:
            messages = with_results(messages, step, search, args.top_k)
            step = turn(engine, messages, mode, keep, tools=(SEARCH,) if args.answer_tools == "offered" else ())
            steps.append(step)
            reading = reading or step
        answer = step.get("content", "") if "error" not in step and not step["calls"] else ""
        scores = score_prediction("hotpotqa", answer, example.answers)
        row["modes"][label] = {"answer": answer, **scores, "valid": all("error" not in s for s in [first, *steps]),
                               "called": bool(first.get("calls")), "steps": steps,
                               "reading_ttft_s": None if reading is None else reading.get("ttft_s")}
    return row


def summarise(rows: list[dict[str, Any]], seed: int = 0) -> dict[str, Any]:
    """Per mode: F1/EM with 95% CIs, F1 retention vs full (paired), valid-call share, TTFT speedup of
    the turn that reads the tool results (median of per-example full/mode ratios)."""
    out: dict[str, Any] = {"n": len(rows), "called_share": metrics.share_ci([float(bool(r["first"].get("calls")))
                                                                             for r in rows])}
    full = [r["modes"]["full"] for r in rows]
    for label in rows[0]["modes"] if rows else ():
        got = [r["modes"][label] for r in rows]
        entry: dict[str, Any] = {"f1": metrics.share_ci([g["f1"] for g in got]),
                                 "em": metrics.share_ci([g["em"] for g in got]),
                                 "valid": metrics.share_ci([float(g["valid"]) for g in got])}
        if label != "full":
            entry["f1_retention"] = metrics.paired_ratio_ci([g["f1"] for g in got], [f["f1"] for f in full],
                                                            shares=True, seed=seed)
            ratios = [f["reading_ttft_s"] / g["reading_ttft_s"] for f, g in zip(full, got, strict=True)
                      if f["reading_ttft_s"] and g["reading_ttft_s"]]
            entry["reading_ttft_speedup_median"] = statistics.median(ratios) if ratios else None
            entry["valid_minus_full"] = entry["valid"][0] - metrics.share_ci([float(f["valid"]) for f in full])[0]
        out[label] = entry
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from specprefill_rag.loading import DEFAULT_DRAFT, DEFAULT_MAIN

    p = argparse.ArgumentParser(prog="specprefill-rag bench tool_rag", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--main", default=DEFAULT_MAIN)
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    machine.add_dtype_arg(p)
    p.add_argument("--n", type=int, default=60)
    p.add_argument("--keep-rates", type=float, nargs="+", default=[0.1, 0.3])
    p.add_argument("--top-k", type=int, default=10, help="paragraphs the search tool returns")
    p.add_argument("--pad", type=int, default=30, help="other examples' paragraphs in each example's corpus")
    p.add_argument("--max-steps", type=int, default=3, help="model turns per run (the last must answer)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--answer-tools", choices=("withheld", "offered"), default="withheld",
                   help="the turns that read the results: withheld (default: no tools offered, as LangGraph's "
                   "agentic-RAG answer node; offered, the packaged 1.5B model writes another call as bare JSON "
                   "text) or offered (tool_choice auto, up to --max-steps turns)")
    p.add_argument("--first-choice", default="required",
                   help="tool_choice of the first turn: required (default: retrieve first, as a RAG agent does; "
                   "the packaged 1.5B model often answers from memory under auto), auto, none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--tiny", action="store_true", help="random tiny models (smoke run; scores mean nothing)")
    p.add_argument("--summary", action="store_true", help="only summarise the rows already in --out")
    p.add_argument("--out", default=None, help="rows (JSONL; default results/tool_rag.jsonl, tiny: a temp file)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    machine.offline(args.threads)
    out = Path(args.out) if args.out else RESULTS / ("tool_rag_tiny.jsonl" if args.tiny else "tool_rag.jsonl")
    done = {row["id"] for row in read_jsonl(out)} if out.exists() else set()
    examples = datasets.load_hotpotqa(args.n + args.pad, args.seed)
    asked, others = examples[: args.n], examples[args.n:]
    todo = [] if args.summary else [(n, e) for n, e in enumerate(asked, start=1) if e.id not in done]
    engine = build_engine(args) if todo else None
    embed = embedder() if todo else None
    for number, example in todo:
        row = run_example(engine, example, Retriever(example, others + asked, args.pad, args.seed, embed), args)
        append_jsonl(out, {**row, "keep_rates": args.keep_rates, "top_k": args.top_k, "pad": args.pad,
                           "main": args.main, "draft": args.draft, "dtype": args.dtype})
        f1s = {label: round(m["f1"], 2) for label, m in row["modes"].items()}
        print(f"[{number}/{len(asked)}] {example.id}: {f1s}", flush=True)
    rows = [row for row in read_jsonl(out) if row["id"] in {e.id for e in asked}]
    summary = summarise(rows, args.seed)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
