"""The ``specprefill-rag`` command line's arguments: one parser, a subparser per command.

The commands themselves are in ``cli`` (demo, ask, encode, bench, prepare) and ``cli_serve``
(serve, gateway). ``passage_options`` turns the passage-reading flags into ``DraftConfig`` fields.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, get_args

from ..backends.vllm_server import ConnectionOptions
from ..config import GenerationConfig, LookaheadTokens, PassageReading, SelectionConfig
from ..loading import DEFAULT_DRAFT, DEFAULT_MAIN

__all__ = ["DESCRIPTION", "build_parser", "passage_options"]

DESCRIPTION = """``specprefill-rag`` command line: demo, ask, encode, serve, gateway, bench, prepare.

The CLI is the one place that prints; the library logs.
"""


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
    parser.add_argument(
        "--echo-question", default=None, action=argparse.BooleanOptionalAction,
        help="where tool results follow the question, the draft reads the question again after them, or reads "
        "the prompt as it stands (default: the library's DraftConfig.echo_question; docs/tools.md)",
    )


def _passage_args(parser: Any) -> None:
    """--read-passages / --passage-store: how the draft reads passages (``passage_options``)."""
    parser.add_argument(
        "--read-passages", default=None, choices=["joint", "apart"],
        help="how the draft reads retrieved passages: joint (every prompt whole, every time) or apart (each "
        "passage once, after the prompt's head, kept and reused wherever it comes again; DraftConfig.passages, "
        "docs/configuration.md) (default: joint; apart with --passage-store)",
    )
    parser.add_argument(
        "--passage-store", default=None, metavar="DIR",
        help="a directory that keeps the draft's passage readings beyond memory and restarts, as "
        "`specprefill-rag encode` fills it (DraftConfig.passage_store_dir; reads passages apart) "
        "(default: memory only)",
    )


def passage_options(args: argparse.Namespace, current: PassageReading | None = None) -> dict[str, Any]:
    """The ``DraftConfig`` fields ``--read-passages`` and ``--passage-store`` set (none when neither
    is given): ``passages`` (``current``, else ``PassageReading()``, for apart; None for joint) and
    ``passage_store_dir``. A store reads apart; with ``joint`` it is a ``ValueError``."""
    mode, store = args.read_passages, args.passage_store
    if store is not None and mode == "joint":
        raise ValueError("--passage-store keeps passages the draft reads apart: drop --read-passages joint")
    options: dict[str, Any] = {}
    if mode == "joint":
        options["passages"] = None
    elif mode == "apart" or store is not None:
        options["passages"] = current or PassageReading()
    if store is not None:
        options["passage_store_dir"] = store
    return options


def _model_args(parser: argparse.ArgumentParser) -> None:
    """The models and how the draft runs: what ``cli._build_engine`` builds an engine from."""
    add = parser.add_argument
    add("--main", default=DEFAULT_MAIN, help="main model: packaged short name, HF directory or .gguf (%(default)s)")
    add("--draft", default=DEFAULT_DRAFT, help="draft model; another tokenizer is mapped (%(default)s)")
    parser.add_argument(
        "--lookahead", type=int, default=None, help="draft look-ahead queries L (default: the library's DraftConfig)"
    )
    _lookahead_args(parser)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    _device_args(parser, whose="the draft and the main model")


def _engine_args(parser: argparse.ArgumentParser, *, keep_rate: float, top_k: int, max_new_tokens: int) -> None:
    _model_args(parser)
    add = parser.add_argument
    add(
        "--keep-rate", type=float, default=keep_rate,
        help="fraction of the context (retrieved passages) prefilled; the question and instructions "
        "always are (%(default)s)",
    )
    add("--top-k", type=int, default=top_k, help="passages retrieved (default: %(default)s)")
    add("--max-new-tokens", type=int, default=max_new_tokens, help="answer length limit (default: %(default)s)")
    _passage_args(parser)


def _draft_runtime_args(group: Any) -> None:
    """How the gateway's draft serves concurrent requests (``DraftRuntime``): batching, the order of
    its passes, its caches, and skipping it when it would not pay."""
    add = group.add_argument
    add("--draft-batch", type=int, default=None,
        help="concurrent requests scored in one draft batch, DraftConfig.max_batch (default: the engine's; "
        "worth raising on a GPU)")
    add("--draft-passes-in-order", default=None, action=argparse.BooleanOptionalAction,
        help="concurrent requests' draft passes run one at a time in arrival order, so each goes on to the main "
        "model as soon as its own pass ends, DraftConfig.passes_in_order (default: the engine's, off)")
    add("--draft-batch-pad-limit", type=float, default=None,
        help="most share of a padded draft pass that may be padding: a batch splits into passes of near-equal "
        "prompt lengths, DraftConfig.batch_pad_limit (default: the engine's, 0.25; 1: one pass)")
    add("--draft-memo", type=int, default=None,
        help="prompts whose draft scores are kept, so an identical request (a retry) skips the draft, "
        "DraftConfig.memo_entries (default: the engine's, 32; 0: off)")
    add("--skip-draft-when-slower", default=None, action=argparse.BooleanOptionalAction,
        help="prefill a prompt whole when the draft's queue and scoring would take longer than the prefill "
        "pruning saves, from the engine's running measurements, DraftConfig.skip_when_slower (default: the "
        "engine's, off)")
    add("--draft-prefix-cache", type=int, default=None,
        help="prompt heads (system prompt, a chat's earlier turns) whose draft keys and values are kept, so a "
        "request that begins with one is read from where it ends, DraftConfig.prefix_cache_entries "
        "(default: the engine's, 8; 0: off)")


def _gateway_args(group: Any) -> None:
    add = group.add_argument
    add("--api-key", default=os.environ.get("SPECPREFILL_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $SPECPREFILL_API_KEY; unset: open)")
    add("--api-keys-file", default=os.environ.get("SPECPREFILL_API_KEYS_FILE"),
        help="a JSON object of tenant name -> API key (or list of keys): each tenant's requests share cached "
        "work only with the same tenant's (default: $SPECPREFILL_API_KEYS_FILE; unset: none)")
    add("--cache-secret-file", default=os.environ.get("SPECPREFILL_CACHE_SECRET_FILE"),
        help="a file holding the secret (16 bytes or more) every request's cache namespace is keyed with; give "
        "gateways behind one router the same file so a tenant shares vLLM's prefix cache across them (default: "
        "$SPECPREFILL_CACHE_SECRET_FILE; unset: a random secret at each start)")
    add("--keep-rate", type=float, default=None, help="default share of the context prefilled (default: the engine's)")
    add("--max-new-tokens", type=int, default=None,
        help="answer length when a request sets no max_tokens (default: the engine's)")
    add("--max-queue", type=int, default=64, help="requests in flight (running or waiting) before HTTP 429 "
        "(%(default)s)")
    add("--max-concurrency", type=int, default=None,
        help="requests generating at once (default: max(4, --draft-batch))")
    _lookahead_args(group)
    _draft_runtime_args(group)
    _passage_args(group)
    add("--default-mode", default=None, choices=["specprefill", "full", "text"],
        help="mode of a request whose specprefill.mode is unset: specprefill (the kept tokens at their original "
        "positions: the main model here or a vLLM with the plugin), full, or text (the kept text as an ordinary "
        "chat to the upstream's /v1/chat/completions: any OpenAI-compatible server) (default: specprefill with a "
        "draft, else full)")
    add("--fallback-text-mode", action="store_true",
        help="answer a planned request in text mode when its vLLM upstream has no SpecPrefill plugin, instead of "
        "failing with HTTP 502 (reported in the answer's specprefill.fallback)")
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
    gateway.add_argument("--vllm-api-key", default=os.environ.get("SPECPREFILL_UPSTREAM_API_KEY"),
                         help="the upstream's API key, sent as 'Authorization: Bearer KEY' (vLLM's --api-key, or an "
                         "OpenAI-compatible service's for text mode) (default: $SPECPREFILL_UPSTREAM_API_KEY; unset: "
                         "none)")
    gateway.add_argument("--vllm-plugin-retry-s", type=float, default=None,
                         help="seconds a failed plugin check stands, in which planned requests fail (or fall back "
                         "to text mode) without another check; 0 checks before every plan: behind a router over "
                         "a mixed fleet, where the check may reach a replica without the plugin (default: the "
                         f"backend's, {ConnectionOptions.plugin_retry_s:g})")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specprefill-rag", description=DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true", help="log library progress")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="answer a question over the bundled documents, full prefill vs SpecPrefill")
    demo.add_argument("--question", default=None, help="question (default: the bundled demo question)")
    demo.add_argument("--docs", default=None, help="directory or file of .md/.txt documents (default: bundled)")
    demo.add_argument("--follow-up", default=None,
                      help="a second question over the same passages, answered warm (default: the bundled one "
                      "without --question or --docs; '' for none)")
    _engine_args(demo, keep_rate=0.1, top_k=12, max_new_tokens=40)

    ask = sub.add_parser("ask", help="answer one question over your documents with SpecPrefill")
    ask.add_argument("question")
    ask.add_argument("--docs", required=True, help="directory or file of .md/.txt documents")
    ask.add_argument("--full", action="store_true", help="full prefill instead of SpecPrefill")
    _engine_args(ask, keep_rate=0.2, top_k=8, max_new_tokens=128)

    encode = sub.add_parser(
        "encode", help="read every passage of your documents ahead of questions into a passage store on disk, "
        "which ask, demo, serve and gateway read with --passage-store DIR (docs/configuration.md)",
    )
    encode.add_argument("--docs", default=None, help="directory or file of .md/.txt documents (default: bundled)")
    encode.add_argument("--passage-store", required=True, metavar="DIR",
                        help="the store's directory, created if missing (DraftConfig.passage_store_dir)")
    _model_args(encode)
    # Nothing is answered: the engine is built with the library's selection and generation settings.
    encode.set_defaults(read_passages="apart", keep_rate=SelectionConfig().keep_rate,
                        max_new_tokens=GenerationConfig().max_new_tokens)

    _add_serve(sub)
    _add_gateway(sub)

    bench = sub.add_parser(
        "bench",
        help="benchmarks from a source checkout: ttft | quality | evidence | peer_evidence | guesses | lookahead_cost "
        "| windows | gateway_load | serving | draft_batch | tool_rag | reuse | reading | prefix_cache | plugin_step "
        "(benchmarks/suites/) "
        "| report "
        "(`bench SUITE --help`: options)",
        add_help=False,
    )
    bench.add_argument(
        "suite", choices=["ttft", "quality", "evidence", "peer_evidence", "guesses", "lookahead_cost", "windows",
                  "gateway_load", "prefix_cache", "plugin_step", "serving", "draft_batch", "tool_rag", "reuse",
                  "reading", "report"]
    )
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="options passed to the suite")

    prepare = sub.add_parser("prepare", help="fetch and convert packaged models into the cache")
    prepare.add_argument("models", nargs="*", default=[DEFAULT_DRAFT, DEFAULT_MAIN])
    return parser
