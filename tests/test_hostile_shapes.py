"""One request must not freeze the gateway (issue 46, items 1, 2 and 7).

* Prompt-shape recognition is linear in the message's length whatever the text: for every shape,
  adversarial messages (runs of whitespace, newlines, tabs and dashes; repeated and truncated
  markers; shapes left unclosed) at 100 KB and 1 MB, the 1 MB one taking at most 30 times the
  100 KB one (10 for linear, 100 for quadratic; a 1 MB string outgrows a small CPU cache, which
  made one linear shape 15.7 times slower on a CI machine) and under 2 s. Before the fix, 20 KB
  of newlines after "Context:" took 1.6 s and 200 KB 154-189 s (quadratic); now 200 KB takes
  milliseconds. A hypothesis test repeats random
  units of marker fragments and whitespace and checks the same growth.
* Over 127.0.0.1, ``/health`` answers within 0.5 s while such messages are being parsed.
* Admission comes before the body is parsed: a full queue or too many body bytes in flight is a
  429 without parsing; a body declared as anything but JSON is a 415.
* ``/ready`` reuses its upstream check: many probes, one ping.
* A huge integer retriever score is a 400 naming the field, never a 500; the library treats it as
  missing.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specprefill_rag import selection
from specprefill_rag.errors import InputError
from specprefill_rag.gateway.messages import recognise, to_segments
from specprefill_rag.types import Segment, SegmentKind

# -- linear shape recognition -------------------------------------------------------------------

LI_HEAD = "Context information is below.\n---------------------\n"
LI_SEP = "\n---------------------\n"
STUFF_QA = ("Use the following pieces of context to answer the question at the end. If you don't know the answer, "
            "just say that you don't know, don't try to make up an answer.")
RAG_SYSTEM = ("You are an assistant for question-answering tasks. Use the following pieces of retrieved context to "
              "answer the question. If you don't know the answer, say that you don't know. Use three sentences "
              "maximum and keep the answer concise.")
STUFF_CHAT = ("Use the following pieces of context to answer the user's question. If you don't know the answer, "
              "just say that you don't know, don't try to make up an answer.")

# Each shape's markers, in the order its template writes them.
MARKERS: dict[str, list[str]] = {
    "llamaindex_qa": [LI_HEAD, "ctx", LI_SEP, "Given the context.\nQuery: ", "q", "\nAnswer:"],
    "langchain_rag_prompt": ["Be brief.\n", "Question: ", "q", "\nContext: ", "ctx", "\nAnswer:"],
    "langchain_stuff": [STUFF_QA, "\n", "ctx", "\n\nQuestion: ", "q", "\nHelpful Answer:"],
    "langchain_rag_system": [RAG_SYSTEM, "\n\n", "ctx"],
    "langchain_stuff_chat": [STUFF_CHAT, "\n----------------\n", "ctx"],
    "tagged": ["<documents>", '<document id="a">', "ctx", "</document>", "<context>", "c", "</context>",
               "</documents>"],
}
FILLERS = [" ", "\n", "\t", " \n", "\n\n", "-", "\n-", "-----", " \t\n-"]


def fillers_of(markers: list[str]) -> list[str]:
    """Runs to repeat: whitespace and dashes, and each marker whole and cut short."""
    cut = [m[: max(1, len(m) - 1)] for m in markers if len(m) > 1]
    return FILLERS + [m for m in markers if m.strip()] + cut


def adversarial(shape: str) -> Iterator[tuple[str, Callable[[int], str]]]:
    """(label, size -> message of about that many characters): each prefix of the shape's markers
    (an unclosed shape) followed by one filler repeated, then the next marker cut short."""
    markers = MARKERS[shape]
    for i in range(len(markers) + 1):
        head = "".join(markers[:i])
        tail = markers[i][:-1] if i < len(markers) else "x"
        for filler in fillers_of(markers):
            def make(size: int, head: str = head, filler: str = filler, tail: str = tail) -> str:
                return head + filler * max(1, (size - len(head)) // len(filler)) + tail

            yield f"{i} markers, then {filler!r}", make


def parse_time(message: str, role: str) -> float:
    """Seconds to recognise ``message`` and build its segments, as the gateway does."""
    turns = [("system", message), ("user", "q?")] if role == "system" else [("user", message)]
    started = time.perf_counter()
    try:
        to_segments(turns)
    except InputError:
        pass
    return time.perf_counter() - started


FLOOR_S = 0.005  # below this a time is noise (a busy machine): a quadratic shape takes seconds at 100 KB


GROWTH_LIMIT = 30  # x10 the size: linear is 10, quadratic 100; cache misses push linear to ~16


def grows_linearly(small_text: str, large_text: str, role: str, limit_s: float, floor_s: float) -> list:
    """Best of three parse times of each text (a busy machine can slow one measurement); returns
    them when the large text takes ``limit_s`` or more or over ``GROWTH_LIMIT`` times the small
    one, else an empty list."""
    small = min(parse_time(small_text, role) for _ in range(3))
    large = min(parse_time(large_text, role) for _ in range(3))
    if large < limit_s and large <= GROWTH_LIMIT * max(small, floor_s):
        return []
    return [round(small, 4), round(large, 4)]


def assert_linear(make: Callable[[int], str], role: str, label: str) -> None:
    """Parsing ``make(1_000_000)`` takes under 2 s and at most ``GROWTH_LIMIT`` times
    ``make(100_000)``: a quadratic shape misses by a factor of 100, every time."""
    times = grows_linearly(make(100_000), make(1_000_000), role, 2.0, FLOOR_S)
    assert not times, f"{label}: parse times (100 KB, 1 MB) {times}"


@pytest.mark.full
@pytest.mark.parametrize("shape", list(MARKERS))
@pytest.mark.parametrize("role", ["user", "system"])
def test_every_shape_is_recognised_in_linear_time(shape, role):
    for label, make in adversarial(shape):
        assert_linear(make, role, f"{shape}: {label}")


def test_the_issues_messages_are_linear():
    cases = {
        "newlines after Context:": lambda n: "Question: a\nContext: " + "\n" * n + "x",
        "spaces before a cut Answer:": lambda n: "Question: a\nContext: b" + " " * n + "\nAnswe",
        "a LlamaIndex query of spaces": lambda n: LI_HEAD + "ctx" + LI_SEP + "Query: q" + " " * n + "\nAnswe",
    }
    for label, make in cases.items():
        assert_linear(make, "user", label)


def test_the_shapes_still_take_their_templates_apart():
    message = "Be brief.\nQuestion: Who?  \n\nContext: Doc one.\n\nDoc two.   \nAnswer:"
    found = recognise(message, "user")
    assert found is not None and found.shape == "langchain_rag_prompt"
    assert found.rest == "Who?" and [p.text for p in found.passages] == ["Doc one.", "Doc two."]
    assert found.instructions == "Be brief."
    li = recognise(LI_HEAD + "A.\n\nB." + LI_SEP + "Given the context.\nQuery: Why?  \n Answer:".replace(
        "  \n Answer:", "  \nAnswer:"), "user")
    assert li is not None and li.shape == "llamaindex_qa" and li.rest == "Why?"
    assert [p.text for p in li.passages] == ["A.", "B."]
    stuff = recognise(STUFF_QA + "\n\nA.\n\nB.\n\nQuestion: When? \nHelpful Answer:", "user")
    assert stuff is not None and stuff.shape == "langchain_stuff" and stuff.rest == "When?"
    assert [p.text for p in stuff.passages] == ["A.", "B."]


FRAGMENTS = st.sampled_from(sorted({f for markers in MARKERS.values() for m in markers
                                    for f in (m, m[:3], m[-3:], m[: len(m) // 2]) if f} | set(FILLERS)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(head=st.lists(st.sampled_from([m for markers in MARKERS.values() for m in markers]), max_size=6),
       unit=st.lists(FRAGMENTS, min_size=1, max_size=4).map("".join))
def test_no_generated_message_makes_recognition_super_linear(head, unit):
    prefix = "".join(head)
    small_text, large_text = (prefix + unit * max(1, size // len(unit)) for size in (20_000, 200_000))
    times = grows_linearly(small_text, large_text, "user", 1.0, FLOOR_S / 10)
    assert not times, f"{prefix[:80]!r} + {unit!r} repeated: parse times (20 KB, 200 KB) {times}"


# -- the gateway: admission before parsing, /ready, the huge score ------------------------------

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from fastapi.testclient import TestClient  # noqa: E402
from servers import app_in_thread  # noqa: E402

from specprefill_rag.gateway import GatewayOptions, create_app  # noqa: E402
from specprefill_rag.gateway.app import Gateway  # noqa: E402
from specprefill_rag.testing import tiny_engine  # noqa: E402

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


def body(content: str = "What is the passkey?", **fields: object) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 2,
                       **fields}).encode()


def test_a_body_not_declared_as_json_is_415(engine):
    with TestClient(create_app(engine), raise_server_exceptions=False) as client:
        for media in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            response = client.post(CHAT, content=body(), headers={"Content-Type": media})
            assert response.status_code == 415, media
            assert response.json()["error"]["code"] == "unsupported_media_type"
        for media in ("application/json", "application/json; charset=utf-8", "application/vnd.api+json"):
            assert client.post(CHAT, content=body(), headers={"Content-Type": media}).status_code == 200, media
        assert client.post(CHAT, content=body(), headers={"Content-Type": ""}).status_code == 415
        metrics = client.get("/metrics").text
        assert 'specprefill_gateway_requests_total{endpoint="chat",mode="none",status="415"} 4.0' in metrics


def test_admission_is_decided_before_the_body_is_parsed(engine, monkeypatch):
    parsed: list[bytes] = []
    real = Gateway._parse

    def counted(self, raw, endpoint, tenant):
        parsed.append(raw)
        return real(self, raw, endpoint, tenant)

    monkeypatch.setattr(Gateway, "_parse", counted)
    with TestClient(create_app(engine, max_queue=1), raise_server_exceptions=False) as client:
        gateway: Gateway = client.app.state.gateway  # type: ignore[attr-defined]
        gateway.admitted = 1  # a request in flight fills the queue
        response = client.post(CHAT, content=body(), headers={"Content-Type": "application/json"})
        assert response.status_code == 429 and response.headers["retry-after"] == "1" and parsed == []
        gateway.admitted = 0
        gateway.body_bytes = gateway.max_body_bytes_in_flight - 10  # bodies being read fill the budget
        response = client.post(CHAT, content=body(), headers={"Content-Type": "application/json"})
        assert response.status_code == 429 and "--max-body-bytes-in-flight" in response.json()["error"]["message"]
        assert parsed == []
        gateway.body_bytes = 0
        response = client.post(CHAT, content=body(), headers={"Content-Type": "application/json"})
        assert response.status_code == 200 and len(parsed) == 1
        assert gateway.admitted == 0 and gateway.body_bytes == 0  # everything given back


def test_bodies_in_flight_are_bounded_and_given_back(engine):
    options = GatewayOptions(max_body_bytes=1000)
    assert options.max_body_bytes_in_flight == 4000
    with pytest.raises(Exception, match="max_body_bytes_in_flight must be an int >= max_body_bytes"):
        GatewayOptions(max_body_bytes=1000, max_body_bytes_in_flight=999)
    with TestClient(create_app(engine, max_body_bytes=10_000), raise_server_exceptions=False) as client:
        gateway: Gateway = client.app.state.gateway  # type: ignore[attr-defined]
        for raw in (b"{not json", json.dumps({"messages": "x"}).encode(), body(), b"x" * 20_000):
            client.post(CHAT, content=raw, headers={"Content-Type": "application/json"})
            assert gateway.body_bytes == 0 and gateway.admitted == 0


class PingCounter:
    """A backend's ``ping`` that counts its calls (an upstream's ``/v1/models``)."""

    def __init__(self) -> None:
        self.calls = 0
        self.fail = False

    def __call__(self) -> None:
        self.calls += 1
        time.sleep(0.05)
        if self.fail:
            from specprefill_rag.errors import BackendError

            raise BackendError("unreachable")


def test_ready_reuses_its_upstream_check(engine, monkeypatch):
    ping = PingCounter()
    monkeypatch.setattr(engine.backend, "ping", ping, raising=False)
    app = create_app(engine, ready_cache_s=0.5)
    gateway: Gateway = app.state.gateway

    async def probes(n: int) -> list[bool]:
        return [ok for ok, _ in await asyncio.gather(*(gateway.ready() for _ in range(n)))]

    gateway.warmed = True
    assert asyncio.run(probes(50)) == [True] * 50
    assert ping.calls == 1  # fifty concurrent probes, one request upstream
    assert asyncio.run(probes(50)) == [True] * 50 and ping.calls == 1
    ping.fail = True
    time.sleep(0.55)
    ok, checks = asyncio.run(gateway.ready())
    assert not ok and checks["checks"]["upstream"].endswith(": unreachable") and ping.calls == 2
    assert not asyncio.run(gateway.ready())[0] and ping.calls == 2


def test_a_huge_integer_retriever_score_is_a_400_naming_the_field(engine):
    huge = int("1" + "0" * 400)
    with TestClient(create_app(engine), raise_server_exceptions=False) as client:
        for score in (huge, -huge, "0.9", True):
            raw = body(specprefill={"passages": [{"text": "The passkey is 4.", "metadata": {"score": score}}]})
            response = client.post(CHAT, content=raw, headers={"Content-Type": "application/json"})
            assert response.status_code == 400, (score, response.text)
            error = response.json()["error"]
            assert error["param"] == "specprefill.passages[0].metadata.score"
            assert error["message"].startswith("specprefill.passages[0].metadata.score must be a finite number")
        raw = body(specprefill={"passages": [{"text": "The passkey is 4.", "metadata": {"score": 0.5}}]})
        assert client.post(CHAT, content=raw, headers={"Content-Type": "application/json"}).status_code == 200


def test_the_library_treats_a_huge_integer_score_as_missing():
    huge = int("1" + "0" * 400)
    segments = [Segment(SegmentKind.PASSAGE, "a", "1", {"score": huge}),
                Segment(SegmentKind.PASSAGE, "b", "2", {"score": 0.5})]
    prior = selection.retriever_scores(segments)
    assert prior is not None and prior.isnan().tolist() == [True, False]
    assert selection.retriever_scores(segments[:1]) is None


# -- over 127.0.0.1: /health answers while hostile messages are parsed ----------------------------


def request(port: int, method: str, path: str, payload: bytes | None = None, timeout: float = 60
            ) -> tuple[int, bytes, float]:
    started = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=payload, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read(), time.perf_counter() - started
    finally:
        conn.close()


def test_health_answers_while_hostile_messages_are_parsed(engine):
    hostile = [
        "Question: a\nContext: " + "\n" * 1_000_000 + "x",  # 154-189 s at 200 KB before the fix
        "Question: a\nContext: b" + " " * 1_000_000 + "\nAnswe",
        LI_HEAD + "ctx" + LI_SEP + "Query: q" + " " * 1_000_000 + "\nAnswe",
        STUFF_QA + " " * 1_000_000 + "x",
    ]
    answers: list[tuple[int, bytes, float]] = []

    def attack() -> None:
        for text in hostile:
            answers.append(request(port, "POST", CHAT, body(text)))

    with app_in_thread(create_app(engine)) as port:
        attacker = threading.Thread(target=attack)
        attacker.start()
        latencies = []
        while attacker.is_alive():
            status, _, latency = request(port, "GET", "/health", timeout=10)
            assert status == 200
            latencies.append(latency)
        attacker.join()
    assert len(answers) == len(hostile)
    for status, answer, seconds in answers:
        assert status in (200, 400), answer[:200]  # answered or refused as usual, within seconds
        assert seconds < 30
    # The attacker, the server and these probes share one interpreter (two cores in CI): nine
    # probes in ten under 0.5 s, none over 2 s (before the fix: 154 s).
    slow = [t for t in latencies if t >= 0.5]
    assert latencies and len(slow) <= len(latencies) // 10 and max(latencies) < 2.0, sorted(latencies)[-3:]
