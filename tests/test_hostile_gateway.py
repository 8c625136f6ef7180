"""Hostile requests (issue 21, items 4 to 7): each is refused with an OpenAI-shaped 400 or 413
naming the field and saying why, or answered as usual; none becomes a 500, and every stream ends
with ``[DONE]``.

In process (Starlette's TestClient, the tiny engine) for the refusals; over 127.0.0.1 (uvicorn
in a thread) for the body limit while ``/health`` keeps answering. Bounded loops throughout.
"""

from __future__ import annotations

import http.client
import json
import random
import re
import socket
import sys
import threading
import time
import unicodedata
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from fastapi.testclient import TestClient  # noqa: E402
from servers import app_in_thread  # noqa: E402

from specprefill_rag import prompt as prompt_lib  # noqa: E402
from specprefill_rag.backends.transformers import sample_token  # noqa: E402
from specprefill_rag.backends.vllm_server import request_body  # noqa: E402
from specprefill_rag.config import GREEDY_BELOW, GenerationConfig  # noqa: E402
from specprefill_rag.errors import ConfigError, InputError  # noqa: E402
from specprefill_rag.gateway import GatewayOptions, create_app  # noqa: E402
from specprefill_rag.gateway import app as app_module  # noqa: E402
from specprefill_rag.gateway.responses import StreamChunks  # noqa: E402
from specprefill_rag.prompt import length_guard  # noqa: E402
from specprefill_rag.prompt import render as render_lib  # noqa: E402
from specprefill_rag.testing import tiny_engine, tiny_inst_tokenizer, tiny_tokenizer  # noqa: E402
from specprefill_rag.types import Passage, PrefillPlan, Segment, SegmentKind  # noqa: E402

CHAT = "/v1/chat/completions"
ROLES = "['assistant', 'developer', 'system', 'tool', 'user']"


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


@pytest.fixture
def client(engine) -> Iterator[TestClient]:
    """A fresh app (its own metrics) on the module's engine."""
    with TestClient(create_app(engine), raise_server_exceptions=False) as test_client:
        yield test_client


def chat(content: object = "What is the passkey?", **fields: object) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 2, **fields}


def send(client: TestClient, body: object, path: str = CHAT) -> tuple[int, dict]:
    """POST ``body`` as JSON text; ``json.dumps`` writes lone surrogates as ``\\ud800`` escapes."""
    raw = body if isinstance(body, (bytes, str)) else json.dumps(body)
    response = client.post(path, content=raw, headers={"Content-Type": "application/json"})
    return response.status_code, response.json()


def refused(client: TestClient, body: object, status: int = 400, path: str = CHAT, **expected: object) -> dict:
    """The error object of a refused request, checked for OpenAI's shape and ``expected`` fields."""
    got, answer = send(client, body, path)
    assert got == status, answer
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}
    error = answer["error"]
    assert error["type"] == "invalid_request_error"
    for key, value in expected.items():
        assert error[key] == value, (key, error)
    return error


def metric(client: TestClient, status: int, endpoint: str = "chat", mode: str | None = None) -> float:
    """``specprefill_gateway_requests_total`` for one status (summed over modes unless given)."""
    text = client.get("/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("specprefill_gateway_requests_total{") and f'status="{status}"' in line:
            if f'endpoint="{endpoint}"' in line and (mode is None or f'mode="{mode}"' in line):
                total += float(line.rsplit(" ", 1)[1])
    return total


# -- 4. cost bounded before work: body size, and the window from the prompt's length ---------------


def test_a_body_over_the_limit_is_413_before_it_is_parsed(engine):
    app = create_app(engine, max_body_bytes=1000)
    with TestClient(app, raise_server_exceptions=False) as client:
        big = json.dumps(chat("a" * 2000)).encode()
        refused(client, big, 413, code="request_too_large", param=None,
                message=f"the request body has {len(big)} bytes, over this gateway's limit of 1000 bytes "
                "(--max-body-bytes)")
        # No Content-Length (chunked): refused once the bytes read pass the limit.
        response = client.post(CHAT, content=iter([big[:600], big[600:1200], big[1200:]]))
        assert response.status_code == 413
        assert response.json()["error"]["message"] == (
            "the request body has more bytes than this gateway's limit of 1000 bytes (--max-body-bytes)")
        # Exactly at the limit: read and answered.
        body = json.dumps(chat("What is the passkey?")).encode()
        exact = body[:-1] + b" " * (1000 - len(body)) + b"}"
        assert len(exact) == 1000 and client.post(CHAT, content=exact).status_code == 200
        assert metric(client, 413, mode="none") == 2


def test_max_body_bytes_is_an_option_and_a_flag(capsys):
    from specprefill_rag.tools.cli import _parser, main

    assert GatewayOptions().max_body_bytes == 8 << 20
    assert _parser().parse_args(["gateway"]).max_body_bytes == GatewayOptions().max_body_bytes
    with pytest.raises(ConfigError, match="max_body_bytes must be >= 1, got 0"):
        GatewayOptions(max_body_bytes=0)
    assert main(["gateway", "--engine", "specprefill_rag.testing:tiny_engine", "--max-body-bytes", "0"]) == 2
    assert "max_body_bytes must be >= 1, got 0" in capsys.readouterr().err


def test_a_prompt_too_long_for_the_window_is_refused_before_tokenizing(engine, monkeypatch):
    per_token = length_guard.max_chars_per_token(engine.tokenizer)
    assert per_token == max(map(len, engine.tokenizer.get_vocab()))  # byte-level BPE, no normalizer

    def no_tokenizing(*args: object, **kwargs: object) -> None:
        raise AssertionError("the prompt was tokenized")

    monkeypatch.setattr(render_lib, "assemble", no_tokenizing)
    text = "The sky is blue. " * 240_000  # 4,080,000 characters; the window holds 2048 tokens
    started = time.perf_counter()
    with pytest.raises(InputError) as info:
        engine.assemble("What colour?", [text])
    assert time.perf_counter() - started < 0.5
    chars = len(text.strip()) + len("What colour?") + len(engine.config.instructions)  # the segments
    assert str(info.value) == (
        f"the prompt has at least {-(-chars // per_token)} tokens ({chars} characters, at most {per_token} per "
        "token) but the main model's window is 2048: retrieve fewer or shorter passages")
    # Through the gateway: the same 400, answered at once.
    with TestClient(create_app(engine), raise_server_exceptions=False) as client:
        started = time.perf_counter()
        error = refused(client, chat(text), param=None)
        assert time.perf_counter() - started < 3.0
        assert re.fullmatch(r"the prompt has at least \d+ tokens \(\d+ characters, at most 13 per token\) but the "
                            r"main model's window is 2048: retrieve fewer or shorter passages", error["message"])


def test_a_prompt_cheap_to_count_keeps_its_exact_count(engine):
    with pytest.raises(InputError, match=r"^the prompt has \d+ tokens but the main model's window is 2048"):
        engine.assemble("What colour?", ["The sky is blue. " * 2000])  # 34,000 characters


# -- 4. the bound never refuses a prompt that fits ------------------------------------------------

# Pieces of hostile and ordinary text: every script width, combining marks, Hangul jamo (NFC
# composes three into one), the template's markers, role names, white space runs.
PIECES = [
    "The sky is blue. ", "passkey 48213", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "system", "user\n",
    "assistant", "[INST]", "<s>", " ", "    ", "\n\n", "\t", "é", "e\u0301", "u\u0308\u0304", "\u1100\u1161\u11a8",
    "\u03b1\u0313\u0300\u0345", "日本語のテキスト", "😀", "👩‍👩‍👧", "\u200b", "\x00", "ﬁ", "Ω", "ǖ", "ﷺ",
]


def random_texts(tokenizer, n: int, seed: int) -> Iterator[str]:
    rng = random.Random(seed)
    longest = sorted(tokenizer.get_vocab(), key=len)[-20:]  # a vocabulary's longest entries, as text
    decoded = [tokenizer.convert_tokens_to_string([t]) for t in longest]
    for _ in range(n):
        yield "".join(rng.choice(PIECES + decoded) * rng.choice((1, 1, 2, 50)) for _ in range(rng.randint(1, 40)))
    for piece in decoded:  # the tightest case: the longest entries, repeated
        yield piece * 200


def nfc_tokenizer():
    """A byte-level BPE behind an NFC normalizer (as Qwen2's): composing shortens the text."""
    from tokenizers import normalizers

    tokenizer = tiny_tokenizer()
    tokenizer.backend_tokenizer.normalizer = normalizers.NFC()
    return tokenizer


def metaspace_nfkc_tokenizer():
    """A character-level BPE (Metaspace, unknown characters one ``<unk>`` each) behind NFKC."""
    from tokenizers import normalizers

    tokenizer = tiny_inst_tokenizer()
    tokenizer.backend_tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    return tokenizer


def assert_bound_holds(tokenizer, n: int = 150, seed: int = 0) -> None:
    per_token = length_guard.max_chars_per_token(tokenizer)
    assert per_token is not None
    for text in random_texts(tokenizer, n, seed):
        n_tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        assert n_tokens * per_token >= len(text), (text[:80], n_tokens, per_token)


@pytest.mark.parametrize("make", [tiny_tokenizer, tiny_inst_tokenizer, nfc_tokenizer, metaspace_nfkc_tokenizer])
def test_the_window_bound_never_refuses_a_prompt_that_fits(make):
    tokenizer = make()
    assert_bound_holds(tokenizer)
    # And on whole prompts as the engine assembles them: segments are part of the prompt's text.
    per_token = length_guard.max_chars_per_token(tokenizer)
    rng = random.Random(1)
    texts = list(random_texts(tokenizer, 30, 2))
    for _ in range(30):
        segments = prompt_lib.chat_segments(
            [("system", rng.choice(texts)), ("user", rng.choice(texts)), ("assistant", rng.choice(texts)),
             ("user", rng.choice(texts) + "?")], [rng.choice(texts) for _ in range(rng.randint(0, 3))])
        assembled = prompt_lib.assemble(tokenizer, segments)
        assert assembled.n_tokens * per_token >= sum(len(s.text) for s in segments)


def test_composition_shortens_text_by_the_documented_factors_at_most():
    """|NFD(c)| <= 4 characters and <= 1.5 x its UTF-8 bytes for every character an NFC (or NFKC)
    text holds: the factors ``length_guard``'s proof uses."""
    composed = [chr(cp) for cp in range(sys.maxunicode + 1)
                if not 0xD800 <= cp <= 0xDFFF and unicodedata.decomposition(chr(cp))]
    for form, back in (("NFC", "NFD"), ("NFKC", "NFKD")):
        stable = [c for c in composed if unicodedata.normalize(form, c) == c]
        assert max(len(unicodedata.normalize(back, c)) for c in stable) <= length_guard._COMPOSE_CHARS
        assert max(len(unicodedata.normalize(back, c)) / len(c.encode()) for c in stable) <= length_guard._COMPOSE_BYTES


def test_pipelines_that_drop_characters_get_no_bound():
    from tokenizers import normalizers, pre_tokenizers

    dropping = tiny_tokenizer()
    dropping.backend_tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()  # white space vanishes
    stripping = tiny_tokenizer()
    stripping.backend_tokenizer.normalizer = normalizers.Strip()
    squeezing = tiny_tokenizer()
    squeezing.backend_tokenizer.normalizer = normalizers.Replace("  ", " ")
    for tokenizer in (dropping, stripping, squeezing, object()):
        assert length_guard.max_chars_per_token(tokenizer) is None
    # Why: ten thousand characters, no token at all (the engine then counts tokens, as before).
    assert len(dropping(" " * 10_000, add_special_tokens=False)["input_ids"]) == 0


@pytest.mark.real_model
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct"])
def test_the_window_bound_holds_on_the_packaged_tokenizers(name):
    from specprefill_rag.loading import load_tokenizer

    tokenizer = load_tokenizer(name)
    assert_bound_holds(tokenizer, n=300, seed=3)


# -- 5. what used to be a 500 ---------------------------------------------------------------------


def test_deeply_nested_json_is_400(client):
    refused(client, "[" * 100_000 + "]" * 100_000, param=None,
            message="the request body nests JSON arrays or objects too deeply")
    refused(client, '{"messages": ' + "{\"a\": " * 100_000 + "1" + "}" * 100_001,
            message="the request body nests JSON arrays or objects too deeply")
    # Nested as deep as the parser takes: past the one JSON depth limit (64), named shortly (issue 60).
    error = refused(client, json.dumps(chat()).replace('"max_tokens": 2', '"temperature": ' + "[" * 900 + "]" * 900))
    assert error["param"].startswith("temperature[0][0]") and len(error["param"]) <= 200
    assert error["message"] == f"{error['param']} nests JSON arrays and objects deeper than the limit of 64 levels"
    assert metric(client, 500) == 0


def test_a_number_beyond_any_float_is_400(client):
    huge = "1" + "0" * 400
    for field, param in (('"temperature"', "temperature"), ('"top_p"', "top_p")):
        error = refused(client, json.dumps(chat()).replace('"max_tokens": 2', f"{field}: {huge}"), param=param)
        assert error["message"].startswith(f"{param} must be a number in ") and len(error["message"]) < 120
    body = json.dumps(chat(specprefill={"keep_rate": 0.5})).replace("0.5", huge)
    refused(client, body, param="specprefill.keep_rate")


@pytest.mark.parametrize(("role", "shown"), [(["user"], "['user']"), ({"a": 1}, "{'a': 1}"), (7, "7")])
def test_a_role_that_is_no_string_is_400(client, role, shown):
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": role, "content": "hi"}]}
    refused(client, body, param="messages[1].role", message=f"messages[1].role must be one of {ROLES}, got {shown}")


def test_a_long_value_is_quoted_shortly(client):
    error = refused(client, {"messages": [{"role": "x" * 1_000_000, "content": "hi"}]}, param="messages[0].role")
    assert len(error["message"]) < 200 and error["message"].startswith(f"messages[0].role must be one of {ROLES}")


@pytest.mark.parametrize("seed", [1 << 63, -(1 << 63) - 1, 1 << 70])
def test_a_seed_outside_int64_is_400_and_a_config_error(client, seed):
    message = f"seed must be a signed 64-bit integer, in [{-(1 << 63)}, {(1 << 63) - 1}], got {seed}"
    refused(client, chat(seed=seed, temperature=1.0), param="seed", message=message)
    with pytest.raises(ConfigError, match=re.escape(message)):
        GenerationConfig(seed=seed)


def test_the_int64_edges_are_seeds(client):
    for seed in ((1 << 63) - 1, -(1 << 63)):
        status, answer = send(client, chat(seed=seed, temperature=1.0))
        assert status == 200, answer


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 9.99e-6])
def test_a_tiny_temperature_is_greedy(client, temperature):
    status, answer = send(client, chat(temperature=temperature, max_tokens=4))
    assert status == 200, answer
    _, greedy = send(client, chat(temperature=0, max_tokens=4))
    assert answer["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]


def test_one_greedy_rule_in_every_backend():
    assert GenerationConfig(temperature=1e-40).greedy and GenerationConfig(temperature=0.0).greedy
    assert not GenerationConfig(temperature=GREEDY_BELOW).greedy
    logits = torch.tensor([0.5, 3.0, -1.0, 2.9])
    assert sample_token(logits, GenerationConfig(temperature=1e-40), torch.Generator().manual_seed(0)) == 1
    plan = PrefillPlan(token_ids=torch.tensor([1, 2]), position_ids=torch.tensor([0, 1]), next_position=2,
                       n_prompt=2, kept_spans=(), speculated=False)
    sent = [request_body(plan, GenerationConfig(temperature=t), model="m", max_tokens=1, logprobs=False,
                         stream=False)["temperature"] for t in (1e-40, GREEDY_BELOW, 0.7)]
    assert sent == [0.0, GREEDY_BELOW, 0.7]  # vLLM gets the greedy decision, not a temperature it overflows


def test_vllm_offline_sends_the_greedy_decision():
    vllm = pytest.importorskip("vllm")
    from specprefill_rag.backends.vllm_offline import VLLMOfflineBackend

    backend = object.__new__(VLLMOfflineBackend)  # no vllm.LLM: only the request is built
    backend._max_context, backend._name = 64, "m"
    plan = PrefillPlan(token_ids=torch.tensor([1, 2]), position_ids=torch.tensor([0, 1]), next_position=2,
                       n_prompt=2, kept_spans=(), speculated=False)
    _, params = backend._request(plan, GenerationConfig(temperature=1e-40), logprobs=False)
    assert isinstance(params, vllm.SamplingParams) and params.temperature == 0.0


def passages(*items: object) -> dict:
    return chat("Which number?", specprefill={"passages": list(items)})


SURROGATE_FIELDS = [  # (body, path, the field named, the surrogate, its index)
    (chat("what \ud800?"), CHAT, "messages[0].content", "D800", 5),
    (chat([{"type": "text", "text": "ok"}, {"type": "text", "text": "\udfff"}]), CHAT, "messages[0].content[1].text",
     "DFFF", 0),
    ({"messages": [{"role": "system", "content": "be \udc00brief"}, {"role": "user", "content": "q?"}]}, CHAT,
     "messages[0].content", "DC00", 3),
    ({"prompt": "say \ud800", "max_tokens": 2}, "/v1/completions", "prompt", "D800", 4),
    (passages("The sky \ud800."), CHAT, "specprefill.passages[0]", "D800", 8),
    (passages("A.", {"text": "x\ud800"}), CHAT, "specprefill.passages[1].text", "D800", 1),
    (passages({"text": "The sky is blue.", "id": "\ud800"}), CHAT, "specprefill.passages[0].id", "D800", 0),
    (chat("The sky is blue.\n\nWhich?", specprefill={"question": "Which\udbff?"}), CHAT, "specprefill.question",
     "DBFF", 5),
    (chat(stop=["ok", "\ud800"]), CHAT, "stop", "D800", 0),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("body", "path", "param", "code", "at"), SURROGATE_FIELDS)
def test_a_lone_surrogate_anywhere_is_400_naming_the_field(client, body, path, param, code, at, stream):
    refused(client, {**body, "stream": stream}, path=path, param=param,
            message=f"{param} is not valid Unicode: a lone surrogate (U+{code}) at character {at}")
    endpoint = "chat" if path == CHAT else "completions"
    assert metric(client, 400, endpoint) == 1 and metric(client, 200, endpoint) == 0 == metric(client, 500, endpoint)


def test_surrogate_pairs_are_valid_text(client):
    escaped = json.dumps(chat("what is \U0001F600?"))  # the emoji as the pair "\\ud83d\\ude00"
    raw = json.dumps(chat("what is \U0001F600?"), ensure_ascii=False).encode()  # as its UTF-8 bytes
    for body in (escaped, raw):
        status, answer = send(client, body)
        assert status == 200, answer
    status, answer = send(client, passages({"text": "The sky is blue.", "id": "doc-\U0001F600"}))
    assert status == 200 and answer["specprefill"]["kept_spans"][0]["id"] == "doc-\U0001F600"


def test_the_engine_refuses_lone_surrogates_in_ids(engine):
    for make in (lambda: Passage("The sky.", id="x\udc00"), lambda: Segment(SegmentKind.PASSAGE, "a", "\ud800")):
        with pytest.raises(InputError, match=r"id '.*' holds a lone surrogate \(U\+D[C8]00\) at character \d: ids "
                                             "are returned in answers and must be valid Unicode"):
            make()
    assert Passage("ok", id="\U0001F600").id == "\U0001F600"


# -- 6. every stream ends with [DONE] or an error event; metrics count what the client got ---------


def events(text: str) -> list[str]:
    return [block.removeprefix("data: ") for block in text.split("\n\n") if block.strip()]


def test_a_stream_whose_last_chunk_cannot_be_sent_ends_with_an_error_event(client, monkeypatch):
    last = StreamChunks.last
    monkeypatch.setattr(StreamChunks, "last", lambda self, result: {**last(self, result), "bad": "\ud800"})
    response = client.post(CHAT, content=json.dumps(chat(stream=True, max_tokens=4)))
    assert response.status_code == 200  # the head went out with the first token
    received = events(response.text)
    assert received[-1] == "[DONE]"
    error = json.loads(received[-2])["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error"
    assert error["message"].startswith("internal error in the SpecPrefill gateway: UnicodeEncodeError")
    assert all("choices" in json.loads(e) for e in received[:-2])  # the text before it, whole events
    assert metric(client, 500, mode="specprefill") == 1 and metric(client, 200) == 0
    assert client.get("/health").json()["in_flight"] == 0


def test_an_answer_that_cannot_be_sent_is_500_and_counted_so(client, monkeypatch):
    response = app_module.response
    monkeypatch.setattr(app_module, "response", lambda *args: {**response(*args), "bad": "\ud800"})
    got, answer = send(client, chat())
    assert got == 500 and answer["error"]["code"] == "internal_error"
    assert metric(client, 500) == 1 and metric(client, 200) == 0
    assert client.get("/health").json()["in_flight"] == 0


def test_healthy_streams_end_with_done(client):
    for body, last in ((chat(stream=True), -2), (chat(stream=True, stream_options={"include_usage": True}), -3)):
        received = events(client.post(CHAT, content=json.dumps(body)).text)
        assert received[-1] == "[DONE]" and "specprefill" in json.loads(received[last])
    assert metric(client, 200, mode="specprefill") == 2


# -- 7. smaller ---------------------------------------------------------------------------------------


def test_no_schema_is_served(engine):
    for options in (GatewayOptions(), GatewayOptions(api_key="k")):
        with TestClient(create_app(engine, options), raise_server_exceptions=False) as client:
            for path in ("/openapi.json", "/docs", "/redoc"):
                response = client.get(path, headers={"Authorization": "Bearer k"})
                assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"


def test_stream_options_need_stream_true(client):
    message = "stream_options is only allowed when stream is true"
    for extra in ({}, {"stream": False}):
        refused(client, chat(stream_options={"include_usage": True}, **extra), param="stream_options", message=message)
    assert send(client, chat(stream_options=None))[0] == 200


@pytest.mark.parametrize("content", ["", "   \n", None, [], [{"type": "text", "text": ""}]])
def test_an_empty_question_is_named(client, content):
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
                         {"role": "user", "content": content}]}
    refused(client, body, param="messages[2].content",
            message="messages[2].content is empty: the last user message is the question")


def test_empty_turns_before_the_question_are_fine(client):
    body = {"messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": None},
                         {"role": "assistant", "content": ""}, {"role": "user", "content": "What is the passkey?"}]}
    assert send(client, body)[0] == 200


def test_a_text_part_without_text_is_named(client):
    refused(client, chat([{"type": "text", "text": "hi"}, {"type": "text", "text": None}]),
            param="messages[0].content[1].text", message="messages[0].content[1].text must be a string, got None")
    refused(client, chat(["hi"]), param="messages[0].content[0]",
            message="messages[0].content[0] must be a content part object, got 'hi'")


def test_an_empty_prompt_list_is_named(client):
    refused(client, {"prompt": []}, path="/v1/completions", param="prompt",
            message="prompt is empty: send the prompt as a non-empty string")


def test_no_user_message_is_named(client):
    refused(client, {"messages": [{"role": "system", "content": "Be brief."}]}, param="messages",
            message="messages hold no user message: the last user message is the question")


# -- 4, over 127.0.0.1: /health answers while an oversize body is refused ---------------------------


ROUNDS = 6  # oversize requests per attacker


@pytest.fixture(scope="module")
def loopback(engine) -> Iterator[int]:
    """The gateway (default options, 8 MiB body limit) served by uvicorn in a thread; its port."""
    with app_in_thread(create_app(engine)) as port:
        yield port


def get(port: int, path: str) -> tuple[int, str, float]:
    """(status, body, seconds) of one GET on a new connection."""
    started = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read().decode(), time.perf_counter() - started
    finally:
        conn.close()


def post_big(port: int, body: bytes, chunked: bool) -> tuple[int, dict, float]:
    started = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        if chunked:
            pieces = (body[i:i + (1 << 20)] for i in range(0, len(body), 1 << 20))
            conn.request("POST", CHAT, body=pieces, encode_chunked=True, headers={"Content-Type": "application/json"})
        else:
            conn.request("POST", CHAT, body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read()), time.perf_counter() - started
    finally:
        conn.close()


def test_health_answers_within_half_a_second_while_an_oversize_body_is_refused(loopback):
    big = json.dumps(chat("a" * 10_000_000)).encode()  # the issue's 10,000,000-character message
    answers: dict[bool, list[tuple[int, dict, float]]] = {False: [], True: []}

    def attack(chunked: bool) -> None:  # with a Content-Length, or chunked (read up to the limit)
        for _ in range(ROUNDS):
            answers[chunked].append(post_big(loopback, big, chunked))

    attackers = [threading.Thread(target=attack, args=(chunked,)) for chunked in (False, True)]
    for attacker in attackers:
        attacker.start()
    latencies = []
    deadline = time.monotonic() + 60
    while any(a.is_alive() for a in attackers) and time.monotonic() < deadline:
        status, _, latency = get(loopback, "/health")
        assert status == 200
        latencies.append(latency)
    for attacker in attackers:
        attacker.join(5)
    # The attackers, the server thread and these probes share one interpreter (and, in CI, two
    # cores), so one probe can wait out a scheduling slice that has nothing to do with the
    # gateway (a single 0.55 s probe among ~0.01 s ones was seen in CI). The issue's bound holds for
    # nine probes in ten, and no probe may take 2 s: before the body limit, /health took 4.7 s.
    assert len(latencies) >= 5, latencies
    slow = [t for t in latencies if t >= 0.5]
    assert len(slow) <= len(latencies) // 10 and max(latencies) < 2.0, (len(latencies), sorted(latencies)[-3:])
    limit = 8 << 20
    for chunked, expected in ((False, f"has {len(big)} bytes, over"), (True, "has more bytes than")):
        assert len(answers[chunked]) == ROUNDS
        for status, answer, seconds in answers[chunked]:
            assert status == 413 and answer["error"]["code"] == "request_too_large"
            assert answer["error"]["message"] == (
                f"the request body {expected} this gateway's limit of {limit} bytes (--max-body-bytes)")
            assert seconds < 5.0
    text = get(loopback, "/metrics")[1]
    assert f'specprefill_gateway_requests_total{{endpoint="chat",mode="none",status="413"}} {2.0 * ROUNDS}' in text


def test_the_gateway_still_answers_after_the_refusals(loopback):
    status, answer, _ = post_big(loopback, json.dumps(chat()).encode(), chunked=False)
    assert status == 200 and answer["choices"][0]["message"]["content"] is not None


def test_a_client_gone_before_its_whole_body_is_counted_499(loopback):
    with socket.create_connection(("127.0.0.1", loopback), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"messages\": ")
    line = 'specprefill_gateway_requests_total{endpoint="chat",mode="none",status="499"} 1.0'
    deadline = time.monotonic() + 5
    while line not in get(loopback, "/metrics")[1]:
        assert time.monotonic() < deadline, "the abandoned request was not counted as 499"
        time.sleep(0.05)
