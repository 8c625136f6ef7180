"""OpenAI request bodies → ``GatewayRequest``: segments, mode, keep rate, generation settings.

Requests are read as plain JSON objects and checked field by field, so every refusal is an
OpenAI-shaped 400 naming the field (``param``). Fields the gateway cannot honour (``n > 1``,
tools, logprobs, penalties, ...) are refused rather than silently ignored; fields that change
nothing about the answer (``user``, ``metadata``, ``store``, ...) and unknown fields are ignored,
as vLLM does. No web framework here: ``app.py`` moves these dicts over HTTP; the answers'
shapes are in ``responses.py``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..config import GenerationConfig
from ..engine import Mode
from ..errors import ConfigError
from ..types import Passage, Segment
from .messages import DEFAULT_SHAPES, PromptShape, to_segments
from .responses import APIError, Kind

__all__ = ["GatewayRequest", "parse_chat", "parse_completion"]

_ROLES = {"system", "developer", "user", "assistant"}
_EXTENSION_KEYS = {"keep_rate", "mode", "passages", "question"}


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _unsupported(param: str, what: str) -> APIError:
    return _bad(f"{what} is not supported by the SpecPrefill gateway", param=param, code="unsupported_parameter")


@dataclass(frozen=True)
class GatewayRequest:
    """One validated request: the segments to answer and how."""

    kind: Kind
    segments: tuple[Segment, ...]
    prompt_shape: str  # which documented layout the documents were recognised in ("chat": none)
    mode: Mode
    keep_rate: float | None  # None: the engine's
    generation: GenerationConfig
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage


# -- field checks ----------------------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _number(body: Mapping[str, Any], name: str, low: float, high: float, *, low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_number(value) or value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise _bad(f"{name} must be a number in {bracket}{low:g}, {high:g}], got {value!r}", param=name)
    return float(value)


def _positive_int(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or value < 1:
        raise _bad(f"{name} must be an integer >= 1, got {value!r}", param=name)
    return int(value)


def _refuse_unsupported(body: Mapping[str, Any], kind: Kind) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise _unsupported("n", f"n={n!r} (several choices per request)")
    for name in ("tools", "functions"):
        if body.get(name):
            raise _unsupported(name, "tool and function calling")
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none"):
            raise _unsupported(name, "tool and function calling")
    if kind == "chat" and (body.get("logprobs") or body.get("top_logprobs")):
        raise _unsupported("logprobs", "logprobs")
    if kind == "completion" and body.get("logprobs") is not None:
        raise _unsupported("logprobs", "logprobs")
    if body.get("logit_bias"):
        raise _unsupported("logit_bias", "logit_bias")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise _unsupported(name, name)
    response_format = body.get("response_format")
    text_format = isinstance(response_format, dict) and response_format.get("type") == "text"
    if response_format is not None and not text_format:
        raise _unsupported("response_format", "response_format other than text")
    if body.get("audio") is not None or body.get("modalities") not in (None, ["text"]):
        raise _unsupported("modalities", "audio output")
    if body.get("prediction") is not None:
        raise _unsupported("prediction", "predicted outputs")
    if kind == "completion":
        if body.get("best_of") not in (None, 1):
            raise _unsupported("best_of", "best_of")
        if body.get("echo"):
            raise _unsupported("echo", "echo")
        if body.get("suffix"):
            raise _unsupported("suffix", "suffix")


def _generation(body: Mapping[str, Any], defaults: GenerationConfig) -> GenerationConfig:
    changes: dict[str, Any] = {}
    max_tokens = _positive_int(body, "max_completion_tokens") or _positive_int(body, "max_tokens")
    if max_tokens is not None:
        changes["max_new_tokens"] = max_tokens
    temperature = _number(body, "temperature", 0.0, 2.0)
    if temperature is not None:
        changes["temperature"] = temperature
    top_p = _number(body, "top_p", 0.0, 1.0, low_open=True)
    if top_p is not None:
        changes["top_p"] = top_p
    top_k = body.get("top_k")  # a vLLM extension; -1 or 0 means no filter
    if top_k is not None:
        if not _is_int(top_k) or top_k < -1:
            raise _bad(f"top_k must be an integer >= -1, got {top_k!r}", param="top_k")
        changes["top_k"] = max(int(top_k), 0)
    seed = body.get("seed")
    if seed is not None:
        if not _is_int(seed):
            raise _bad(f"seed must be an integer, got {seed!r}", param="seed")
        changes["seed"] = int(seed)
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise _bad("stop must be a non-empty string or a list of non-empty strings", param="stop")
        changes["stop"] = tuple(stops)
    try:
        return dataclasses.replace(defaults, **changes)
    except ConfigError as error:
        raise _bad(str(error)) from None


def _stream_options(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad(f"stream must be true or false, got {stream!r}", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("stream_options must be an object", param="stream_options")
    return stream, bool(options.get("include_usage")) and stream


def _extension(body: Mapping[str, Any], default_mode: Mode
               ) -> tuple[Mode, float | None, list[Passage] | None, str | None]:
    """The ``specprefill`` extension object: mode, keep rate, passages, question."""
    ext = body.get("specprefill")
    if ext is None:
        return default_mode, None, None, None
    if not isinstance(ext, dict):
        raise _bad("specprefill must be an object", param="specprefill")
    unknown = sorted(set(ext) - _EXTENSION_KEYS)
    if unknown:
        raise _bad(f"unknown specprefill field(s) {unknown}; known: {sorted(_EXTENSION_KEYS)}", param="specprefill")
    mode = ext.get("mode", default_mode)
    if mode not in ("full", "specprefill"):
        raise _bad(f"specprefill.mode must be 'full' or 'specprefill', got {mode!r}", param="specprefill.mode")
    keep_rate = ext.get("keep_rate")
    if keep_rate is not None and (not _is_number(keep_rate) or not 0 < keep_rate <= 1):
        raise _bad(f"specprefill.keep_rate must be a number in (0, 1], got {keep_rate!r}",
                   param="specprefill.keep_rate")
    question = ext.get("question")
    if question is not None and (not isinstance(question, str) or not question.strip()):
        raise _bad("specprefill.question must be a non-empty string", param="specprefill.question")
    raw = ext.get("passages")
    passages: list[Passage] | None = None
    if raw is not None:
        if not isinstance(raw, list):
            raise _bad("specprefill.passages must be a list", param="specprefill.passages")
        passages = [_passage(item, n) for n, item in enumerate(raw)]
    return mode, None if keep_rate is None else float(keep_rate), passages, question


def _passage(item: object, n: int) -> Passage:
    param = f"specprefill.passages[{n}]"
    if isinstance(item, str):
        return Passage(item)
    if isinstance(item, dict) and isinstance(item.get("text"), str):
        pid = item.get("id")
        metadata = item.get("metadata") or {}
        if pid is not None and not isinstance(pid, (str, int)):
            raise _bad(f"{param}.id must be a string", param=param)
        if not isinstance(metadata, dict):
            raise _bad(f"{param}.metadata must be an object", param=param)
        return Passage(item["text"], id=None if pid is None else str(pid), metadata=metadata)
    raise _bad(f"{param} must be a string or an object with a string 'text'", param=param)


def _content(message: Mapping[str, Any], n: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _unsupported(f"messages[{n}].content", f"content of type {kind!r} (only text)")
            texts.append(part["text"])
        return "\n".join(texts)
    raise _bad(f"messages[{n}].content must be a string or a list of text parts", param=f"messages[{n}].content")


def _turns(body: Mapping[str, Any]) -> list[tuple[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list", param="messages")
    turns = []
    for n, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(f"messages[{n}] must be an object", param=f"messages[{n}]")
        role = message.get("role")
        if role in ("tool", "function") or message.get("tool_calls") or message.get("function_call"):
            raise _unsupported(f"messages[{n}]", "tool and function calling")
        if role not in _ROLES:
            raise _bad(f"messages[{n}].role must be one of {sorted(_ROLES)}, got {role!r}", param=f"messages[{n}].role")
        turns.append((str(role), _content(message, n)))
    return turns


def _prompt(body: Mapping[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        if prompt and all(isinstance(p, str) for p in prompt):
            raise _unsupported("prompt", "several prompts in one request")
        raise _unsupported("prompt", "a prompt given as token ids")
    if not isinstance(prompt, str) or not prompt.strip():
        raise _bad("prompt must be a non-empty string", param="prompt")
    return prompt


def _parse(kind: Kind, body: Mapping[str, Any], turns: list[tuple[str, str]], defaults: GenerationConfig,
           default_mode: Mode, shapes: tuple[PromptShape, ...]) -> GatewayRequest:
    _refuse_unsupported(body, kind)
    stream, include_usage = _stream_options(body)
    generation = _generation(body, defaults)
    mode, keep_rate, passages, question = _extension(body, default_mode)
    segments, shape = to_segments(turns, passages=passages, question=question, shapes=shapes)
    return GatewayRequest(kind, segments, shape, mode, keep_rate, generation, stream, include_usage)


def parse_chat(body: Mapping[str, Any], defaults: GenerationConfig, default_mode: Mode = "specprefill",
               shapes: tuple[PromptShape, ...] = DEFAULT_SHAPES) -> GatewayRequest:
    """A ``/v1/chat/completions`` body; ``APIError`` (400) or ``InputError`` when it cannot be served."""
    return _parse("chat", body, _turns(body), defaults, default_mode, shapes)


def parse_completion(body: Mapping[str, Any], defaults: GenerationConfig, default_mode: Mode = "specprefill",
                     shapes: tuple[PromptShape, ...] = DEFAULT_SHAPES) -> GatewayRequest:
    """A ``/v1/completions`` body: the prompt is read as one user message."""
    return _parse("completion", body, [("user", _prompt(body))], defaults, default_mode, shapes)
