"""The OpenAI-compatible gateway end to end: real uvicorn subprocesses on loopback, the real
``openai`` client.

Two gateways start once for the module, side by side:

* ``gateway``: ``--engine specprefill_rag.testing:tiny_engine`` (a tiny random Llama drafting for
  itself), with an API key and ``--draft-batch 4``. Its greedy answers are compared with the same
  engine built in this process.
* ``upstream_gateway``: ``--backend vllm_server`` in front of a fake vLLM on loopback (a tokenizer
  directory, no weights, ``--max-queue 1``): the upstream is down, fails, fails mid-stream, or
  streams slowly, as each test needs.

Every wait is bounded; both processes are stopped by PID when the module ends.
"""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from helpers import free_port, wait_for  # noqa: E402
from servers import (  # noqa: E402
    KEY,
    PASSAGES,
    QUESTION,
    ROOT,
    START_TIMEOUT_S,
    GatewayProcess,
    chat_request,
    expected,
    get,
    metric,
    serving,
)

from specprefill_rag.config import GenerationConfig  # noqa: E402
from specprefill_rag.gateway.admission import cache_namespace  # noqa: E402
from specprefill_rag.gateway.messages import to_segments  # noqa: E402
from specprefill_rag.testing import tiny_engine, tiny_tokenizer  # noqa: E402
from specprefill_rag.types import Passage  # noqa: E402


def post(port: int, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


# -- a fake vLLM upstream ------------------------------------------------------------------------


class FakeVLLM(ThreadingHTTPServer):
    """Answers ``/v1/completions`` per ``behaviour``; ``disconnected`` is set when the gateway hangs up."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, port: int, tokens: list[int]) -> None:
        super().__init__(("127.0.0.1", port), FakeHandler)
        self.tokens = tokens
        self.behaviour = "ok"
        self.streaming = threading.Event()  # the slow stream has started
        self.disconnected = threading.Event()
        self.bodies: list[dict] = []


class FakeHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeVLLM

    def do_GET(self) -> None:  # /v1/models: the gateway's readiness check
        body = json.dumps({"object": "list", "data": [{"id": "tiny", "max_model_len": 2048}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.server.bodies.append(json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0))))
        behaviour = self.server.behaviour
        try:
            if behaviour == "500":
                body = json.dumps({"error": {"message": "engine core died", "type": "InternalServerError"}}).encode()
                self.send_response(500)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            tokens = self.server.tokens
            count = {"ok": len(tokens), "midstream": 3, "slow": 400}[behaviour]
            for i in range(count):
                self._event({"choices": [{"index": 0, "text": "", "token_ids": [tokens[i % len(tokens)]]}]})
                if behaviour == "slow":
                    self.server.streaming.set()
                    time.sleep(0.025)  # 400 tokens: 10 s unless the gateway hangs up
            if behaviour == "midstream":
                time.sleep(0.3)
                self._event({"error": {"message": "the engine failed mid-stream", "type": "InternalServerError"}})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except OSError:
            self.server.disconnected.set()
        self.close_connection = True

    def _event(self, obj: dict) -> None:
        self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
        self.wfile.flush()

    def log_message(self, format: str, *args: object) -> None:
        pass


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def upstream_port() -> int:
    return free_port()


CACHE_SECRET = b"the upstream gateway's cache secret"


def secret_file(folder: Path) -> Path:
    path = folder / "cache-secret"
    path.write_bytes(CACHE_SECRET + b"\n")
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory, upstream_port) -> Iterator[tuple[GatewayProcess, GatewayProcess]]:
    """Both gateways, started together (their start-ups overlap)."""
    from transformers import LlamaConfig

    tmp = tmp_path_factory.mktemp("gateway")
    model_dir = tmp / "tiny-main"  # what --backend vllm_server needs locally: a tokenizer and a config, no weights
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(model_dir)
    LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=2048).save_pretrained(model_dir)
    processes = [
        GatewayProcess(["--engine", "specprefill_rag.testing:tiny_engine", "--api-key", KEY, "--draft-batch", "4"],
                       tmp / "gateway.log"),
        GatewayProcess(["--backend", "vllm_server", "--vllm-url", f"http://127.0.0.1:{upstream_port}",
                        "--main", str(model_dir), "--no-draft", "--served-model-name", "tiny",
                        "--max-model-len", "2048", "--max-queue", "1", "--model-name", "tiny-upstream",
                        "--cache-secret-file", str(secret_file(tmp))],
                       tmp / "upstream_gateway.log"),
    ]
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        for process in processes:
            process.wait_ready(deadline)
        yield processes[0], processes[1]
    finally:
        for process in processes:
            process.stop()


@pytest.fixture(scope="module")
def gateway(stack) -> GatewayProcess:
    return stack[0]


@pytest.fixture(scope="module")
def upstream_gateway(stack) -> GatewayProcess:
    return stack[1]


@pytest.fixture(scope="module")
def engine():
    """The gateway's engine, built again in this process (``tiny_engine`` is deterministic)."""
    return tiny_engine()


@pytest.fixture
def fake_vllm(upstream_port) -> Iterator[FakeVLLM]:
    with serving(FakeVLLM(upstream_port, tiny_tokenizer().encode("The sky is blue. The grass is green."))) as server:
        yield server


# -- the tiny engine's gateway ---------------------------------------------------------------------


def test_models_health_and_metrics_endpoints(gateway):
    assert [m.id for m in gateway.client().models.list().data] == ["tiny-llama"]
    health = gateway.health()
    assert health["status"] == "ok" and health["draft_max_batch"] == 4 and health["max_queue"] == 64
    assert health["draining"] is False
    assert "specprefill_gateway_requests_in_flight" in gateway.metrics()


def test_ready_once_warmed_up(gateway):
    """In-process engine: no upstream to check; the warm-up started with the app."""
    status, body = get(gateway.port, "/ready")
    assert (status, json.loads(body)) == (200, {"ready": True, "checks": {
        "draining": "no", "warm_up": "done", "upstream": "none"}})


def test_api_key_is_required(gateway):
    with pytest.raises(openai.AuthenticationError) as info:
        gateway.client(api_key="wrong").chat.completions.create(**chat_request())
    assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    status, body = get(gateway.port, "/v1/models")
    assert status == 401 and body and json.loads(body)["error"]["type"] == "invalid_request_error"
    assert get(gateway.port, "/v1/models", {"Authorization": f"Bearer {KEY}"})[0] == 200


def test_chat_matches_the_engine_and_reports_pruning(gateway, engine):
    want = expected(engine, QUESTION, PASSAGES, 8)
    answer = gateway.client().chat.completions.create(**chat_request())
    assert answer.object == "chat.completion" and answer.model == "tiny-llama"
    assert answer.choices[0].message.content == want.text
    assert answer.choices[0].finish_reason == ("length" if want.finish_reason == "length" else "stop")
    assert answer.usage.prompt_tokens == want.prompt_tokens
    assert answer.usage.completion_tokens == want.generated_tokens
    ext = answer.model_extra["specprefill"]
    assert ext["prompt_shape"] == "extension" and ext["speculated"] is True
    assert ext["prefilled_tokens"] < ext["prompt_tokens"] == want.prompt_tokens
    assert ext["prefilled_tokens"] == want.prefilled_tokens
    passages = [s for s in ext["kept_spans"] if s["kind"] == "passage"]
    assert [s["id"] for s in passages] == ["1", "2", "3", "4"]
    assert sum(s["n_kept"] for s in passages) < sum(s["n_tokens"] for s in passages)
    assert ext["timings"]["draft_s"] > 0 and ext["timings"]["prefill_s"] > 0


def test_chat_stream_equals_the_whole_answer(gateway, engine):
    want = expected(engine, QUESTION, PASSAGES, 8)
    chunks = list(gateway.client().chat.completions.create(
        **chat_request(), stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    last = [c for c in chunks if c.choices][-1]
    assert last.choices[0].finish_reason in ("length", "stop")
    assert last.model_extra["specprefill"]["prefilled_tokens"] == want.prefilled_tokens
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == want.generated_tokens


def test_completions_with_a_llamaindex_prompt(gateway, engine):
    DEFAULT_TEXT_QA_PROMPT = pytest.importorskip("llama_index.core.prompts.default_prompts").DEFAULT_TEXT_QA_PROMPT

    prompt = DEFAULT_TEXT_QA_PROMPT.format(context_str="\n\n".join(PASSAGES), query_str=QUESTION)
    segments, shape = to_segments([("user", prompt)])
    want = engine.generate(list(segments), generation=GenerationConfig(max_new_tokens=6))
    client = gateway.client()
    answer = client.completions.create(model="x", prompt=prompt, max_tokens=6)
    assert answer.object == "text_completion" and answer.choices[0].text == want.text
    ext = answer.model_extra["specprefill"]
    assert shape == ext["prompt_shape"] == "llamaindex_qa"
    assert [s["kind"] for s in ext["kept_spans"]].count("passage") == len(PASSAGES)
    assert ext["prefilled_tokens"] < ext["prompt_tokens"]
    question = [s for s in ext["kept_spans"] if s["kind"] == "question"][0]
    assert question["n_kept"] == question["n_tokens"]  # the query is protected
    streamed = list(client.completions.create(model="x", prompt=prompt, max_tokens=6, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == want.text
    assert streamed[-1].choices[0].finish_reason in ("length", "stop")


def test_langchain_stuff_documents_prompt_is_split_into_passages(gateway):
    convert_to_openai_messages = pytest.importorskip("langchain_core.messages").convert_to_openai_messages
    ChatPromptTemplate = pytest.importorskip("langchain_core.prompts").ChatPromptTemplate

    # The prompt of LangChain's create_retrieval_chain / create_stuff_documents_chain tutorial, with
    # documents formatted as create_stuff_documents_chain does by default (page_content, "\n\n").
    prompt = ChatPromptTemplate.from_messages([
        ("system", "You are an assistant for question-answering tasks. Use the following pieces of retrieved "
                   "context to answer the question. If you don't know the answer, say that you don't know. Use "
                   "three sentences maximum and keep the answer concise.\n\n{context}"),
        ("human", "{input}"),
    ])
    messages = convert_to_openai_messages(prompt.format_messages(context="\n\n".join(PASSAGES), input=QUESTION))
    answer = gateway.client().chat.completions.create(model="x", messages=messages, max_tokens=4)
    ext = answer.model_extra["specprefill"]
    assert ext["prompt_shape"] == "langchain_rag_system"
    kinds = [s["kind"] for s in ext["kept_spans"]]
    assert kinds == ["instructions", "passage", "passage", "passage", "passage", "question"]
    assert ext["prefilled_tokens"] < ext["prompt_tokens"]


def test_llamaindex_chat_prompt_and_tagged_documents(gateway):
    CHAT_TEXT_QA_PROMPT = pytest.importorskip("llama_index.core.prompts.chat_prompts").CHAT_TEXT_QA_PROMPT

    messages = [{"role": m.role.value, "content": m.content}
                for m in CHAT_TEXT_QA_PROMPT.format_messages(context_str="\n\n".join(PASSAGES), query_str=QUESTION)]
    client = gateway.client()
    ext = client.chat.completions.create(model="x", messages=messages, max_tokens=2).model_extra["specprefill"]
    assert ext["prompt_shape"] == "llamaindex_qa"
    assert [s["kind"] for s in ext["kept_spans"]].count("passage") == len(PASSAGES)
    tagged = "".join(f'<document id="doc-{i}">{p}</document>\n' for i, p in enumerate(PASSAGES)) + QUESTION
    ext = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": tagged}], max_tokens=2).model_extra["specprefill"]
    assert ext["prompt_shape"] == "tagged"
    assert [s["id"] for s in ext["kept_spans"] if s["kind"] == "passage"] == [f"doc-{i}" for i in range(4)]


def test_extension_controls_mode_and_keep_rate(gateway, engine):
    client = gateway.client()
    full = client.chat.completions.create(**chat_request(
        extra_body={"specprefill": {"passages": PASSAGES, "mode": "full"}})).model_extra["specprefill"]
    assert full["speculated"] is False and full["prefilled_tokens"] == full["prompt_tokens"]
    low = client.chat.completions.create(**chat_request(
        extra_body={"specprefill": {"passages": PASSAGES, "keep_rate": 0.1}})).model_extra["specprefill"]
    high = client.chat.completions.create(**chat_request(
        extra_body={"specprefill": {"passages": PASSAGES, "keep_rate": 0.8}})).model_extra["specprefill"]
    assert low["prefilled_tokens"] < high["prefilled_tokens"] < full["prefilled_tokens"]
    # question: the protected part of the last user message; the rest of it becomes passages
    message = "\n\n".join(PASSAGES) + "\n\n" + QUESTION
    ext = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": message}], max_tokens=2,
        extra_body={"specprefill": {"question": QUESTION}}).model_extra["specprefill"]
    assert [s["kind"] for s in ext["kept_spans"]] == ["passage"] * 4 + ["question"]


@pytest.mark.parametrize(("change", "param"), [
    ({"n": 2}, "n"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"logprobs": True}, "logprobs"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"temperature": -1}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"extra_body": {"specprefill": {"keep_rate": 2}}}, "specprefill.keep_rate"),
    ({"extra_body": {"specprefill": {"mode": "fast"}}}, "specprefill.mode"),
    ({"messages": [{"role": "system", "content": "only a system message"}]}, "messages"),
])
def test_bad_requests_get_openai_shaped_400(gateway, change, param):
    with pytest.raises(openai.BadRequestError) as info:
        gateway.client().chat.completions.create(**{**chat_request(), **change})
    error = info.value.body
    assert info.value.status_code == 400 and error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    if param in ("n", "tools", "logprobs", "presence_penalty"):
        assert "not supported" in error["message"]


def test_malformed_body_gets_openai_shaped_400(gateway):
    status, body = post(gateway.port, "/v1/chat/completions", b"{not json", {"Authorization": f"Bearer {KEY}"})
    assert status == 400 and body["error"]["message"] == "the request body is not valid JSON"
    status, body = post(gateway.port, "/v1/nowhere", b"{}", {"Authorization": f"Bearer {KEY}"})
    assert status == 404 and body["error"]["code"] == "not_found"


def test_client_disconnect_mid_stream_stops_the_generation(gateway):
    before = metric(gateway.metrics(), "specprefill_gateway_requests_total", endpoint="chat", mode="specprefill",
                    status="499")
    stream = gateway.client().chat.completions.create(**{**chat_request(), "max_tokens": 1900}, stream=True)
    chunks = iter(stream)
    next(chunks), next(chunks)  # the role, then the first text
    stream.close()  # hang up with ~1900 tokens to go
    assert wait_for(lambda: gateway.health()["in_flight"] == 0), "the request was not released"
    after = metric(gateway.metrics(), "specprefill_gateway_requests_total", endpoint="chat", mode="specprefill",
                   status="499")
    assert after == before + 1, "the request ran to its end instead of stopping"
    answer = gateway.client().chat.completions.create(**chat_request())
    assert answer.choices[0].message.content is not None


def test_client_leaving_before_the_answer_stops_the_generation(gateway):
    before = metric(gateway.metrics(), "specprefill_gateway_requests_total", endpoint="chat", mode="specprefill",
                    status="499")
    with pytest.raises(openai.APITimeoutError):  # the client gives up and closes the connection
        gateway.client(timeout=1.0).chat.completions.create(**{**chat_request(), "max_tokens": 1900})
    assert wait_for(lambda: gateway.health()["in_flight"] == 0), "the request was not released"
    after = metric(gateway.metrics(), "specprefill_gateway_requests_total", endpoint="chat", mode="specprefill",
                   status="499")
    assert after == before + 1, "the request ran to its end instead of stopping"


def test_concurrent_streams_each_get_their_own_answer(gateway, engine):
    requests = []
    for i in range(16):
        passages = PASSAGES[i % 4:] + PASSAGES[: i % 4]
        requests.append((f"Question {i}: what is the passkey of fox {i}?", passages))
    wants = [expected(engine, q, p, 6).text for q, p in requests]

    def ask(request: tuple[str, list[str]]) -> str | None:
        question, passages = request
        try:
            stream = gateway.client().chat.completions.create(**chat_request(question, passages, max_tokens=6),
                                                              stream=True)
            return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        except openai.RateLimitError:
            return None  # a clean refusal

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, requests, timeout=90))
    served = [(a, w) for a, w in zip(answers, wants, strict=True) if a is not None]
    assert len(served) == 16  # its queue holds 64: a 429 here would be a bug
    assert all(a == w for a, w in served)
    assert gateway.health()["in_flight"] == 0


def test_metrics_after_traffic(gateway):
    text = gateway.metrics()
    assert metric(text, "specprefill_gateway_requests_total", endpoint="chat", mode="specprefill", status="200") >= 3
    assert metric(text, "specprefill_gateway_requests_total", endpoint="chat", mode="none", status="401") >= 1
    assert metric(text, "specprefill_gateway_ttft_seconds_count", mode="specprefill") >= 3
    assert metric(text, "specprefill_gateway_draft_seconds_count") >= 3
    # The streamed chat repeats the first chat request: its scores come from the engine's memo.
    assert metric(text, "specprefill_gateway_draft_memo_hits_total") >= 1
    assert metric(text, "specprefill_gateway_prefill_seconds_count", mode="full") >= 1
    assert metric(text, "specprefill_gateway_keep_ratio_count", mode="specprefill") >= 3
    prompt = metric(text, "specprefill_gateway_tokens_total", kind="prompt")
    assert 0 < metric(text, "specprefill_gateway_tokens_total", kind="prefilled") < prompt


# -- the gateway in front of a (fake) vLLM server --------------------------------------------------


def test_upstream_down_is_503(upstream_gateway):
    with pytest.raises(openai.InternalServerError) as info:
        upstream_gateway.client().chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 503
    assert info.value.response.headers["retry-after"] == "1"
    assert info.value.body["code"] == "upstream_unavailable" and "unreachable" in info.value.body["message"]
    with pytest.raises(openai.InternalServerError) as info:  # streaming: the status comes before the stream
        list(upstream_gateway.client().chat.completions.create(
            model="x", messages=[{"role": "user", "content": "hi"}], stream=True))
    assert info.value.status_code == 503


def test_ready_only_while_the_upstream_answers(upstream_gateway, upstream_port):
    status, body = get(upstream_gateway.port, "/ready")  # no vLLM yet: the warm-up cannot run
    checks = json.loads(body)["checks"]
    assert status == 503 and checks["warm_up"].startswith("failed: ") and "unreachable" in checks["warm_up"]
    assert get(upstream_gateway.port, "/health")[0] == 200  # alive all the same
    server = FakeVLLM(upstream_port, tiny_tokenizer().encode("Warm."))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        status, body = get(upstream_gateway.port, "/ready")
        assert (status, json.loads(body)["checks"]) == (200, {"draining": "no", "warm_up": "done", "upstream": "ok"})
        assert server.bodies and server.bodies[0]["max_tokens"] == 2  # the warm-up's answer
    finally:
        server.shutdown()
        server.server_close()
    # Warmed, but the upstream went away: /ready says so once its last check (reused for
    # GatewayOptions.ready_cache_s, 2 s) is out of date.
    deadline = time.monotonic() + 2.0 + 10
    while (status := get(upstream_gateway.port, "/ready")[0]) == 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    status, body = get(upstream_gateway.port, "/ready")
    assert status == 503 and json.loads(body)["checks"]["upstream"].startswith("failed: ")


@pytest.mark.full
def test_sigterm_drains_in_flight_streams_and_refuses_new_requests(tmp_path):
    """SIGTERM mid-stream: the stream ends whole, /ready and new requests get 503 meanwhile, and
    the process exits once nothing is in flight, well inside the drain timeout."""
    from transformers import LlamaConfig

    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(tmp_path / "tiny-main")
    LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=2048).save_pretrained(tmp_path / "tiny-main")
    port = free_port()
    upstream = FakeVLLM(port, tokenizer.encode("The sky is blue. The grass is green."))
    threading.Thread(target=upstream.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    gateway = GatewayProcess(["--backend", "vllm_server", "--vllm-url", f"http://127.0.0.1:{port}",
                              "--main", str(tmp_path / "tiny-main"), "--no-draft", "--served-model-name", "tiny",
                              "--max-model-len", "2048", "--drain-timeout", "40"], tmp_path / "gateway.log")
    try:
        gateway.wait_ready(time.monotonic() + START_TIMEOUT_S)
        assert wait_for(lambda: get(gateway.port, "/ready")[0] == 200, 30)
        upstream.behaviour = "slow"  # 400 tokens over ~10 s
        stream = gateway.client().chat.completions.create(
            model="x", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=400)
        chunks = iter(stream)
        first = [next(chunks), next(chunks)]
        gateway.process.send_signal(signal.SIGTERM)
        assert wait_for(lambda: gateway.health()["draining"], 5)
        status, body = get(gateway.port, "/ready")
        assert status == 503 and json.loads(body)["checks"]["draining"] == "yes"
        with pytest.raises(openai.InternalServerError) as info:
            gateway.client().chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}])
        assert info.value.status_code == 503 and info.value.body["code"] == "draining"
        rest = list(chunks)
        assert rest[-1].choices[0].finish_reason == "length"
        text = "".join(c.choices[0].delta.content or "" for c in first + rest if c.choices)
        assert len(tokenizer.encode(text)) >= 300  # the whole answer, not cut by the shutdown
        gateway.process.wait(15)  # exits once the stream is done, not after the 40 s drain timeout
    finally:
        gateway.stop()
        upstream.shutdown()
        upstream.server_close()


def test_upstream_error_is_502_and_mid_stream_error_is_an_event(upstream_gateway, fake_vllm):
    client = upstream_gateway.client()
    fake_vllm.behaviour = "500"
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 502 and "engine core died" in info.value.body["message"]
    fake_vllm.behaviour = "midstream"
    stream = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], stream=True)
    received = []
    with pytest.raises(openai.APIError, match="failed mid-stream"):
        for chunk in stream:
            received.append(chunk)
    assert any(c.choices and c.choices[0].delta.content for c in received)
    fake_vllm.behaviour = "ok"
    answer = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content == "The sky is blue. The grass is green."
    assert answer.model == "tiny-upstream" and fake_vllm.bodies[-1]["model"] == "tiny"


def test_cache_salt_reaches_the_upstream_on_both_endpoints(upstream_gateway, fake_vllm):
    """As its namespace: an HMAC under the secret of --cache-secret-file (docs/gateway.md, Tenants)."""
    client = upstream_gateway.client()
    client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}],
                                   extra_body={"cache_salt": "tenant-a"})
    assert fake_vllm.bodies[-1]["cache_salt"] == cache_namespace(CACHE_SECRET, None, "tenant-a")
    client.completions.create(model="x", prompt="hi", extra_body={"cache_salt": "tenant-b"})
    assert fake_vllm.bodies[-1]["cache_salt"] == cache_namespace(CACHE_SECRET, None, "tenant-b")
    client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}])
    assert fake_vllm.bodies[-1]["cache_salt"] == cache_namespace(CACHE_SECRET, None, None)  # none: the shared one


def test_full_queue_is_429_and_a_hang_up_cancels_the_upstream_request(upstream_gateway, fake_vllm):
    client = upstream_gateway.client()
    fake_vllm.behaviour = "slow"
    stream = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], stream=True)
    chunks = iter(stream)
    next(chunks), next(chunks)
    try:
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model="x", messages=[{"role": "user", "content": "again"}])
        assert info.value.status_code == 429 and info.value.response.headers["retry-after"] == "1"
        assert info.value.body["code"] == "rate_limit_exceeded"
    finally:
        stream.close()
    # The gateway closes the engine stream, which closes its request to vLLM (about 9 s were left).
    assert fake_vllm.disconnected.wait(5), "the upstream request kept streaming after the client left"
    assert wait_for(lambda: upstream_gateway.health()["in_flight"] == 0)
    fake_vllm.behaviour = "ok"
    assert client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}]).choices


# -- the command line (in process: argument checks only) -------------------------------------------


def test_web_dependencies_are_imported_only_for_an_app():
    code = (
        "import sys; import specprefill_rag.gateway as g; assert 'fastapi' not in sys.modules, 'eager import';"
        "sys.modules['fastapi'] = None\n"
        "try:\n    g.create_app(None)\nexcept ImportError as e:\n    print(e)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "pip install 'specprefill-rag[gateway]'" in out.stdout


def test_cli_refuses_incomplete_gateway_commands(capsys):
    from specprefill_rag.tools.cli import main

    assert main(["serve", "some-model", "--draft", "d"]) == 2
    assert "--gateway-port" in capsys.readouterr().err
    assert main(["gateway", "--engine", "no_such_module:factory"]) == 2
    assert "no_such_module" in capsys.readouterr().err
    assert main(["gateway", "--engine", "specprefill_rag.testing"]) == 2
    assert "module:function" in capsys.readouterr().err


# -- the prompt shapes (pure, no server) ----------------------------------------------------------

LANGCHAIN_STUFF_PROMPT = (  # chains/question_answering/stuff_prompt.py, PROMPT and CHAT_PROMPT
    "Use the following pieces of context to answer the question at the end. If you don't know the answer, "
    "just say that you don't know, don't try to make up an answer.\n\n{context}\n\nQuestion: {question}\n"
    "Helpful Answer:"
)
LANGCHAIN_STUFF_SYSTEM = (
    "Use the following pieces of context to answer the user's question.\nIf you don't know the answer, just say "
    "that you don't know, don't try to make up an answer.\n----------------\n{context}"
)
RAG_PROMPT = (  # LangChain hub rlm/rag-prompt
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved context to answer "
    "the question. If you don't know the answer, just say that you don't know. Use three sentences maximum and "
    "keep the answer concise.\nQuestion: {question} \nContext: {context} \nAnswer:"
)


@pytest.mark.parametrize(("turns", "shape", "instructions"), [
    ([("user", LANGCHAIN_STUFF_PROMPT)], "langchain_stuff", "Use the following pieces of context"),
    ([("system", LANGCHAIN_STUFF_SYSTEM), ("user", "{question}")], "langchain_stuff_chat", "Use the following"),
    ([("user", RAG_PROMPT)], "langchain_rag_prompt", "You are an assistant"),
    ([("system", "Be brief."), ("user", "<context>\n{context}\n</context>\n{question}")], "tagged", "Be brief."),
])
def test_documented_shapes_become_passages(turns, shape, instructions):
    context = "\n\n".join(PASSAGES)
    turns = [(role, text.format(context=context, question=QUESTION)) for role, text in turns]
    segments, found = to_segments(turns)
    assert found == shape
    assert [s.kind.value for s in segments] == ["instructions"] + ["passage"] * 4 + ["question"]
    assert segments[0].text.startswith(instructions)
    assert [s.text for s in segments[1:5]] == PASSAGES and segments[-1].text == QUESTION


def test_unknown_layouts_are_left_whole():
    message = "Here are some notes:\n\n" + "\n\n".join(PASSAGES) + "\n\nWhat is the passkey?"
    segments, shape = to_segments([("system", "Rules:\n\nBe brief."), ("user", message)])
    assert shape == "chat"
    assert [(s.kind.value, s.text) for s in segments] == [("instructions", "Rules:\n\nBe brief."),
                                                          ("question", message)]
    history, _ = to_segments([("user", "Hello"), ("assistant", "Hi!"), ("developer", "Be kind."), ("user", "Q?")])
    assert [(s.kind.value, s.role) for s in history] == [("instructions", None), ("history", "user"),
                                                         ("history", "assistant"), ("question", None)]


@pytest.mark.parametrize("text", [
    "Question: a\nContext: b\n" * 8000,  # markers again and again, never the closing "Answer:"
    "Context information is below.\n-----\n" * 5000,
    "<document>" * 20000,  # opened, never closed
    "</document>" + "<document " * 20000,
    "Use the following pieces of context to answer the question at the end. If you don't know the answer, just "
    "say that you don't know, don't try to make up an answer.\n\n" + "a\n\nQuestion: b\n" * 8000,
])
def test_recognition_stays_linear_on_hostile_messages(text):
    started = time.perf_counter()
    to_segments([("system", text), ("user", text)])
    assert time.perf_counter() - started < 2.0  # quadratic patterns took minutes here


def test_extension_passages_are_taken_as_given():
    segments, shape = to_segments([("user", "<document>not this</document> Q?")],
                                  passages=[Passage("A b c.", id="x"), Passage("D e.")], question="Which?")
    assert shape == "extension"
    assert [(s.kind.value, s.id, s.text) for s in segments] == [
        ("passage", "x", "A b c."), ("passage", "2", "D e."), ("question", None, "Which?")]


def test_gateway_options_validate_and_fold_into_keywords():
    from specprefill_rag.errors import ConfigError
    from specprefill_rag.gateway import GatewayOptions, create_app

    with pytest.raises(ConfigError, match="max_queue must be >= 1, got 0"):
        GatewayOptions(max_queue=0)
    with pytest.raises(ConfigError, match="max_concurrency must be >= 1, got 0"):
        GatewayOptions(max_concurrency=0)
    engine = tiny_engine()
    with pytest.raises(ConfigError, match="not both"):
        create_app(engine, GatewayOptions(), api_key="k")
    keywords = create_app(engine, api_key="k", max_queue=3, model_name="m")
    explicit = create_app(engine, GatewayOptions(api_key="k", max_queue=3, model_name="m"))
    for app in (keywords, explicit):
        gateway = app.state.gateway
        assert (gateway.api_key, gateway.max_queue, gateway.model_name) == ("k", 3, "m")
        assert gateway.max_concurrency == 4  # max(4, the draft's max_batch)
