"""Chat messages to an OpenAI-compatible ``/v1/chat/completions``: the gateway's text mode.

Text mode sends the draft's kept text as an ordinary chat (docs/gateway.md, "Text mode"): the
upstream renders its own chat template and tokenizes, so any OpenAI-compatible server answers it,
a stock vLLM without the SpecPrefill plugin included. ``ChatUpstream`` streams the answer's text
deltas and ends with the upstream's finish reason and usage. It rides on a server backend's
transport (``VLLMServerBackend.chat_upstream``): the same URL, timeouts, retries and deadline rules,
every failure a ``BackendError`` naming the server.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..config import GenerationConfig
from ..errors import BackendError
from ..types import is_int

__all__ = ["CHAT_PATH", "ChatAnswer", "ChatUpstream", "EventTransport", "chat_body"]

CHAT_PATH = "/v1/chat/completions"


class EventTransport(Protocol):
    """What ``ChatUpstream`` needs of an HTTP client: server-sent events of a POST, and the
    error for an event of the wrong shape (``vllm_http.VLLMHTTPClient`` is one)."""

    base_url: str

    def stream(self, path: str, body: dict[str, Any], timeout: float | None) -> Generator[dict[str, Any], None, None]:
        ...

    def malformed(self, exc: Exception, data: bytes) -> BackendError:
        ...


@dataclass(frozen=True)
class ChatAnswer:
    """How the upstream ended one answer, as it reported it."""

    finish_reason: str  # the upstream's ("stop", "length", ...); "" when it sent none
    prompt_tokens: int | None  # the prompt it prefilled, in its tokens; None: no usage reported
    completion_tokens: int | None  # the tokens it generated; None: no usage reported


def chat_body(messages: Sequence[Mapping[str, str]], generation: GenerationConfig, *, model: str, max_tokens: int,
              cache_salt: str | None = None) -> dict[str, Any]:
    """The streamed ``/v1/chat/completions`` JSON: only standard fields, plus vLLM's ``top_k`` and
    ``cache_salt`` when the request sets them. Stop strings go to the upstream, which applies them."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
        "max_tokens": max_tokens,
        "temperature": 0.0 if generation.greedy else generation.temperature,
        "top_p": generation.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if generation.top_k:
        body["top_k"] = generation.top_k
    if generation.seed is not None:
        body["seed"] = generation.seed
    if generation.stop:
        body["stop"] = list(generation.stop)
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return body


class ChatUpstream:
    """One OpenAI-compatible server answering chats for ``model`` over ``transport``."""

    def __init__(self, transport: EventTransport, model: str) -> None:
        self.transport = transport
        self.model = model

    @property
    def base_url(self) -> str:
        return self.transport.base_url

    def stream(self, messages: Sequence[Mapping[str, str]], generation: GenerationConfig, *, max_tokens: int,
               cache_salt: str | None = None) -> Generator[str, None, ChatAnswer]:
        """The answer's text deltas as they stream in; returns how it ended. ``generation.timeout``
        bounds the whole exchange; closing the generator closes the connection (the upstream stops)."""
        body = chat_body(messages, generation, model=self.model, max_tokens=max_tokens, cache_salt=cache_salt)
        finish, usage = "", None
        with contextlib.closing(self.transport.stream(CHAT_PATH, body, generation.timeout)) as events:
            for event in events:
                try:
                    text, reason, used = _chunk(event)
                except (TypeError, ValueError) as exc:
                    raise self.transport.malformed(exc, json.dumps(event).encode()) from exc
                finish, usage = reason or finish, used or usage
                if text:
                    yield text
        prompt, completion = usage if usage is not None else (None, None)
        return ChatAnswer(finish, prompt, completion)


def _chunk(event: dict[str, Any]) -> tuple[str, str, tuple[int | None, int | None] | None]:
    """(text, finish reason, (prompt, completion) usage) of one ``chat.completion.chunk``;
    ``TypeError`` for a chunk not shaped like OpenAI's."""
    choices = event.get("choices") or []
    if not isinstance(choices, list):
        raise TypeError(f"'choices' must be a list, got {type(choices).__name__}")
    texts, finish = [], ""
    for choice in choices:
        if not isinstance(choice, dict):
            raise TypeError(f"a choice must be a JSON object, got {type(choice).__name__}")
        delta = choice.get("delta") or {}
        content = delta.get("content") if isinstance(delta, dict) else None
        if content is not None and not isinstance(content, str):
            raise TypeError(f"'delta.content' must be a string, got {type(content).__name__}")
        texts.append(content or "")
        reason = choice.get("finish_reason")
        finish = reason if isinstance(reason, str) else finish
    usage = event.get("usage")
    if usage is None:
        return "".join(texts), finish, None
    if not isinstance(usage, dict):
        raise TypeError(f"'usage' must be a JSON object, got {type(usage).__name__}")
    counts = [usage.get(name) for name in ("prompt_tokens", "completion_tokens")]
    prompt, completion = (int(n) if is_int(n) and n >= 0 else None for n in counts)
    return "".join(texts), finish, (prompt, completion)
