"""The vLLM server client under broken servers: malformed answers, deadlines, retries, early close.

Fake HTTP servers on loopback (``http.server`` in a daemon thread) play each fault; no vLLM needed.
Every server loop is bounded and every test ends well within a few seconds.
"""

from __future__ import annotations

import http.client
import json
import time

import pytest
import torch
from helpers import PLAN, eos_tokenizer, free_port
from helpers import fake_client as client
from servers import SSE_HEAD, FakeServer, Handler, Script, stream

from specprefill_rag.backends import vllm_http
from specprefill_rag.backends.vllm_server import VLLMServerBackend
from specprefill_rag.config import GenerationConfig
from specprefill_rag.errors import BackendError, BackendTimeoutError, PlanError, ServerError
from specprefill_rag.types import PrefillPlan

GEN = GenerationConfig(max_new_tokens=3)
CLOSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"




def event(*ids: object, **choice: object) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "token_ids": list(ids), **choice}]}).encode() + b"\n\n"


def status_then_stream(statuses: list[int]) -> Script:
    """HTTP ``statuses[n - 1]`` to the n-th request, a one-token stream after they run out."""
    def script(h: Handler, n: int) -> None:
        if n <= len(statuses):
            h.json_reply(statuses[n - 1], {"error": {"message": f"status {statuses[n - 1]}"}})
        else:
            stream(event(11))(h, n)
    return script


def collect(backend: VLLMServerBackend, generation: GenerationConfig = GEN) -> list[int]:
    return list(backend.stream_tokens(PLAN, generation))


# -- malformed answers ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, cause, what",
    [
        (b"data: {not json\n\n", json.JSONDecodeError, "JSONDecodeError"),
        (b"data: \xff\xfe{}\n\n", UnicodeDecodeError, "UnicodeDecodeError"),
        (b'data: {"choices": [{"token_ids": [1], "text": "\xc3("}]}\n\n', UnicodeDecodeError, "UnicodeDecodeError"),
        (b"data: [1, 2]\n\n", TypeError, "an event must be a JSON object, got list"),
        (b'data: {"choices": "oops"}\n\n', TypeError, "'choices' must be a list, got str"),
        (b'data: {"choices": ["oops"]}\n\n', TypeError, "a choice must be a JSON object"),
        (b'data: {"choices": [{"token_ids": ["a", "b"]}]}\n\n', TypeError, "'token_ids' must be a list of ints"),
        (b'data: {"choices": [{"token_ids": 7}]}\n\n', TypeError, "'token_ids' must be a list of ints"),
        (b'data: {"choices": [{"token_ids": [true]}]}\n\n', TypeError, "'token_ids' must be a list of ints"),
        (b'data: {"choices": [{"token_ids": [1.5]}]}\n\n', TypeError, "'token_ids' must be a list of ints"),
    ],
)
def test_malformed_event_is_a_backend_error(serve, data, cause, what):
    server = serve(stream(event(11), data))
    with pytest.raises(BackendError, match="malformed stream event") as info:
        collect(client(server.port))
    assert type(info.value) is BackendError
    assert isinstance(info.value.__cause__, cause)
    assert f"http://127.0.0.1:{server.port}" in str(info.value) and what in str(info.value)
    assert len(server.requests) == 1  # a token was streamed: never re-sent


@pytest.mark.parametrize("logprobs", [{"token_logprobs": "x"}, {"token_logprobs": ["x"]}, [0.1]])
def test_malformed_logprobs(serve, logprobs):
    server = serve(stream(event(11, logprobs=logprobs)))
    with pytest.raises(BackendError, match="malformed stream event.*logprobs") as info:
        list(client(server.port).stream_steps(PLAN, GEN, logprobs=True))
    assert isinstance(info.value.__cause__, TypeError)


def test_missing_logprobs_and_ids_are_tolerated(serve):
    server = serve(stream(b'data: {"choices": [{"index": 0, "token_ids": null, "text": ""}]}\n\n',
                          b'data: {"choices": []}\n\n', b'data: {"usage": {}}\n\n',
                          event(11, logprobs=None), event(12, logprobs={"token_logprobs": [None]})))
    steps = list(client(server.port).stream_steps(PLAN, GEN, logprobs=True))
    assert [(s.token_id, s.logprob) for s in steps] == [(11, None), (12, None)]


def test_body_cut_mid_chunk(serve):
    def script(h: Handler, n: int) -> None:
        h.raw(SSE_HEAD)
        h.chunk(event(11))
        h.raw(b"100\r\n" + event(12)[:20])  # announces 256 bytes, sends half an event, then closes

    server = serve(script)
    tokens = client(server.port).stream_tokens(PLAN, GEN)
    assert next(tokens) == 11
    with pytest.raises(BackendError, match=rf"127\.0\.0\.1:{server.port} failed mid-stream: IncompleteRead") as info:
        next(tokens)
    assert isinstance(info.value.__cause__, http.client.IncompleteRead)


def test_connection_reset_mid_stream(serve):
    def script(h: Handler, n: int) -> None:
        h.raw(SSE_HEAD)
        h.chunk(event(11))
        time.sleep(0.2)  # the client reads the token first
        h.reset()

    server = serve(script)
    tokens = client(server.port).stream_tokens(PLAN, GEN)
    assert next(tokens) == 11
    with pytest.raises(BackendError, match="failed mid-stream: ConnectionResetError") as info:
        next(tokens)
    assert isinstance(info.value.__cause__, ConnectionResetError)
    assert len(server.requests) == 1


def test_stream_closed_early(serve):
    def script(h: Handler, n: int) -> None:
        h.raw(SSE_HEAD)
        h.chunk(event(11))
        h.raw(b"0\r\n\r\n")  # a clean end without [DONE]

    server = serve(script)
    with pytest.raises(BackendError, match="closed the stream early"):
        collect(client(server.port))


def test_overlong_line(serve, monkeypatch):
    monkeypatch.setattr(vllm_http, "_MAX_LINE", 1000)
    server = serve(stream(b"data: " + b"x" * 5000))
    with pytest.raises(BackendError, match="stream line over 1000 bytes"):
        collect(client(server.port))


def test_error_event_is_a_server_error(serve):
    server = serve(stream(event(11), b'data: {"error": {"message": "engine died", "code": 500}}\n\n'))
    with pytest.raises(ServerError, match="failed mid-stream: engine died") as info:
        collect(client(server.port))
    assert info.value.status is None and len(server.requests) == 1


def test_unreadable_error_body_keeps_the_status(serve):
    def script(h: Handler, n: int) -> None:
        h.raw(b"HTTP/1.1 500 X\r\nContent-Length: 100\r\n\r\n{\"err")  # then the connection closes

    server = serve(script)
    with pytest.raises(ServerError, match="HTTP 500") as info:
        collect(client(server.port))
    assert info.value.status == 500


# -- /v1/models ----------------------------------------------------------------------------


def models_server(serve, payload: object) -> FakeServer:
    return serve(lambda h, n: h.json_reply(200, payload))


def test_model_card(serve):
    server = models_server(serve, {"data": [{"id": "other"}, {"id": "m", "max_model_len": 64}]})
    backend = VLLMServerBackend(f"http://127.0.0.1:{server.port}", eos_tokenizer, model="m")
    assert (backend.model_name, backend.max_context) == ("m", 64)
    assert [r[:2] for r in server.requests] == [("GET", "/v1/models")]


@pytest.mark.parametrize(
    "payload, cause",
    [
        (b"<html>not json</html>", json.JSONDecodeError),
        ({"data": {"id": "m"}}, TypeError),
        ([{"id": "m"}], TypeError),
        ({"data": ["m"]}, TypeError),
        ({"data": [{"id": "m", "max_model_len": "long"}]}, TypeError),
    ],
)
def test_malformed_model_list(serve, payload, cause):
    server = models_server(serve, payload)
    with pytest.raises(BackendError, match=rf"127\.0\.0\.1:{server.port} answered /v1/models with no valid") as info:
        VLLMServerBackend(f"http://127.0.0.1:{server.port}", eos_tokenizer)
    assert isinstance(info.value.__cause__, cause)


def test_model_not_served(serve):
    server = models_server(serve, {"data": [{"id": "a"}, {"id": "b"}]})
    with pytest.raises(BackendError, match="does not serve 'm'; it serves a, b"):
        VLLMServerBackend(f"http://127.0.0.1:{server.port}", eos_tokenizer, model="m")


# -- retries -------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [400, 404, 422, 500])
def test_client_errors_and_500_are_sent_once(serve, status):
    server = serve(status_then_stream([status] * 5))
    with pytest.raises(ServerError, match=f"HTTP {status}: status {status}") as info:
        collect(client(server.port, max_retries=3, retry_backoff=0.01))
    assert info.value.status == status
    assert len(server.requests) == 1


@pytest.mark.parametrize("status", [502, 503, 504])
def test_gateway_errors_are_retried_then_raised(serve, status):
    server = serve(status_then_stream([status] * 5))
    with pytest.raises(ServerError, match=f"HTTP {status}: status {status} \\(3 attempts over") as info:
        collect(client(server.port, max_retries=2, retry_backoff=0.01))
    assert info.value.status == status
    assert len(server.requests) == 3


def test_retry_resends_the_same_body_with_exponential_backoff(serve):
    server = serve(status_then_stream([503, 502]))
    assert collect(client(server.port, max_retries=2, retry_backoff=0.1)) == [11]
    assert len(server.requests) == 3
    assert server.bodies[0] == server.bodies[1] == server.bodies[2]
    assert json.loads(server.bodies[0])["prompt"] == [5, 6, 7]
    times = [r[3] for r in server.requests]
    assert 0.09 <= times[1] - times[0] < 0.6
    assert 0.19 <= times[2] - times[1] < 0.8


def test_no_retries(serve):
    server = serve(status_then_stream([503]))
    with pytest.raises(ServerError, match="HTTP 503") as info:
        collect(client(server.port, max_retries=0))
    assert info.value.status == 503 and len(server.requests) == 1


def test_retries_stop_before_the_deadline(serve):
    server = serve(status_then_stream([503] * 20))
    started = time.monotonic()
    with pytest.raises(BackendTimeoutError, match=r"timeout of 0\.5 s before answering /v1/completions") as info:
        collect(client(server.port, max_retries=10, retry_backoff=0.2), GenerationConfig(max_new_tokens=3, timeout=0.5))
    assert time.monotonic() - started < 0.5  # the next backoff (0.4 s) would have run past it: no sleep
    assert len(server.requests) == 2  # at 0 s and 0.2 s
    assert isinstance(info.value.__cause__, ServerError) and info.value.__cause__.status == 503


def test_closed_port_with_deadline():
    started = time.monotonic()
    with pytest.raises(BackendError) as info:
        collect(client(free_port(), max_retries=10, retry_backoff=0.1), GenerationConfig(max_new_tokens=3, timeout=0.5))
    assert time.monotonic() - started < 1.5
    assert isinstance(info.value, BackendTimeoutError)
    assert "0.5 s" in str(info.value) and "attempts" in str(info.value)
    assert isinstance(info.value.__cause__, ConnectionRefusedError)


def test_closed_port_without_deadline():
    message = r"cannot reach the vLLM server at http://127\.0\.0\.1:\d+ .*3 attempts"
    with pytest.raises(BackendError, match=message) as info:
        collect(client(free_port(), max_retries=2, retry_backoff=0.01))
    assert type(info.value) is BackendError
    assert isinstance(info.value.__cause__, ConnectionRefusedError)


def test_max_retries_defaults_to_two_and_is_validated():
    assert client(free_port(), max_retries=1).http.max_retries == 1
    assert client(free_port()).http.max_retries == 2
    with pytest.raises(ValueError, match="max_retries must be an int >= 0"):
        client(free_port(), max_retries=-1)


# -- deadline ------------------------------------------------------------------------------


def pinging(h: Handler, n: int) -> None:
    """SSE keep-alive comments only, every 50 ms, for at most 3 s."""
    h.raw(SSE_HEAD)
    for _ in range(60):
        if h.server.stop.wait(0.05):
            return
        h.chunk(b": ping\n\n")


def test_keep_alive_stream_ends_at_the_deadline(serve):
    server = serve(pinging)
    started = time.monotonic()
    with pytest.raises(BackendTimeoutError, match=r"timeout of 0\.5 s mid-stream"):
        collect(client(server.port, read_timeout=30), GenerationConfig(max_new_tokens=3, timeout=0.5))
    assert 0.45 <= time.monotonic() - started < 1.5


def test_silent_server_ends_at_the_deadline(serve):
    server = serve(lambda h, n: h.server.stop.wait(3))  # reads the request, never answers
    started = time.monotonic()
    with pytest.raises(BackendTimeoutError, match=r"timeout of 0\.5 s before answering /v1/completions") as info:
        collect(client(server.port, read_timeout=30), GenerationConfig(max_new_tokens=3, timeout=0.5))
    assert time.monotonic() - started < 1.5
    assert isinstance(info.value.__cause__, TimeoutError)
    assert len(server.requests) == 1  # a read timeout is not retried


def test_silent_stream_ends_at_the_deadline(serve):
    def script(h: Handler, n: int) -> None:
        h.raw(SSE_HEAD)
        h.chunk(event(11))
        h.server.stop.wait(3)

    server = serve(script)
    tokens = client(server.port, read_timeout=30).stream_tokens(PLAN, GenerationConfig(max_new_tokens=3, timeout=0.5))
    started = time.monotonic()
    assert next(tokens) == 11
    with pytest.raises(BackendTimeoutError, match=r"timeout of 0\.5 s mid-stream"):
        next(tokens)
    assert time.monotonic() - started < 1.5


def test_slow_stream_ends_at_the_deadline(serve):
    def script(h: Handler, n: int) -> None:
        h.raw(SSE_HEAD)
        for i in range(60):  # a token every 50 ms for at most 3 s
            if h.server.stop.wait(0.05):
                return
            h.chunk(event(100 + i))

    server = serve(script)
    seen: list[int] = []
    started = time.monotonic()
    with pytest.raises(BackendTimeoutError, match=r"timeout of 0\.5 s"):
        seen.extend(client(server.port).stream_tokens(PLAN, GenerationConfig(max_new_tokens=80, timeout=0.5)))
    assert time.monotonic() - started < 1.5
    assert 1 <= len(seen) < 60 and seen == list(range(100, 100 + len(seen)))


def test_keep_alive_without_deadline_is_fine(serve):
    def clean(h: Handler, n: int) -> None:
        h.raw(SSE_HEAD)
        for _ in range(5):
            h.chunk(b": ping\n\n")
            time.sleep(0.05)
        h.chunk(event(11, 12) + b"data: [DONE]\n\n")
        h.raw(b"0\r\n\r\n")

    server = serve(clean)
    assert collect(client(server.port, read_timeout=5)) == [11, 12]


# -- early close ---------------------------------------------------------------------------


@pytest.mark.parametrize("head", [SSE_HEAD, CLOSE_HEAD], ids=["chunked", "connection-close"])
def test_closing_the_generator_closes_the_connection(serve, head):
    def script(h: Handler, n: int) -> None:
        h.raw(head)
        for i in range(200):  # a token every 20 ms for at most 4 s, until a write fails
            if head is SSE_HEAD:
                h.chunk(event(100 + i))
            else:
                h.raw(event(100 + i))
            if h.server.stop.wait(0.02):
                return

    server = serve(script)
    tokens = client(server.port).stream_tokens(PLAN, GenerationConfig(max_new_tokens=80))
    assert [next(tokens), next(tokens)] == [100, 101]
    tokens.close()
    closed = time.monotonic()
    assert server.disconnected.wait(2.0), "the server kept streaming to a closed generator"
    assert server.disconnected_at - closed < 1.0


# -- plans ---------------------------------------------------------------------------------


def test_check_plan_raises_plan_error():
    backend = client(free_port())
    backend.check_plan(PLAN, 3)
    with pytest.raises(PlanError, match="invalid prefill plan for m: .*duplicate position 4"):
        backend.check_plan(PrefillPlan(torch.tensor([5, 6]), torch.tensor([4, 4]), 12, 12, (), True), 3)
    with pytest.raises(PlanError, match="beyond the main model's window"):
        list(backend.stream_tokens(PrefillPlan(torch.tensor([5]), torch.tensor([150]), 151, 151, (), True), GEN))
