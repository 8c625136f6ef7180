"""A request's caps in all (issue 60, item 4): no body within the byte limit becomes a million
objects. The per-message limits (4096 documents, parts, passages) held, but 400 tool messages of
4,000 blank-line-separated documents each (7 MB, 1.6M segments) were all built before the length
check: a 400 after 14 s (11 s of CPU), +458 MB of memory, ``/health`` up to 0.6 s.

Now splitting stops at ``prompt.MAX_SEGMENTS`` segments in all, content parts and tool documents
are counted across messages before any is split (``gateway.limits``), and the JSON objects and
arrays of a body are counted before it is decoded. Each hostile body below is a 400 naming what
was over, within 2 s of CPU and +50 MB of memory (tracemalloc), while ``/health`` answers.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
import tracemalloc
from collections.abc import Callable

import pytest

from specprefill_rag.errors import InputError
from specprefill_rag.prompt import MAX_SEGMENTS, count_documents, message_segments, split_documents, split_tool_result
from specprefill_rag.types import Passage, SegmentKind

# -- the library: splitting stops at its limit ----------------------------------------------------

BLANK = re.compile(r"\n[ \t]*\n")


def old_split(text: str, limit: int | None) -> list[Passage]:
    """``split_documents`` as it was (every piece built first): the behaviour to keep."""
    parts = [p for p in (p.strip() for p in BLANK.split(text)) if p]
    if limit is not None and len(parts) > limit:
        size = -(-len(parts) // limit)
        parts = ["\n\n".join(parts[i:i + size]) for i in range(0, len(parts), size)]
    return [Passage(p) for p in parts]


def test_split_documents_reads_a_chunk_at_a_time_and_splits_as_before(monkeypatch):
    from specprefill_rag.prompt import segments

    monkeypatch.setattr(segments, "_CHUNK", 5)  # a cut in every few characters
    texts = ["", "a", "a\n\nb", "a\n \n\n\t\nb\n\n\n", " x \n\n\n\n y\n\t\n z ", "a\n\nb\n\nc\n\nd\n\ne",
             "\n\n".join(f"doc {i}\nline" for i in range(40)), "no blank line\nat all " * 9]
    for text in texts:
        for limit in (None, 1, 2, 3, 7, 100):
            assert split_documents(text, limit) == old_split(text, limit), (text, limit)


def test_a_million_documents_are_joined_back_in_bounded_memory():
    text = "a\n\n" * 1_000_000
    tracemalloc.start()
    try:
        passages = split_documents(text, 4096)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert 4000 < len(passages) <= 4096 and "".join(p.text for p in passages).count("a") == 1_000_000
    assert peak < 8 << 20, peak  # the old split held a million strings: 60 MB


def test_a_tool_result_is_counted_and_refused_before_it_is_split():
    text = "doc\n\n" * 50
    assert count_documents(text, 10) == 11  # one past the limit: too many
    assert count_documents(text, 100) == 50 and count_documents("[1, [2, 3], {}]", 2) == 3
    assert count_documents("[" + "0, " * 1000 + "0]", 5) == 6 and count_documents("[1, 2", 1) == 1  # not JSON
    with pytest.raises(InputError, match="more than 10 documents"):
        split_tool_result(text, 10)
    assert len(split_tool_result(text, 50)[0]) == 50
    items, tail = split_tool_result('[1, {"a": [2]} ,\n 3] ')
    assert [item for _, item, _ in items] == ["1", '{"a": [2]}', "3"] and tail == "] "
    for broken in ("[1,, 2]", "[1, 2,]", "[1] [2]", "[1 2]"):  # no JSON array: documents of text
        assert split_tool_result(broken)[0] == [("", broken, False)], broken


def test_megabytes_of_json_in_a_tool_result_are_never_decoded():
    """Decoding 8 MB of ``{},`` to learn that it is one JSON value built 2.6M dicts (+200 MB); past
    65,536 commas, colons and brackets a tool's output is read as text (one document here)."""
    huge = '{"a": [' + "{}," * 2_600_000 + "{}]}"
    tracemalloc.start()
    try:
        items, tail = split_tool_result(huge, 10)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert items == [("", huge, False)] and tail == "" and peak < 20 << 20, peak >> 20
    small = '{"a": [' + "{}," * 100 + "{}]}"
    assert split_tool_result(small) == ([("", small, True)], "")  # JSON as before: one atomic item


def agent_chat(tool_messages: int, documents: int) -> list[dict]:
    chat: list[dict] = [{"role": "user", "content": "Find it."}]
    for i in range(tool_messages):
        chat.append({"role": "assistant", "content": None, "tool_calls": [{"id": f"c{i}", "name": "search"}]})
        chat.append({"role": "tool", "tool_call_id": f"c{i}", "content": "a\n\n" * documents})
    return chat


def test_message_segments_stop_at_their_limit_in_all():
    search = {"type": "function", "function": {"name": "search"}}
    segments = message_segments(agent_chat(3, 5), [search], max_segments=None)
    assert sum(s.kind is SegmentKind.TOOL_RESULT for s in segments) == 15
    assert message_segments(agent_chat(3, 5), [search], max_segments=len(segments)) == segments
    with pytest.raises(InputError, match=rf"more than {len(segments) - 1} segments in all .* at message 6"):
        message_segments(agent_chat(3, 5), [search], max_segments=len(segments) - 1)
    with pytest.raises(InputError, match=f"more than {MAX_SEGMENTS} segments in all"):
        message_segments(agent_chat(5, 4000), [search])  # 20,000 documents: refused at the fifth message


# -- the gateway: hostile bodies within the byte limit ----------------------------------------------

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from fastapi.testclient import TestClient  # noqa: E402
from servers import app_in_thread  # noqa: E402

from specprefill_rag.gateway import create_app  # noqa: E402
from specprefill_rag.testing import tiny_engine  # noqa: E402

CHAT = "/v1/chat/completions"
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}
RAG_SYSTEM = ("You are an assistant for question-answering tasks. Use the following pieces of retrieved context to "
              "answer the question. If you don't know the answer, say that you don't know. Use three sentences "
              "maximum and keep the answer concise.\n\n")


def tool_chat(contents: list[object]) -> dict:
    messages: list[dict] = [{"role": "user", "content": "Find it."}]
    for i, content in enumerate(contents):
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "search", "arguments": "{}"}}]})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": content})
    return {"model": "m", "max_tokens": 2, "messages": messages, "tools": [SEARCH]}


def chat(messages: list[dict]) -> dict:
    return {"model": "m", "max_tokens": 2, "messages": messages}


# name -> (body, what the 400's message says). Each fits the 8 MiB body limit.
HOSTILE: dict[str, tuple[Callable[[], dict], str]] = {
    # The issue's: 400 tool messages x 4,000 documents, 1.6M segments in 8 MB.
    "tool documents": (lambda: tool_chat(["a\n\n" * 4000] * 400),
                       f"the tool messages hold more than {MAX_SEGMENTS} documents in all"),
    "tool JSON items": (lambda: tool_chat(["[" + "0," * 4000 + "0]"] * 400),
                        f"the tool messages hold more than {MAX_SEGMENTS} documents in all"),
    # The same spread over passages recognised in 400 system messages, and over <context> blocks.
    "recognised passages": (lambda: chat([{"role": "system", "content": RAG_SYSTEM + "a\n\n" * 4000}] * 400
                                         + [{"role": "user", "content": "Which?"}]),
                            f"the messages hold more than {MAX_SEGMENTS} segments in all"),
    "context blocks": (lambda: chat([{"role": "user", "content": ("<context>" + "a\n\n" * 600 + "</context>") * 2600
                                      + "Which?"}]),
                       f"the messages hold more than {MAX_SEGMENTS} segments in all"),
    # ... and over content parts: 24,000 parts, then as many as 8 MB hold (260,000, 80 MB as dicts).
    "content parts": (lambda: tool_chat([[{"type": "text", "text": "a"}] * 4000] * 6),
                      f"the messages hold more than {MAX_SEGMENTS} content parts in all"),
    "content parts, 8 MB": (lambda: tool_chat([[{"type": "text", "text": "a"}] * 4000] * 65),
                            "the request body holds more than the gateway's limit of 65536 JSON objects and arrays"),
    "tool calls": (lambda: {**chat([{"role": "user", "content": "Find it."}] + [
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "search"}}] * 60}] * 4000),
        "tools": [SEARCH]}, "the request body holds more than the gateway's limit of 65536 JSON objects and arrays"),
}
BODIES: dict[str, bytes] = {}


def raw(name: str) -> bytes:
    if name not in BODIES:
        BODIES[name] = json.dumps(HOSTILE[name][0]()).encode()
        assert len(BODIES[name]) <= 8 << 20, (name, len(BODIES[name]))
    return BODIES[name]


@pytest.fixture(scope="module")
def engine():
    return tiny_engine(tools=True)


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine), raise_server_exceptions=False) as test_client:
        yield test_client


def refused(client: TestClient, name: str) -> dict:
    response = client.post(CHAT, content=raw(name), headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith(HOSTILE[name][1]), error
    assert len(error["message"]) < 250  # says what was over; quotes no client text
    return error


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_body_is_a_fast_400_in_bounded_memory(client, name):
    body = raw(name)
    started = time.process_time()
    error = refused(client, name)
    cpu = time.process_time() - started
    # 11-17 s before the caps, 0.06-0.8 s with them on a quiet 2-core machine; process_time counts
    # every thread of the test process, so the bound leaves room for a busy one (CI read 1.04 s).
    assert cpu < 2.0, (name, cpu)
    if error["param"] is not None:
        assert re.fullmatch(r"messages\[\d+\]\.content", error["param"]), error
    tracemalloc.start()
    try:
        refused(client, name)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 50 << 20, (name, peak >> 20, len(body) >> 20)  # +458 MB before (the body's copies count)


def test_a_request_just_within_the_caps_is_read(client):
    """16,000 documents over four tool messages pass the caps (and reach the window's check)."""
    body = tool_chat(["a\n\n" * 4000] * 4)
    response = client.post(CHAT, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text[:300]
    assert "window" in response.json()["error"]["message"]  # refused by its length, not by a cap


def test_health_answers_while_hostile_bodies_are_refused(engine):
    def post(port: int, payload: bytes) -> tuple[int, float]:
        started = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            conn.request("POST", CHAT, body=payload, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            response.read()
            return response.status, time.perf_counter() - started
        finally:
            conn.close()

    answers: list[tuple[int, float]] = []
    with app_in_thread(create_app(engine)) as port:
        attacker = threading.Thread(target=lambda: answers.extend(post(port, raw(n)) for n in HOSTILE))
        attacker.start()
        latencies = []
        while attacker.is_alive():
            started = time.perf_counter()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            try:
                conn.request("GET", "/health")
                assert conn.getresponse().status == 200
            finally:
                conn.close()
            latencies.append(time.perf_counter() - started)
        attacker.join()
    assert [status for status, _ in answers] == [400] * len(HOSTILE)
    assert max(seconds for _, seconds in answers) < 10  # generous: a busy two-core machine
    # The attacker, the server and these probes share one interpreter: nine probes in ten under
    # 0.5 s and none over 2 s (0.6 s before, with one attacker body).
    slow = [t for t in latencies if t >= 0.5]
    assert latencies and len(slow) <= len(latencies) // 10 and max(latencies) < 2.0, sorted(latencies)[-3:]
