"""The gateway fuzzed from its own OpenAPI document (issue 60, item 6): Schemathesis generates
requests from ``app.openapi()`` — bodies that fit the request schemas and bodies that break them
— and each is sent in process to the gateway over the tiny engine (real llguidance grammars, at
most a few tokens an answer). Every answer must be a 2xx, or a 4xx with OpenAI's error body,
within a time bound; a stream may only end with such an error event. Never a 500.

The example budget is bounded (``EXAMPLES`` per operation and mode, no shrinking past it) so the
whole file stays under two minutes on a busy two-core machine; it runs with the unit tests.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
schemathesis = pytest.importorskip("schemathesis")

from fastapi.testclient import TestClient  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

from specprefill_rag import SpecPrefillEngine  # noqa: E402
from specprefill_rag.gateway import create_app  # noqa: E402
from specprefill_rag.testing import tiny_engine  # noqa: E402

EXAMPLES = 40  # requests per operation and generation mode
MAX_TOKENS = 3  # an answer's tokens at most, whatever the request asks: the fuzzer tests requests, not decoding
SECONDS = 20.0  # the most one answer may take (wall clock, a busy shared machine included)
ERROR_FIELDS = {"message", "type", "param", "code"}


class CappedBackend:
    """The tiny engine's transformers backend (grammars and all), at most ``MAX_TOKENS`` an answer."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def stream_tokens(self, plan: Any, generation: Any) -> Iterator[int]:
        capped = dataclasses.replace(generation, max_new_tokens=min(generation.max_new_tokens, MAX_TOKENS))
        yield from self.inner.stream_tokens(plan, capped)


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    engine = tiny_engine(tools=True)
    capped = SpecPrefillEngine(CappedBackend(engine.backend), engine.draft, engine.config)
    with TestClient(create_app(capped), raise_server_exceptions=False) as test_client:
        assert test_client.get("/ready").status_code == 200
        yield test_client


@pytest.fixture(scope="module")
def schema(client: TestClient) -> Any:
    return schemathesis.openapi.from_dict(client.app.openapi())


def check_error(error: object, where: str) -> None:
    assert isinstance(error, dict) and set(error) == ERROR_FIELDS, where
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), where
    assert error["type"] != "server_error", where
    assert len(error["message"]) <= 1000, where


def check_answer(response: Any, seconds: float, where: str) -> None:
    """2xx, or 4xx with an OpenAI error body; a stream's events end with ``[DONE]``, any error event
    among them a client's."""
    status = response.status_code
    assert seconds < SECONDS, f"{where}: {seconds:.1f} s"
    assert 200 <= status < 300 or 400 <= status < 500, f"{where}: {status} {response.text[:500]}"
    if status >= 400:
        check_error(response.json().get("error"), f"{where}: {response.text[:500]}")
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        blocks = [e for e in response.text.split("\n\n") if e.strip()]
        if blocks and blocks[0].startswith("event: "):  # a Responses stream: typed events, no [DONE]
            typed = [json.loads(block.split("\ndata: ", 1)[1]) for block in blocks]
            assert typed[-1]["type"] in ("response.completed", "response.incomplete", "error"), where
            for data in (data for data in typed if data["type"] == "error"):  # OpenAI's error event
                assert data["code"] != "internal_error" and data["message"], f"{where}: {data}"
                assert len(data["message"]) <= 1000, where
            return
        events = [e.removeprefix("data: ") for e in blocks]
        assert events and events[-1] == "[DONE]", where
        for event in events[:-1]:
            data = json.loads(event)
            if "error" in data:
                check_error(data["error"], f"{where}: {event[:500]}")


def send(client: TestClient, case: Any) -> None:
    """``case`` serialized by Schemathesis (its media type, its headers), sent through ``client``."""
    request = case.as_transport_kwargs(base_url="http://testserver")
    body = request.get("data", request.get("content"))
    if "json" in request:
        body = json.dumps(request["json"])
    where = f"{case.method} {case.formatted_path} {str(body)[:300]}"
    started = time.perf_counter()
    response = client.request(request["method"], request["url"], headers=request.get("headers"),
                              params=request.get("params"), content=body)
    check_answer(response, time.perf_counter() - started, where)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_no_generated_request_is_a_server_error(client, schema, path, mode):
    operation = schema[path]["POST"]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, phases=[Phase.generate], database=None,
              suppress_health_check=list(HealthCheck))
    def fuzz(case: Any) -> None:
        send(client, case)

    fuzz()


def test_the_other_routes_answer_without_a_server_error(client, schema):
    for path in ("/v1/models", "/v1/models/{model_id}", "/health", "/ready", "/metrics"):
        operation = schema[path]["GET"]

        @given(case=operation.as_strategy())
        @settings(max_examples=5, deadline=None, phases=[Phase.generate], database=None,
                  suppress_health_check=list(HealthCheck))
        def fuzz(case: Any) -> None:
            send(client, case)

        fuzz()


def test_the_document_describes_the_request_bodies(client):
    document = client.app.openapi()
    body = document["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["required"] == ["messages"] and "response_format" in body["schema"]["properties"]
    assert client.get("/openapi.json").status_code == 404  # not served: it is for tests and tools
