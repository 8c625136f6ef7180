"""Answers in the OpenAI wire format: whole responses, stream chunks, and errors.

``to_api_error`` decides the HTTP status of every failure of the engine (docs/gateway.md,
"Errors"); ``APIError`` carries it with OpenAI's error body. No web framework here.
"""

from __future__ import annotations

import json
import logging
import time
import traceback
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import (
    BackendError,
    BackendTimeoutError,
    ConfigError,
    GrammarError,
    InputError,
    PlanError,
    SchemaError,
    ServerError,
    ToolCallError,
    excerpt,
)
from ..types import GenerationResult, ToolCall

__all__ = [
    "RETRY_AFTER_S",
    "APIError",
    "Kind",
    "StreamChunks",
    "arguments_text",
    "error_body",
    "extension",
    "finish_reason",
    "message",
    "new_id",
    "now",
    "response",
    "to_api_error",
    "usage",
]

logger = logging.getLogger(__name__)

Kind = Literal["chat", "completion"]
RETRY_AFTER_S = 1  # seconds a refused client is asked to wait (429, 503)
# The longest error message sent: what a message quotes of a client is cut to ``errors.QUOTE_CHARS``
# where it is written; this caps whatever slips through (an upstream's message, say).
MAX_MESSAGE_CHARS = 1000


class APIError(Exception):
    """An error answered as OpenAI does: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        message = excerpt(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def to_api_error(error: BaseException) -> APIError:
    """The HTTP answer for an exception of the engine (docs/gateway.md, "Errors")."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, ToolCallError):  # a valid request; the model's answer broke the tool-calling rules
        return APIError(422, f"the model did not answer with valid tool calls, so none is reported: {error}",
                        type="invalid_model_output", code="invalid_tool_call")
    if isinstance(error, SchemaError):
        return APIError(400, str(error), param=error.path or None)
    if isinstance(error, GrammarError):  # the request's grammar: refused before the answer, or failing in it
        return APIError(400, str(error), param=error.param)
    if isinstance(error, (InputError, ConfigError, PlanError)):
        return APIError(400, str(error))
    retry = {"Retry-After": str(RETRY_AFTER_S)}
    if isinstance(error, BackendTimeoutError):
        return APIError(504, f"the main model did not answer in time: {error}", type="timeout_error",
                        code="upstream_timeout")
    if isinstance(error, ServerError):
        if error.status == 503:
            return APIError(503, f"the main model's server is overloaded: {error}", type="upstream_error",
                            code="upstream_unavailable", headers=retry)
        return APIError(502, f"the main model's server failed: {error}", type="upstream_error", code="upstream_error")
    if isinstance(error, BackendError):
        if isinstance(error.__cause__, OSError):  # refused, reset, unreachable: nothing answered
            return APIError(503, f"the main model is unreachable: {error}", type="upstream_error",
                            code="upstream_unavailable", headers=retry)
        return APIError(502, f"the main model failed: {error}", type="upstream_error", code="upstream_error")
    # The stack, and the message cut short: it may quote a request.
    stack = "".join(traceback.format_tb(error.__traceback__))
    logger.error("unexpected error in the gateway: %s: %s\n%s", type(error).__name__, excerpt(str(error)), stack)
    return APIError(500, f"internal error in the SpecPrefill gateway: {type(error).__name__}: {excerpt(str(error))}",
                    type="server_error", code="internal_error")


def new_id(kind: Kind) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(result: GenerationResult) -> dict[str, int]:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.generated_tokens,
        "total_tokens": result.prompt_tokens + result.generated_tokens,
    }


def extension(result: GenerationResult, prompt_shape: str) -> dict[str, Any]:
    """The ``specprefill`` object of a response: kept tokens per passage (and per document of a tool
    result), keep ratio, timings; the tool calls are in the message, not here."""
    facts = result.to_dict()
    facts.pop("tool_calls", None)
    return {"prompt_shape": prompt_shape, **facts}


def finish_reason(result: GenerationResult) -> str:
    if result.tool_calls:
        return "tool_calls"
    return "length" if result.finish_reason == "length" else "stop"


def arguments_text(call: ToolCall) -> str:
    return json.dumps(dict(call.arguments), ensure_ascii=False)  # OpenAI sends the arguments as JSON text


def message(result: GenerationResult) -> dict[str, Any]:
    """The assistant's message. When the request offered tools: the text outside the calls as
    ``content`` (null when the answer is calls only) and the calls as ``tool_calls``."""
    if result.content is None:
        return {"role": "assistant", "content": result.text}
    out: dict[str, Any] = {"role": "assistant", "content": result.content or (None if result.tool_calls else "")}
    if result.tool_calls:
        out["tool_calls"] = [{"id": call.id, "type": "function",
                              "function": {"name": call.name, "arguments": arguments_text(call)}}
                             for call in result.tool_calls]
    return out


def response(kind: Kind, rid: str, created: int, model: str, result: GenerationResult, shape: str
             ) -> dict[str, Any]:
    """The whole answer: a ``chat.completion`` or a ``text_completion``, with ``usage`` and the
    ``specprefill`` object."""
    if kind == "chat":
        choice: dict[str, Any] = {"index": 0, "message": message(result)}
    else:
        choice = {"index": 0, "text": result.text}
    choice.update(logprobs=None, finish_reason=finish_reason(result))
    return {
        "id": rid, "object": "chat.completion" if kind == "chat" else "text_completion", "created": created,
        "model": model, "system_fingerprint": None, "choices": [choice],
        "usage": usage(result), "specprefill": extension(result, shape),
    }


@dataclass(frozen=True)
class StreamChunks:
    """The streamed objects of one answer (``chat.completion.chunk`` or ``text_completion``)."""

    kind: Kind
    rid: str
    created: int
    model: str
    shape: str

    def _chunk(self, **fields: Any) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, **fields}

    def _choice(self, text: str | None, result: GenerationResult | None) -> dict[str, Any]:
        reason = finish_reason(result) if result is not None else None
        if self.kind == "chat":
            delta = {} if text is None else {"content": text}
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}

    def first(self) -> list[dict[str, Any]]:
        """What opens the stream: the assistant role, for a chat."""
        if self.kind != "chat":
            return []
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return [self._chunk(choices=[role])]

    def delta(self, text: str) -> dict[str, Any]:
        return self._chunk(choices=[self._choice(text, None)])

    def calls(self, result: GenerationResult) -> list[dict[str, Any]]:
        """A chat answer's tool calls, as OpenAI streams them: per call, a chunk with its ``index``,
        ``id``, ``type`` and name (arguments ""), then one with its arguments' JSON text."""
        chunks = []
        for index, call in enumerate(result.tool_calls):
            head: dict[str, Any] = {"index": index, "id": call.id, "type": "function",
                                    "function": {"name": call.name, "arguments": ""}}
            for part in (head, {"index": index, "function": {"arguments": arguments_text(call)}}):
                choice = {"index": 0, "delta": {"tool_calls": [part]}, "logprobs": None, "finish_reason": None}
                chunks.append(self._chunk(choices=[choice]))
        return chunks

    def last(self, result: GenerationResult) -> dict[str, Any]:
        """The finish reason, with the ``specprefill`` object."""
        return self._chunk(choices=[self._choice(None, result)], specprefill=extension(result, self.shape))

    def usage(self, result: GenerationResult) -> dict[str, Any]:
        """The usage chunk (``stream_options.include_usage``): no choices."""
        return self._chunk(choices=[], usage=usage(result))
