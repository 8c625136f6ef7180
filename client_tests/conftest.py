"""The client side in its own environment (.venv-client: current LlamaIndex / LangChain, no vLLM)
against a real vLLM server started from the core environment.

``SPECPREFILL_VLLM_PYTHON`` names that environment's interpreter (``make test`` sets it); the
server (SmolLM2-135M on CPU, our plugin) and a gateway in front of it start once per session and
are stopped by PID.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from specprefill_rag.config import GenerationConfig, SelectionConfig, SpecPrefillConfig
from specprefill_rag.engine import SpecPrefillEngine
from specprefill_rag.tools.vllm_process import VLLMServer

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
KEY = "client-test-key"
KEEP_RATE = 0.3
MAX_NEW_TOKENS = 12
START_TIMEOUT_S = 600.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(port: int, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def engine_config() -> SpecPrefillConfig:
    """What the gateway runs with ``--keep-rate`` and ``--max-new-tokens`` (cli._gateway_config)."""
    return SpecPrefillConfig(selection=SelectionConfig(keep_rate=KEEP_RATE, token_budget=None),
                             generation=GenerationConfig(max_new_tokens=MAX_NEW_TOKENS))


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory) -> Iterator[VLLMServer]:
    python = os.environ.get("SPECPREFILL_VLLM_PYTHON")
    if not python:
        pytest.skip("set SPECPREFILL_VLLM_PYTHON to the interpreter of the environment with vLLM (make test does)")
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    server = VLLMServer(MODEL, port=free_port(), max_model_len=4096, log_path=log, python=python,
                        extra_args=["--max-num-seqs", "8"])
    try:
        server.start(timeout=START_TIMEOUT_S)
        yield server
    finally:
        server.stop()


class Gateway:
    """``specprefill-rag gateway --backend vllm_server`` in this environment, on a free port."""

    def __init__(self, vllm_url: str, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self._log = open(log, "wb")  # noqa: SIM115
        self.log_path = log
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "specprefill_rag.tools.cli", "gateway", "--backend", "vllm_server",
             "--vllm-url", vllm_url, "--main", MODEL, "--draft", MODEL, "--keep-rate", str(KEEP_RATE),
             "--max-new-tokens", str(MAX_NEW_TOKENS), "--api-key", KEY, "--host", "127.0.0.1",
             "--port", str(self.port), "--log-level", "warning"],
            cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.stop()
                pytest.fail(f"the gateway exited with code {self.process.returncode}:\n{self.log_tail()}")
            try:
                if get(self.port, "/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        pytest.fail(f"the gateway was not ready in time:\n{self.log_tail()}")

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def metrics(self) -> str:
        return get(self.port, "/metrics")[1]

    def health(self) -> dict:
        return json.loads(get(self.port, "/health")[1])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self._log.close()


@pytest.fixture(scope="session")
def gateway(vllm_server, tmp_path_factory) -> Iterator[Gateway]:
    process = Gateway(vllm_server.url, tmp_path_factory.mktemp("gateway") / "gateway.log")
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="session")
def engine(vllm_server) -> SpecPrefillEngine:
    """The gateway's engine, built again in this process against the same vLLM server."""
    return SpecPrefillEngine.from_pretrained(MODEL, MODEL, backend="vllm_server", base_url=vllm_server.url,
                                             config=engine_config(), read_timeout=300)
