"""The vLLM server client's fault handling, against fake servers (no vLLM needed)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from helpers import PLAN, free_port
from helpers import eos_tokenizer as tokenizer
from helpers import fake_client as client

from specprefill_rag.backends import available_backends
from specprefill_rag.backends.vllm_server import ConnectionOptions, VLLMServerBackend
from specprefill_rag.config import GenerationConfig
from specprefill_rag.errors import BackendError, ServerError
from specprefill_rag.types import PrefillPlan


@pytest.fixture
def fake_server() -> Iterator[tuple[int, list[bytes]]]:
    """A TCP server on loopback that reads requests and answers ``replies[0]`` (or never answers)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    replies: list[bytes] = []
    stop = threading.Event()
    conns: list[socket.socket] = []

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            conns.append(conn)
            conn.recv(65536)
            if replies:
                conn.sendall(replies[0])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield listener.getsockname()[1], replies
    stop.set()
    thread.join(2)
    for conn in conns:
        conn.close()
    listener.close()


def test_registered():
    assert {"vllm_offline", "vllm_server"} <= set(available_backends())


def test_unreachable_server_fails_after_retries():
    backend = client(free_port(), max_retries=2, retry_backoff=0.1, connect_timeout=1.0)
    started = time.perf_counter()
    with pytest.raises(BackendError, match=r"cannot reach the vLLM server at http://127.0.0.1:\d+ .*3 attempts"):
        list(backend.stream_tokens(PLAN, GenerationConfig(max_new_tokens=3)))
    assert time.perf_counter() - started < 5


def test_unreachable_server_at_construction():
    with pytest.raises(BackendError, match="cannot reach the vLLM server"):
        VLLMServerBackend(f"http://127.0.0.1:{free_port()}", tokenizer, connection=ConnectionOptions(max_retries=0))


def test_silent_server_times_out(fake_server):
    port, _ = fake_server
    backend = client(port, read_timeout=1.0)
    started = time.perf_counter()
    with pytest.raises(BackendError, match="sent nothing for 1 s"):
        list(backend.stream_tokens(PLAN, GenerationConfig(max_new_tokens=3)))
    assert time.perf_counter() - started < 5


def test_stalled_stream_times_out(fake_server):
    port, replies = fake_server
    replies.append(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
                   b'data: {"choices": [{"index": 0, "token_ids": [11]}]}\n\n')
    backend = client(port, read_timeout=1.0)
    tokens = backend.stream_tokens(PLAN, GenerationConfig(max_new_tokens=3))
    assert next(tokens) == 11  # the first token arrives; then the server goes quiet
    with pytest.raises(BackendError, match="sent nothing for 1 s mid-stream"):
        next(tokens)


@pytest.mark.parametrize("status", [400, 404, 500, 503])
def test_http_errors_carry_status_and_message(fake_server, status):
    port, replies = fake_server
    body = b'{"error": {"message": "the reason", "code": %d}}' % status
    replies.append(b"HTTP/1.1 %d Err\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                   % (status, len(body), body))
    with pytest.raises(ServerError, match=f"answered /v1/completions with HTTP {status}: the reason") as info:
        list(client(port, max_retries=0).stream_tokens(PLAN, GenerationConfig(max_new_tokens=3)))
    assert info.value.status == status


def test_error_event_mid_stream(fake_server):
    port, replies = fake_server
    replies.append(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
                   b'data: {"error": {"message": "engine died", "code": 500}}\n\n')
    with pytest.raises(ServerError, match="failed mid-stream: engine died"):
        list(client(port).stream_tokens(PLAN, GenerationConfig(max_new_tokens=3)))


def test_stream_parsing_stops_at_eos(fake_server):
    port, replies = fake_server
    replies.append(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
                   b'data: {"choices": [{"index": 0, "token_ids": [11, 12], '
                   b'"logprobs": {"token_logprobs": [-0.5, -1.5]}}]}\n\n'
                   b'data: {"choices": [{"index": 0, "token_ids": [2]}]}\n\ndata: [DONE]\n\n')
    steps = list(client(port).stream_steps(PLAN, GenerationConfig(max_new_tokens=3), logprobs=True))
    assert [(s.token_id, s.logprob) for s in steps] == [(11, -0.5), (12, -1.5)]


@pytest.mark.parametrize(
    "plan, message",
    [
        (PrefillPlan(torch.tensor([5, 6]), torch.tensor([4, 2]), 12, 12, (), True), "sorted ascending"),
        (PrefillPlan(torch.tensor([5, 6]), torch.tensor([4, 4]), 12, 12, (), True), "duplicate position 4"),
        (PrefillPlan(torch.tensor([5, 6]), torch.tensor([4, 150]), 151, 151, (), True), "beyond the main model"),
        (PrefillPlan(torch.tensor([5, 6]), torch.tensor([-1, 5]), 12, 12, (), True), "must be >= 0"),
    ],
)
def test_bad_plans_rejected_before_sending(plan, message):
    backend = client(free_port(), max_retries=0)  # nothing listens: validation comes first
    with pytest.raises(ValueError, match=message):
        list(backend.stream_tokens(plan, GenerationConfig(max_new_tokens=3)))


def test_bad_base_url():
    with pytest.raises(ValueError, match="base_url must look like"):
        VLLMServerBackend("ftp://x", tokenizer, model="m", max_context=10)
