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

``--evidence`` is the cheap proxy (draft only, no answers): the same retrieved documents laid
out as a plain RAG prompt and as the answer turn's tool results, scored with the question echo
off and on (``DraftConfig.echo_question``), and the share of HotpotQA's supporting sentences
each selection keeps (``results/tool_rag_evidence.jsonl``)::

    python -m benchmarks.suites.tool_rag --evidence --n 60
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


# -- the draft-only proxy (--evidence) ---------------------------------------------------------

LAYOUTS = ("plain", "tool_echo", "tool")  # the same documents as a plain RAG prompt; as tool results, echo on / off


def answer_turn(example: datasets.Example, documents: Sequence[str]) -> list[dict[str, Any]]:
    """The chat of the turn that reads the results: the question, a search call for it, the documents."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "search", "arguments": json.dumps({"query": example.question})}}
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": example.question},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "\n\n".join(documents)}]


def evidence_masks(prompt: Any, example: datasets.Example, documents: Sequence[str]) -> list[Any]:
    """(n,) bool token masks of each supporting sentence in the retrieved documents (the prompt's
    passage or tool-result segments, in order); sentences of paragraphs not retrieved are not counted."""
    from specprefill_rag import SegmentKind

    kinds = (SegmentKind.PASSAGE, SegmentKind.TOOL_RESULT)
    segments = [i for i, s in enumerate(prompt.segments) if s.kind in kinds]
    where = {segment: a for segment, a, _ in prompt.segment_spans}
    own = {text: i for i, (_, text) in enumerate(example.passages)}
    starts, ends = prompt.offsets[:, 0], prompt.offsets[:, 1]
    masks = []
    for segment, text in zip(segments, documents, strict=True):
        if prompt.segments[segment].text != text.strip() or text not in own:
            continue
        base = where[segment] - (len(text) - len(text.lstrip()))
        masks += [(starts < base + b) & (ends > base + a) & (ends > starts)
                  for p, a, b in example.evidence if p == own[text]]
    return masks


def evidence_row(engine: Any, example: datasets.Example, search: Retriever, args: argparse.Namespace
                 ) -> dict[str, Any]:
    """Per layout and keep rate: [recall, complete] of the supporting sentences the selection keeps
    (recall: their tokens kept; complete: each at least half kept, as ``bench evidence`` counts)."""
    import dataclasses

    import torch

    from specprefill_rag import prompt as prompt_lib

    documents = search(example.question, args.top_k)
    tools = (SEARCH,) if args.answer_tools == "offered" else ()
    chat = engine.assemble(list(prompt_lib.message_segments(answer_turn(example, documents), tools)))
    plain = engine.assemble(example.question, documents)
    chat_spans = evidence_masks(chat, example, documents)
    layouts = {"plain": (plain, evidence_masks(plain, example, documents)), "tool": (chat, chat_spans),
               "tool_echo": (chat, chat_spans)}
    row: dict[str, Any] = {"id": example.id, "gold_sentences": len(chat_spans), "layouts": {}, "lookahead": {}}
    for layout, (prompt, spans) in layouts.items():
        draft = dataclasses.replace(engine.config.draft, echo_question=layout != "tool")
        scores = engine.score(prompt, draft=draft)
        gold = torch.stack(spans).any(0) if spans else torch.zeros(prompt.n_tokens, dtype=torch.bool)
        row["lookahead"][layout] = engine.tokenizer.decode(list(scores.lookahead_token_ids))
        row["layouts"][layout] = {}
        for keep in args.keep_rates:
            sel = dataclasses.replace(engine.config.selection, keep_rate=keep)
            kept = torch.zeros(prompt.n_tokens, dtype=torch.bool)
            kept[engine.plan(prompt, selection=sel, scores=scores).plan.position_ids] = True
            recall = float((kept & gold).sum()) / max(int(gold.sum()), 1)
            complete = all(float((kept & m).sum()) >= 0.5 * float(m.sum()) for m in spans)
            row["layouts"][layout][f"{keep:g}"] = [round(recall, 4), int(complete)]
    return row


def summarise_evidence(rows: list[dict[str, Any]], seed: int = 0) -> dict[str, Any]:
    """Per layout and keep rate: mean recall and complete share with 95% CIs, over the examples
    whose retrieved documents hold gold evidence; paired differences of the complete share between
    the layouts (plain − echo, plain − tool, echo − tool)."""
    rows = [r for r in rows if r["gold_sentences"]]
    out: dict[str, Any] = {"n": len(rows)}
    for layout in LAYOUTS:
        for keep in rows[0]["layouts"][layout] if rows else ():
            got = [r["layouts"][layout][keep] for r in rows]
            entry = {"recall": metrics.share_ci([g[0] for g in got], seed=seed),
                     "complete": metrics.share_ci([float(g[1]) for g in got], seed=seed)}
            for other in LAYOUTS[LAYOUTS.index(layout) + 1:]:  # paired: plain − tool, plain − echo, echo − tool
                base = [r["layouts"][other][keep] for r in rows]
                entry[f"complete_minus_{other}"] = metrics.bootstrap_ci(
                    [g[1] - b[1] for g, b in zip(got, base, strict=True)], seed=seed)
            out[f"{layout}@{keep}"] = entry
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
    p.add_argument("--evidence", action="store_true",
                   help="the draft-only proxy: share of the supporting sentences kept, with the same documents as a "
                   "plain RAG prompt and as tool results (question echo off and on), no main model run")
    p.add_argument("--summary", action="store_true", help="only summarise the rows already in --out")
    p.add_argument("--out", default=None, help="rows (JSONL; default results/tool_rag.jsonl, with --evidence "
                   "results/tool_rag_evidence.jsonl, tiny: tool_rag_tiny*.jsonl)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    machine.offline(args.threads)
    name = "tool_rag" + ("_tiny" if args.tiny else "") + ("_evidence" if args.evidence else "")
    out = Path(args.out) if args.out else RESULTS / f"{name}.jsonl"
    done = {row["id"] for row in read_jsonl(out)} if out.exists() else set()
    examples = datasets.load_hotpotqa(args.n + args.pad, args.seed)
    asked, others = examples[: args.n], examples[args.n:]
    todo = [] if args.summary else [(n, e) for n, e in enumerate(asked, start=1) if e.id not in done]
    engine: Any = build_engine(args) if todo else None
    embed = embedder() if todo else None
    for number, example in todo:
        search = Retriever(example, others + asked, args.pad, args.seed, embed)
        row = (evidence_row if args.evidence else run_example)(engine, example, search, args)
        append_jsonl(out, {**row, "keep_rates": args.keep_rates, "top_k": args.top_k, "pad": args.pad,
                           "main": args.main, "draft": args.draft, "dtype": args.dtype,
                           "answer_tools": args.answer_tools,
                           **({} if args.evidence else {"echo_question": engine.config.draft.echo_question})})
        got = row["layouts"] if args.evidence else {label: m["f1"] for label, m in row["modes"].items()}
        print(f"[{number}/{len(asked)}] {example.id}: {got}", flush=True)
    rows = [row for row in read_jsonl(out) if row["id"] in {e.id for e in asked}]
    summary = (summarise_evidence if args.evidence else summarise)(rows, args.seed)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
