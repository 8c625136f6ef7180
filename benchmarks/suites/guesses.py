"""How many forwards the greedy look-ahead needs when guesses are verified (``lookahead_guesses``).

With early exit the draft's L − 1 = 7 greedy look-ahead tokens take 7 decode steps, one token
each. Verified guesses (``draft.upper_greedy`` with ``guesses`` > 0) feed the next token plus
guesses of the ones after it (``draft.early_exit.prompt_lookup``: what followed the same tokens in the
prompt) and keep what the draft's argmax confirms: the same tokens and queries (tested), in as
many forwards as the guesses fail. How many depends on how much of the draft's answer is copied
from the prompt, so it is measured here on the evidence bench's RAG prompts with real weights
(the GPU script's random weights reject every guess: its "guesses" row is the worst case).

Per example: the default's look-ahead with ``lookahead_guesses`` = L − 2, the forwards it ran
(counted at the draft's first decoder layer), its tokens; ``--check`` also runs one step per
token and records whether the tokens agree. Resumable (one JSON line per example).

    specprefill-rag bench guesses --n 40 --threads 2      # HotpotQA, SQuAD, near-miss: ~20 s per example
    specprefill-rag bench guesses --summary
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.lib.metrics import bootstrap_ci
from benchmarks.lib.results import append_jsonl
from benchmarks.suites import evidence
from specprefill_rag import DraftConfig, DraftModel
from specprefill_rag.loading import DEFAULT_DRAFT, DEFAULT_MAIN, load_tokenizer
from specprefill_rag.types import SegmentKind


def forwards_and_tokens(draft: Any, prompt: Any, config: DraftConfig) -> tuple[int, list[int]]:
    """(look-ahead forwards, look-ahead tokens) of the draft scoring ``prompt`` with ``config``:
    the forwards are the first decoder layer's runs on as many tokens as one look-ahead forward
    feeds (1 + the guesses; the prompt's forward feeds the prompt)."""
    feed = 1 + config.guesses_on(draft.device.type, dtype=draft.dtype)
    calls: list[int] = []

    def count(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        calls.append(int((args[0] if args else kwargs["hidden_states"]).shape[1]))

    handle = draft.model.get_decoder().layers[0].register_forward_pre_hook(count, with_kwargs=True)
    try:
        scores = draft.score(prompt.token_ids, question=prompt.positions_of(SegmentKind.QUESTION), config=config)
    finally:
        handle.remove()
    return sum(1 for tokens in calls[1:] if tokens == feed), list(scores.lookahead_token_ids)


def summarize(rows: list[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """Per task and over all: n, mean forwards with a 95% bootstrap CI, steps they replace."""
    out = []
    for task in sorted({r["task"] for r in rows}) + ["all"]:
        chosen = [r for r in rows if task in ("all", r["task"])]
        mean, low, high = bootstrap_ci([float(r["forwards"]) for r in chosen], seed=seed)
        agree = [r["agrees"] for r in chosen if r.get("agrees") is not None]
        out.append({"task": task, "n": len(chosen), "forwards": mean, "low": low, "high": high,
                    "steps": chosen[0]["steps"], "checked": len(agree), "agree": sum(agree)})
    return out


def print_summary(summary: list[dict[str, Any]]) -> None:
    print("| set | n | forwards for the look-ahead (95% CI) | one step per token | checked: same tokens |")
    print("|---|---|---|---|---|")
    for s in summary:
        print(f"| {s['task']} | {s['n']} | {s['forwards']:.2f} [{s['low']:.2f}, {s['high']:.2f}] | {s['steps']} "
              f"| {s['agree']}/{s['checked']} |")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="specprefill-rag bench guesses", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--main", default=DEFAULT_MAIN, help="tokenizer and prompt layout come from the main model")
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    evidence.add_task_args(p, tasks=["hotpotqa", "squad", "near_miss"], n=40, n_needle=20)
    p.add_argument("--check", action="store_true", help="also run one step per token and compare the tokens")
    p.add_argument("--summary", action="store_true", help="print the table of the results file and exit")
    p.add_argument("--out", default=None, help="results file (default benchmarks/results/guesses.jsonl)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    path, rows = evidence.open_results(args, "guesses.jsonl")
    if args.summary:
        print_summary(summarize(rows, args.seed))
        return 0
    tokenizer = load_tokenizer(args.main)
    draft = DraftModel.from_pretrained(args.draft)
    config = DraftConfig()
    guessing = DraftConfig(lookahead_guesses=config.lookahead - 2)

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    done = {(r["task"], r["id"]) for r in rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    todo = evidence.examples(args, count_tokens)
    started = time.perf_counter()
    for i, ex in enumerate(todo):
        if (ex.task, ex.id) in done:
            continue
        prompt = evidence.assemble(tokenizer, ex)
        if not draft.fits(prompt.n_tokens, config.extra_positions(config.lookahead)):
            continue
        forwards, tokens = forwards_and_tokens(draft, prompt, guessing)
        agrees = None
        if args.check:
            agrees = forwards_and_tokens(draft, prompt, DraftConfig(lookahead_guesses=0))[1] == tokens
        record = {"task": ex.task, "id": ex.id, "n_prompt": prompt.n_tokens, "steps": config.lookahead - 1,
                  "forwards": forwards, "tokens": tokens, "agrees": agrees}
        append_jsonl(path, record)
        print(f"[{i + 1}/{len(todo)}] {ex.task} n={prompt.n_tokens} forwards {forwards} "
              f"{tokenizer.decode(tokens)!r} elapsed {time.perf_counter() - started:.0f} s", flush=True)
    print_summary(summarize(evidence.load_rows(path), args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
