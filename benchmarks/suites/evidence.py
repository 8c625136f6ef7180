"""Evidence recall: does the selection keep the gold evidence? Draft only, no main model.

The cheap proxy for answer quality, measured on hundreds of real questions: for each example
the draft reads the assembled prompt once (question queries + 8 look-ahead queries, every
layer); the per-layer attention rows are cached, and every scoring/selection variant is then
computed from the cache with the library's own ``scoring`` and ``selection`` functions, at
each keep rate (a fraction of the context, as ``SelectionConfig.keep_rate`` is).

Per example, variant and keep rate:

- ``recall``: share of the gold evidence tokens kept (HotpotQA: the supporting-fact
  sentences; SQuAD: the answer span; needle: the needle sentence);
- ``complete``: every key span kept (HotpotQA: each supporting sentence ≥ 50% kept, "both
  hops"; SQuAD: the whole answer span; needle: the whole number);
- ``context_kept``: share of the context tokens kept (the budget actually used).

Results are appended to a JSON-lines file one example at a time (an interrupted run resumes
where it stopped, with the same command: each row records its prompt's digest, and a resume that
would build another prompt under an id the file holds, e.g. with another ``--n-long`` or other
lengths, is refused before any work); ``summary`` prints means with bootstrap 95% confidence
intervals. The same examples (seeded) as ``bench quality``. Variants are named in ``VARIANTS``; ``--variants``
re-evaluates from the cache without running the draft again.

A prompt longer than the draft's window (or ``--draft-window``) has no single pass to capture:
it is read in windows as the engine reads it (``DraftConfig.on_overflow="windows"``), and only
the library default's scoring and the draft-free baselines are measured on it (its row records
``windows``).

    specprefill-rag bench evidence --n 200                   # ~10 s per example on 2 CPU cores
    specprefill-rag bench evidence --summary                 # the table from the results file
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pickle
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.lib.datasets import Example
from benchmarks.lib.evidence_capture import capture_rows, complete_rows, variant_scores
from benchmarks.lib.evidence_recall import (
    METRICS,
    default_scores,
    evaluate,
    gold_mask,
    kept_metrics,
    span_masks,
    windowed_record,
    windowed_variants,
)
from benchmarks.lib.evidence_summary import joined, paired, pinned, show_summary, summarize, top_variants
from benchmarks.lib.evidence_tasks import add_task_args, assemble, examples, load_rows, open_results
from benchmarks.lib.evidence_variants import (
    BLOCKS,
    MAX_LOOKAHEAD,
    REFERENCE,
    VARIANTS,
    Variant,
    block_layers,
    block_name,
    exit_candidates,
)
from benchmarks.lib.machine import dtype_name, offline
from benchmarks.lib.quality_methods import build_engine
from benchmarks.lib.results import RESULTS_DIR, ROOT, append_jsonl, prompt_digest, same_example
from specprefill_rag import DraftModel
from specprefill_rag.durable import atomic_open, write_atomic
from specprefill_rag.loading import DEFAULT_DRAFT, DEFAULT_MAIN, DTYPES, load_tokenizer, resolve_dtype

# The suite's pieces live in benchmarks/lib/evidence_*.py; the names the other benches, the
# report and the tests read through this module stay here.
__all__ = [
    "BLOCKS", "MAX_LOOKAHEAD", "METRICS", "REFERENCE", "VARIANTS", "DraftModel", "Variant", "add_task_args",
    "assemble", "block_layers", "block_name", "cache_path", "capture_name", "capture_rows", "complete_rows",
    "default_scores", "evaluate", "examples", "gold_mask", "joined", "kept_metrics", "load_capture", "load_rows",
    "main", "open_results", "paired", "parse_args", "pinned", "reevaluate", "same_dtype", "save_capture",
    "span_masks", "summarize", "top_variants", "variant_scores", "windowed_variants",
]

# v3: keyed by the prompt's token ids too (v2 keyed by the question alone, so a padding built
# with another --n-long or other lengths read the rows of another prompt); v2 can be deleted.
CACHE_DIR = ROOT / "benchmarks" / ".cache" / "evidence-v3"


# -- capture cache -----------------------------------------------------------------------------


def capture_name(args: argparse.Namespace, dtype: torch.dtype) -> str:
    """The draft's name in the capture cache: a dtype other than fp32 is cached apart (fp32
    captures predate ``--draft-dtype`` and keep the bare name)."""
    if args.tiny:
        return "tiny"
    return args.draft if dtype == torch.float32 else f"{args.draft}|{dtype_name(dtype)}"


def same_dtype(rows: Sequence[dict[str, Any]], dtype: torch.dtype, path: Path) -> None:
    """Refuse to resume a results file measured with the draft in another dtype (rows written
    before rows recorded it were fp32): one file, one dtype."""
    found = {r.get("draft_dtype", "float32") for r in rows}
    if found and found != {dtype_name(dtype)}:
        raise SystemExit(f"{path} was measured with the draft in {', '.join(sorted(found))}, this run would add "
                         f"{dtype_name(dtype)}: pass --draft-dtype {sorted(found)[0]} or another --out")


def cache_path(ex: Example, draft_name: str, prompt: Any) -> Path:
    """Where the draft's captured rows of ``prompt`` (the example assembled) are cached: keyed by
    the draft, the example and the prompt's token ids, since an id names a question, not its
    padding (SQuAD-long's depends on --n-long, a haystack on the lengths and depths asked)."""
    key = f"{draft_name}|{ex.task}|{ex.id}|{ex.question}|{prompt_digest(prompt)}"
    return CACHE_DIR / f"{ex.task}-{hashlib.sha1(key.encode()).hexdigest()[:16]}.pt"


def save_capture(captured: Any, where: Path) -> None:
    """Cache a capture crash-safely: an interrupted save leaves the previous file, or none."""
    with atomic_open(where) as handle:
        torch.save(captured, handle)


def load_capture(where: Path) -> Any | None:
    """A cached capture, or None if there is none or it cannot be read (a file torn by a crash
    before saves were atomic): then it is captured again."""
    if not where.exists():
        return None
    try:
        return torch.load(where)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as error:
        print(f"warning: {where}: unreadable cached capture ({error}); capturing again", file=sys.stderr, flush=True)
        return None


def reevaluate(
    tokenizer: Any, todo: Sequence[Example], path: Path, variants: Sequence[Variant], args: argparse.Namespace,
    draft: Any = None,
) -> int:
    """Rewrite the results file with ``variants`` recomputed from the capture cache; results of
    variants no longer in ``VARIANTS`` (renamed or dropped) are removed. A capture lacking one of
    ``--blocks`` gets it added (a draft pass); the others are read as they are."""
    index = {(ex.task, ex.id): (i, ex) for i, ex in enumerate(todo)}
    rows = load_rows(path)
    draft_name = capture_name(args, resolve_dtype(args.draft_dtype))
    updated = 0
    for row in rows:
        found = index.get((row["task"], row["id"]))
        if found is None:
            continue
        i, ex = found
        prompt = assemble(tokenizer, ex)
        where = cache_path(ex, draft_name, prompt)
        cached = load_capture(where)
        if cached is None:
            continue
        same_example([row], prompt, path)
        row["results"] = {key: v for key, v in row["results"].items() if key.rsplit("@", 1)[0] in VARIANTS}
        if not set(args.blocks) <= set(cached.get("blocks", [])):  # an older capture: add the blocks it lacks
            draft = draft or DraftModel.from_pretrained(args.draft, dtype=args.draft_dtype)
            cached = complete_rows(draft, prompt, cached, args.blocks)
            save_capture(cached, where)
        row["results"].update(evaluate(prompt, ex, cached, variants, args.keep_rates, args.seed * 1000 + i))
        updated += 1
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))
    print(f"re-evaluated {len(variants)} variants on {updated} of {len(rows)} examples")
    return 0


def _block_arg(value: str) -> str:
    try:
        block_layers(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="specprefill-rag bench evidence", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--main", default=DEFAULT_MAIN, help="tokenizer and prompt layout come from the main model")
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--draft-dtype", default="auto", choices=("auto", *DTYPES),
                   help="the draft's dtype (auto: loading.resolve_dtype); rows and cached captures record it, "
                   "and a results file holds one dtype")
    add_task_args(p, tasks=["hotpotqa", "squad", "needle", "near_miss"], n=200, n_needle=100)
    p.add_argument("--keep-rates", type=float, nargs="+", default=[0.1, 0.3])
    p.add_argument("--variants", nargs="*", default=None, help="names from VARIANTS (default: all)")
    p.add_argument("--blocks", nargs="+", default=list(BLOCKS), type=_block_arg,
                   help=f"look-ahead blocks to capture for new examples: {', '.join(BLOCKS)}, or an early-exit one "
                   "for other aggregated layers, <kind>@<layers> (e.g. upper0.3@9-14); default: those the "
                   "variants read. Fewer is faster, and variants reading a block not captured fail")
    p.add_argument("--candidate-layers", nargs="+", default=[], metavar="A-B",
                   help="also measure the default scoring with its early exit after layer B, aggregating layers "
                   "A..B (exit_candidates; capture their blocks: --blocks ... greedyupper0.3@A-B upper0.3@A-B)")
    p.add_argument("--summary", action="store_true", help="print the table of the results file and exit")
    p.add_argument(
        "--reevaluate",
        action="store_true",
        help="recompute the chosen --variants for examples already in the results file, from the cached draft "
        "rows (after a change of defaults or a new variant; no draft runs)",
    )
    p.add_argument("--top", type=int, default=None, help="--summary: best N variants per keep rate")
    p.add_argument("--paired", default=None, metavar="VARIANT",
                   help="--summary: each variant's paired difference to this one, on the examples holding both")
    p.add_argument("--against", nargs=2, default=None, metavar=("FILE", "VARIANT"),
                   help="--summary --paired: pair with VARIANT of another results FILE (e.g. another draft or "
                   "dtype), by example; it enters as 'FILE: VARIANT'")
    p.add_argument("--draft-window", type=int, default=None, metavar="TOKENS",
                   help="the draft's window for this run (default: its own); longer prompts are read in windows "
                   "of it, scored by the library default only")
    p.add_argument("--tiny", action="store_true", help="tiny random models (smoke run; scores mean nothing)")
    p.add_argument("--out", default=None, help="results file (default benchmarks/results/evidence.jsonl)")
    return p.parse_args(argv)


@dataclass(frozen=True)
class Run:
    """What every example of a run is measured with."""

    args: argparse.Namespace
    tokenizer: Any  # the main model's: it lays out the prompt
    draft: Any  # DraftModel; None only under --reevaluate, which may load none
    variants: list[Variant]
    path: Path  # the results file


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    for tag in args.candidate_layers:
        VARIANTS.update((v.name, v) for v in exit_candidates(tag))
    offline()
    path = Path(args.out) if args.out else RESULTS_DIR / ("evidence_tiny.jsonl" if args.tiny else "evidence.jsonl")
    if args.summary:
        return show_summary(args, path)
    offline(args.threads)
    variants = [VARIANTS[n] for n in args.variants] if args.variants else list(VARIANTS.values())
    variants += [v for tag in args.candidate_layers for v in exit_candidates(tag) if v not in variants]
    tokenizer, draft = load_models(args)

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    todo = examples(args, count_tokens)
    if args.reevaluate:
        return reevaluate(tokenizer, todo, path, variants, args, draft)
    return measure(Run(args, tokenizer, draft, variants, path), todo)


def load_models(args: argparse.Namespace) -> tuple[Any, Any]:
    """(tokenizer, draft): the draft scores; the main model's tokenizer lays out the prompt (same
    family). No draft for --reevaluate (it loads one only for a capture lacking a block)."""
    if args.tiny:
        engine = build_engine(
            argparse.Namespace(tiny=True, main=args.main, draft=args.draft, lookahead=None, max_new_tokens=8)
        )
        tokenizer, draft = engine.tokenizer, engine.draft
    else:
        tokenizer = load_tokenizer(args.main)
        draft = None if args.reevaluate else DraftModel.from_pretrained(args.draft, dtype=args.draft_dtype)

    if draft is not None and args.draft_window:
        draft.model.config.max_position_embeddings = args.draft_window
    return tokenizer, draft


def measure(run: Run, todo: Sequence[Example]) -> int:
    """Each example of ``todo`` the results file lacks, appended as it is measured."""
    args, draft, path = run.args, run.draft, run.path
    rows = load_rows(path)
    done = {(r["task"], r["id"]): r for r in rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    dtype = next(draft.model.parameters()).dtype if draft is not None else resolve_dtype(args.draft_dtype)
    if not args.tiny:
        same_dtype(rows, dtype, path)
    draft_name = capture_name(args, dtype)
    started = time.perf_counter()
    for ex in todo:  # before any work: a resume that would mix two examples under one id is refused
        if (ex.task, ex.id) in done:
            same_example([done[(ex.task, ex.id)]], assemble(run.tokenizer, ex), path)
    for i, ex in enumerate(todo):
        if (ex.task, ex.id) in done:
            continue
        prompt = assemble(run.tokenizer, ex)
        step = f"[{i + 1}/{len(todo)}] {ex.task} {ex.id[:16]}"
        if draft is not None and not draft.fits(prompt.n_tokens, MAX_LOOKAHEAD):
            record = windowed_record(draft, prompt, ex, run.variants, args.keep_rates, args.seed * 1000 + i)
            if record is None:
                print(f"{step}: {prompt.n_tokens} tokens, and the draft's "
                      f"window of {draft.max_context} cannot hold it in windows: skipped", flush=True)
                continue
            append_jsonl(path, record)
            print(f"{step} n={prompt.n_tokens} read in {record['windows']} "
                  f"windows, draft {record['draft_s']:.1f} s, elapsed {time.perf_counter() - started:.0f} s",
                  flush=True)
            continue
        captured, draft_s = captured_rows(run, prompt, cache_path(ex, draft_name, prompt))
        results = evaluate(prompt, ex, captured, run.variants, args.keep_rates, args.seed * 1000 + i)
        record = {
            "task": ex.task, "id": ex.id, "n_prompt": prompt.n_tokens, "n_context": prompt.n_context,
            "prompt_sha": prompt_digest(prompt), "draft_s": draft_s, "draft_dtype": dtype_name(dtype),
            "results": results,
        }
        append_jsonl(path, record)
        print(f"{step} n={prompt.n_tokens} "
              f"draft {draft_s or 0:.1f} s, elapsed {time.perf_counter() - started:.0f} s", flush=True)
    return 0


def captured_rows(run: Run, prompt: Any, where: Path) -> tuple[dict[str, Any], float | None]:
    """The draft's rows of ``prompt``: from the capture cache at ``where`` (with the ``--blocks``
    it lacks added), else captured now and cached (not for --tiny); and the seconds the capture
    took (None: read from the cache)."""
    captured = load_capture(where)
    if captured is not None:
        if run.draft is not None and not set(run.args.blocks) <= set(captured.get("blocks", [])):
            captured = complete_rows(run.draft, prompt, captured, run.args.blocks)
            save_capture(captured, where)
        return captured, None
    t0 = time.perf_counter()
    captured = capture_rows(run.draft, prompt, run.args.blocks)
    draft_s = time.perf_counter() - t0
    if not run.args.tiny:
        where.parent.mkdir(parents=True, exist_ok=True)
        save_capture(captured, where)
    return captured, draft_s


if __name__ == "__main__":
    random.seed(0)
    sys.exit(main())
