"""The examples ``bench evidence`` reads and every bench that draws from it (``guesses``,
``lookahead_cost``, ``peer_evidence``, ``reading``, ``windows``): their task options, the
examples drawn (seeded, the same as ``bench quality``'s), each assembled as ``bench quality``
assembles it, and a resumable JSON-lines results file.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.lib import long_context
from benchmarks.lib.datasets import Example, interleave, load_hotpotqa, load_near_miss, load_squad, needle_examples
from benchmarks.lib.machine import offline
from benchmarks.lib.quality_methods import INSTRUCTIONS
from benchmarks.lib.results import RESULTS_DIR, read_jsonl
from specprefill_rag import Passage
from specprefill_rag import prompt as prompt_lib
from specprefill_rag.types import AssembledPrompt


def examples(args: argparse.Namespace, count_tokens: Any) -> list[Example]:
    out: list[Example] = []
    if "hotpotqa" in args.tasks:
        out += load_hotpotqa(args.n, args.seed)
    if "squad" in args.tasks:
        out += load_squad(args.n, args.seed, args.squad_tokens, count_tokens)
    if "needle" in args.tasks:
        depths = _needle_depths(args.n_needle, len(args.needle_lengths))
        out += needle_examples(args.needle_lengths, depths, args.seed, count_tokens)
    if "near_miss" in args.tasks:
        out += load_near_miss()
    out += long_context.long_examples(args.tasks, args.long_lengths, args.n_long,
                                      _needle_depths(args.n_needle, len(args.long_lengths)), args.seed, count_tokens)
    return interleave(out)


def _needle_depths(n: int, lengths: int) -> list[float]:
    """``n`` needle examples spread over ``lengths`` lengths: this many depths, evenly spaced."""
    per = max(1, n // max(1, lengths))
    return [round((i + 0.5) / per, 4) for i in range(per)]


def load_rows(path: Path) -> list[dict[str, Any]]:
    """A results file's rows (``results.read_jsonl``: a torn last line is skipped)."""
    return read_jsonl(path)


def assemble(tokenizer: Any, ex: Example) -> AssembledPrompt:
    """The prompt ``bench quality`` builds for ``ex`` (its instructions, default protection)."""
    passages = [Passage(text, id=pid) for pid, text in ex.passages]
    return prompt_lib.assemble(tokenizer, prompt_lib.build_segments(ex.question, passages, INSTRUCTIONS))


def add_task_args(p: argparse.ArgumentParser, *, tasks: Sequence[str], n: int, n_needle: int) -> None:
    """The options ``examples`` reads (the long tasks' too), for every bench that draws from it."""
    p.add_argument("--tasks", nargs="+", default=list(tasks))
    p.add_argument("--n", type=int, default=n, help="examples per task (HotpotQA, SQuAD)")
    p.add_argument("--n-needle", type=int, default=n_needle, help="needle examples, spread over lengths and depths")
    p.add_argument("--needle-lengths", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--squad-tokens", type=int, default=1024, help="SQuAD context length target (tokens)")
    long_context.add_arguments(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)


def open_results(args: argparse.Namespace, name: str) -> tuple[Path, list[dict[str, Any]]]:
    """A resumable bench's results file (``--out``, else ``name`` in the results folder) and its
    rows so far, with the process set up as every bench runs: offline, ``--threads``."""
    offline(args.threads)
    path = Path(args.out) if args.out else RESULTS_DIR / name
    return path, load_rows(path)
