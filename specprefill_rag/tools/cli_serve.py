"""The server commands: ``serve`` (vLLM with the plugin, and optionally the gateway in front of
it) and ``gateway`` (the OpenAI-compatible gateway over one engine)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..gateway import require_installed as _require_gateway
from .cli_parser import passage_options

__all__ = ["gateway_command", "serve_command", "vllm_server_options"]


def serve_command(args: argparse.Namespace) -> int:
    """``specprefill-rag serve``: vLLM in the foreground, or with ``--gateway-port`` the whole stack."""
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
             "prefix_cache_entries": args.draft_prefix_cache, "lookahead_stop_at_eos": args.lookahead_stop_at_eos,
             "skip_when_slower": args.skip_draft_when_slower, "batch_pad_limit": args.draft_batch_pad_limit,
             "passes_in_order": args.draft_passes_in_order, "echo_question": args.echo_question}
    draft = {name: value for name, value in draft.items() if value is not None}
    draft.update(passage_options(args, config.draft.passages))  # passages=None (joint) is a setting too
    if draft:
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


def _read_cache_secret(path: str) -> bytes:
    """The cache secret in the file at ``path`` (white space around it dropped, so a line written by
    ``echo`` or ``openssl rand -hex 32 > FILE`` reads as its text); ``ValueError`` when it is too
    short to be a secret. The secret itself is never printed."""
    from ..gateway.admission import MIN_SECRET_BYTES

    with open(path, "rb") as file:
        secret = file.read().strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{path} holds {len(secret)} bytes; a cache secret needs {MIN_SECRET_BYTES} or more "
                         "(e.g. openssl rand -hex 32)")
    return secret


def _run_gateway(engine: Any, args: argparse.Namespace, *, host: str, port: int, model_name: str | None) -> int:
    from ..gateway import create_app, run_app

    _require_gateway()
    try:
        api_keys = _read_api_keys(args.api_keys_file) if args.api_keys_file else {}
    except (OSError, ValueError) as error:
        print(f"error: --api-keys-file: {error}", file=sys.stderr)
        return 2
    try:
        secret = _read_cache_secret(args.cache_secret_file) if args.cache_secret_file else None
    except (OSError, ValueError) as error:
        print(f"error: --cache-secret-file: {error}", file=sys.stderr)
        return 2
    app = create_app(engine, api_key=args.api_key, api_keys=api_keys, cache_secret=secret, max_queue=args.max_queue,
                     max_concurrency=args.max_concurrency, model_name=args.model_name or model_name,
                     max_body_bytes=args.max_body_bytes, max_body_bytes_in_flight=args.max_body_bytes_in_flight,
                     default_mode=args.default_mode, fallback_text_mode=args.fallback_text_mode)
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


def vllm_server_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``vllm_server`` backend's keywords from ``gateway``'s flags (``create_backend``); an
    unset ``--vllm-plugin-retry-s`` leaves the backend's default."""
    options = {"base_url": args.vllm_url, "model": args.served_model_name, "max_context": args.max_model_len,
               "api_key": args.vllm_api_key or None}
    if args.vllm_plugin_retry_s is not None:
        options["plugin_retry_s"] = args.vllm_plugin_retry_s
    return options


def gateway_command(args: argparse.Namespace) -> int:
    """``specprefill-rag gateway``: the gateway over an engine built here or by ``--engine``."""
    from ..config import SpecPrefillConfig
    from ..engine import SpecPrefillEngine
    from ..errors import BackendError

    _require_gateway()
    if args.engine:
        engine = _factory_engine(args.engine)
        if not isinstance(engine, SpecPrefillEngine):
            raise ValueError(f"--engine {args.engine} returned {type(engine).__name__}, not a SpecPrefillEngine")
        if args.passage_store is not None and (engine.draft is None or
                                               engine.draft.config.passage_store_dir != args.passage_store):
            raise ValueError("--passage-store cannot reach the draft --engine built: give its DraftModel "
                             "DraftConfig(passage_store_dir=...) in the factory")
        config = _gateway_config(args, engine.config)
        if config != engine.config:  # the draft batcher is built from the config: a new engine, same models
            engine = SpecPrefillEngine(engine.backend, engine.draft, config)
        return _run_gateway(engine, args, host=args.host, port=args.port, model_name=None)
    config = _gateway_config(args, SpecPrefillConfig())
    kwargs = vllm_server_options(args) if args.backend == "vllm_server" else {}
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
    from .vllm_process import LaunchOptions, VLLMServer

    if not args.draft:
        print("error: the gateway needs a draft model: add --draft DRAFT", file=sys.stderr)
        return 2
    _require_gateway()
    config = _gateway_config(args, SpecPrefillConfig())
    launch = LaunchOptions(host=args.host, port=args.port, log_path=args.vllm_log)
    server = VLLMServer(args.model, launch=launch, max_model_len=args.max_model_len,
                        extra_args=shlex.split(args.vllm_args), dtype=args.dtype)
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
