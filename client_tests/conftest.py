"""The client side in its own environment (.venv-client: current LlamaIndex / LangChain, no vLLM)
against a real vLLM server started from the core environment.

``SPECPREFILL_VLLM_PYTHON`` names that environment's interpreter (``make test`` sets it); the
server (SmolLM2-135M on CPU, our plugin) and a gateway in front of it start once per session and
are stopped by PID.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from specprefill_rag.config import GenerationConfig, SelectionConfig, SpecPrefillConfig
from specprefill_rag.engine import SpecPrefillEngine
from specprefill_rag.tools.retrieval import demo_documents, demo_questions, split_passages
from specprefill_rag.tools.vllm_process import LaunchOptions, VLLMServer

# The gateway's own test helpers, imported as the core suite imports them (tests/ on the path).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import free_port  # noqa: E402
from servers import GatewayProcess  # noqa: E402

MODEL = "smollm2-135m-instruct"
KEY = "client-test-key"
KEEP_RATE = 0.3
MAX_NEW_TOKENS = 12
START_TIMEOUT_S = 600.0

QUESTION = demo_questions()[0]
PASSAGES = [p.text for p in split_passages(demo_documents())[:6]]
SYSTEM = ("You are an assistant for question-answering tasks. Use the following pieces of retrieved context to "
          "answer the question. If you don't know the answer, say that you don't know. Use three sentences "
          "maximum and keep the answer concise.\n\n")
# LangChain's create_stuff_documents_chain tutorial prompt, documents joined as it joins them.
MESSAGES = [{"role": "system", "content": SYSTEM + "\n\n".join(PASSAGES)},
            {"role": "user", "content": QUESTION.question}]


def engine_config() -> SpecPrefillConfig:
    """What the gateway runs with ``--keep-rate`` and ``--max-new-tokens`` (cli._gateway_config)."""
    return SpecPrefillConfig(selection=SelectionConfig(keep_rate=KEEP_RATE, token_budget=None),
                             generation=GenerationConfig(max_new_tokens=MAX_NEW_TOKENS))


def _serve(tmp_path_factory: pytest.TempPathFactory, name: str, env: dict[str, str] | None,
           max_num_seqs: int) -> Iterator[VLLMServer]:
    """SmolLM2-135M in a vLLM server started from the core environment, stopped by PID."""
    python = os.environ.get("SPECPREFILL_VLLM_PYTHON")
    if not python:
        pytest.skip("set SPECPREFILL_VLLM_PYTHON to the interpreter of the environment with vLLM (make test does)")
    log = tmp_path_factory.mktemp(name) / "server.log"
    server = VLLMServer(MODEL, launch=LaunchOptions(port=free_port(), log_path=log, python=python, env=env),
                        max_model_len=4096, extra_args=["--max-num-seqs", str(max_num_seqs)])
    try:
        server.start(timeout=START_TIMEOUT_S)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory) -> Iterator[VLLMServer]:
    yield from _serve(tmp_path_factory, "vllm", None, 8)


@pytest.fixture(scope="session")
def stock_vllm_server(tmp_path_factory) -> Iterator[VLLMServer]:
    """The same server without our plugin (``VLLM_PLUGINS=""`` loads no general plugin): what a
    user of portable mode answers from. Started on first use only."""
    yield from _serve(tmp_path_factory, "stock-vllm", {**os.environ, "VLLM_PLUGINS": ""}, 4)


@pytest.fixture(scope="session")
def gateway(vllm_server, tmp_path_factory) -> Iterator[GatewayProcess]:
    """``specprefill-rag gateway --backend vllm_server`` in this environment, on a free port."""
    process = GatewayProcess(
        ["--backend", "vllm_server", "--vllm-url", vllm_server.url, "--main", MODEL, "--draft", MODEL,
         "--keep-rate", str(KEEP_RATE), "--max-new-tokens", str(MAX_NEW_TOKENS), "--api-key", KEY],
        tmp_path_factory.mktemp("gateway") / "gateway.log",
    )
    try:
        process.wait_ready(time.monotonic() + START_TIMEOUT_S)
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="session")
def engine(vllm_server) -> SpecPrefillEngine:
    """The gateway's engine, built again in this process against the same vLLM server."""
    return SpecPrefillEngine.from_pretrained(MODEL, MODEL, backend="vllm_server", base_url=vllm_server.url,
                                             config=engine_config(), read_timeout=300)
