"""Servers the tests start or fake on loopback: a scripted fake vLLM HTTP server (the client's
fault handling, refusals) and the gateway in a subprocess (gateway and router tests). Imported
as ``servers``; the ``serve`` fixture over the fake server is in conftest."""

from __future__ import annotations

import http.client
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from helpers import free_port

from specprefill_rag.config import GenerationConfig
from specprefill_rag.prompt import chat_segments

# -- a scripted fake vLLM server -----------------------------------------------------------------

SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"

Script = Callable[["Handler", int], None]  # writes the raw answer to the n-th request (1-based)


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # server_close() must not wait for a handler still streaming

    def __init__(self, script: Script) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.script = script
        self.requests: list[tuple[str, str, bytes, float]] = []  # method, path, body, arrival time
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.disconnected = threading.Event()  # a write found the client gone
        self.disconnected_at = 0.0

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    @property
    def bodies(self) -> list[bytes]:
        return [r[2] for r in self.requests]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeServer

    def do_GET(self) -> None:
        self._answer()

    def do_POST(self) -> None:
        self._answer()

    def _answer(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with self.server.lock:
            self.server.requests.append((self.command, self.path, body, time.monotonic()))
            n = len(self.server.requests)
        try:
            self.server.script(self, n)
        except OSError:  # the client hung up
            self.server.disconnected_at = time.monotonic()
            self.server.disconnected.set()
        self.close_connection = True

    def log_message(self, format: str, *args: object) -> None:
        pass

    def raw(self, data: bytes) -> None:
        self.wfile.write(data)

    def chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def json_reply(self, status: int, payload: object) -> None:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.raw(b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (status, len(body), body))

    def reset(self) -> None:
        """Abort the connection with a TCP RST (SO_LINGER 0), not a clean close."""
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.connection.close()


@contextmanager
def serving(server: ThreadingHTTPServer) -> Iterator[Any]:
    """``server`` answering in a thread inside the block, shut down and closed after it."""
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def app_in_thread(app: Any) -> Iterator[int]:
    """An ASGI ``app`` (the gateway) served by uvicorn in a thread on a free loopback port, inside
    the block; its port."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.02)
    assert server.started, "uvicorn did not start"
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


def stream(*chunks: bytes) -> Script:
    """A complete chunked SSE answer made of ``chunks``, ended by ``[DONE]``."""
    def script(h: Handler, n: int) -> None:
        h.raw(SSE_HEAD)
        for data in chunks:
            h.chunk(data)
        h.chunk(b"data: [DONE]\n\n")
        h.raw(b"0\r\n\r\n")
    return script


# -- the gateway in a subprocess ----------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
KEY = "test-key"
START_TIMEOUT_S = 120.0

PASSAGES = [
    "The quick brown fox jumps over the lazy dog near the river bank. The sky is blue. The grass is green.",
    "The passkey is 48213. Remember it. The sun is yellow. Here we go. There and back again.",
    "Alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho.",
    "Context: passages retrieved for the question. The quick brown fox jumps over the lazy dog.",
]
QUESTION = "What is the passkey?"
SYSTEM = "Answer the question using the context. Be concise."


def get(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


class GatewayProcess:
    """``specprefill-rag gateway ...`` in a subprocess on a free loopback port; stopped by PID."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.port = free_port()
        self.log_path = log
        self._log = open(log, "wb")  # noqa: SIM115
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        env.pop("SPECPREFILL_API_KEY", None)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "specprefill_rag.tools.cli", "gateway", "--host", "127.0.0.1",
             "--port", str(self.port), "--log-level", "warning", *args],
            cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
        )

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"the gateway exited with code {self.process.returncode}:\n{self.log_tail()}")
            try:
                if get(self.port, "/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.25)
        pytest.fail(f"the gateway was not ready within {START_TIMEOUT_S:.0f} s:\n{self.log_tail()}")

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def health(self) -> dict:
        return json.loads(get(self.port, "/health")[1])

    def metrics(self) -> str:
        return get(self.port, "/metrics")[1]

    def client(self, api_key: str = KEY, timeout: float = 60.0) -> Any:
        import openai

        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=api_key, max_retries=0,
                             timeout=timeout)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self._log.close()


def expected(engine, question: str, passages: list[str], max_tokens: int, system: str | None = SYSTEM) -> object:
    turns = ([("system", system)] if system else []) + [("user", question)]
    return engine.generate(chat_segments(turns, passages), generation=GenerationConfig(max_new_tokens=max_tokens))


def chat_request(question: str = QUESTION, passages: list[str] = PASSAGES, **kwargs) -> dict:
    request = dict(
        model="anything",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=8,
        extra_body={"specprefill": {"passages": passages}},
    )
    return {**request, **kwargs}


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one Prometheus sample (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        key, value = line.rsplit(" ", 1)
        sample, _, rest = key.partition("{")
        if sample == name and ",".join(sorted(rest.rstrip("}").split(","))) == want:
            return float(value)
    return 0.0
