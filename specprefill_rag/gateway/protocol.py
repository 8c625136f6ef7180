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
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, get_args

from ..config import GenerationConfig, describe_choices
from ..errors import ConfigError
from ..types import RETRIEVER_SCORE_KEY, Passage, Segment, is_finite_number, is_int, lone_surrogate
from . import GatewayMode
from .messages import DEFAULT_SHAPES, MAX_PARTS, PromptShape, to_segments
from .responses import APIError, Kind

__all__ = ["GatewayRequest", "parse_chat", "parse_completion"]

_ROLES = {"system", "developer", "user", "assistant"}
_EXTENSION_KEYS = {"keep_rate", "mode", "passages", "question"}
# Values quoted in error messages: short, and shallow (a client's value may be megabytes, or
# nested thousands deep, which the built-in repr would recurse into).
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlist, _SHOWN.maxdict = 2, 60, 60, 4, 4


def _shown(value: object) -> str:
    return _SHOWN.repr(value)


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _unsupported(param: str, what: str) -> APIError:
    return _bad(f"{what} is not supported by the SpecPrefill gateway", param=param, code="unsupported_parameter")


def _text(value: str, param: str) -> str:
    """``value``, unless it holds a lone surrogate (JSON's unpaired ``"\\ud800"``): not valid
    Unicode, it cannot be tokenized nor sent back. Every string the gateway reads passes here."""
    at = lone_surrogate(value)
    if at is not None:
        raise _bad(f"{param} is not valid Unicode: a lone surrogate (U+{ord(value[at]):04X}) at character {at}",
                   param=param)
    return value


@dataclass(frozen=True)
class GatewayRequest:
    """One validated request: the segments to answer and how."""

    kind: Kind
    segments: tuple[Segment, ...]
    prompt_shape: str  # which documented layout the documents were recognised in ("chat": none)
    mode: GatewayMode
    keep_rate: float | None  # None: the engine's
    generation: GenerationConfig
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage


# -- field checks ----------------------------------------------------------------------------


def _number(body: Mapping[str, Any], name: str, low: float, high: float, *, low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not is_finite_number(value) or value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise _bad(f"{name} must be a number in {bracket}{low:g}, {high:g}], got {_shown(value)}", param=name)
    return float(value)


def _positive_int(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not is_int(value) or value < 1:
        raise _bad(f"{name} must be an integer >= 1, got {_shown(value)}", param=name)
    return int(value)


def _at_most(items: list[Any], param: str, what: str) -> None:
    if len(items) > MAX_PARTS:
        raise _bad(f"{param} holds {len(items)} {what}, more than the gateway's limit of {MAX_PARTS}", param=param)


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
    changes: dict[str, tuple[str, Any]] = {}  # GenerationConfig field -> (request field, value)
    for name in ("max_completion_tokens", "max_tokens"):
        max_tokens = _positive_int(body, name)
        if max_tokens is not None:
            changes["max_new_tokens"] = (name, max_tokens)
            break
    temperature = _number(body, "temperature", 0.0, 2.0)
    if temperature is not None:
        changes["temperature"] = ("temperature", temperature)
    top_p = _number(body, "top_p", 0.0, 1.0, low_open=True)
    if top_p is not None:
        changes["top_p"] = ("top_p", top_p)
    top_k = body.get("top_k")  # a vLLM extension; -1 or 0 means no filter
    if top_k is not None:
        if not is_int(top_k) or top_k < -1:
            raise _bad(f"top_k must be an integer >= -1, got {_shown(top_k)}", param="top_k")
        changes["top_k"] = ("top_k", max(int(top_k), 0))
    seed = body.get("seed")
    if seed is not None:
        if not is_int(seed):
            raise _bad(f"seed must be an integer, got {_shown(seed)}", param="seed")
        changes["seed"] = ("seed", int(seed))
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise _bad("stop must be a non-empty string or a list of non-empty strings", param="stop")
        changes["stop"] = ("stop", tuple(_text(s, "stop") for s in stops))
    salt = body.get("cache_salt")  # vLLM's field, on both endpoints: a prefix-cache namespace
    if salt is not None:
        if not isinstance(salt, str) or not salt:
            raise _bad(f"cache_salt must be a non-empty string if provided, got {_shown(salt)}", param="cache_salt")
        changes["cache_salt"] = ("cache_salt", _text(salt, "cache_salt"))
    config = defaults
    for field, (param, value) in changes.items():  # one at a time: a refusal names its field
        try:
            config = dataclasses.replace(config, **{field: value})
        except ConfigError as error:
            raise _bad(str(error), param=param) from None
    return config


def _stream_options(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad(f"stream must be true or false, got {_shown(stream)}", param="stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:  # as OpenAI and vLLM answer
        raise _bad("stream_options is only allowed when stream is true", param="stream_options")
    if not isinstance(options, dict):
        raise _bad("stream_options must be an object", param="stream_options")
    return stream, bool(options.get("include_usage"))


def _extension(body: Mapping[str, Any], default_mode: GatewayMode
               ) -> tuple[GatewayMode, float | None, list[Passage] | None, str | None]:
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
    if mode not in get_args(GatewayMode):
        raise _bad(f"specprefill.mode must be {describe_choices(GatewayMode)}, got {_shown(mode)}",
                   param="specprefill.mode", code="invalid_mode")
    keep_rate = ext.get("keep_rate")
    if keep_rate is not None and (not is_finite_number(keep_rate) or not 0 < keep_rate <= 1):
        raise _bad(f"specprefill.keep_rate must be a number in (0, 1], got {_shown(keep_rate)}",
                   param="specprefill.keep_rate")
    question = ext.get("question")
    if question is not None and (not isinstance(question, str) or not question.strip()):
        raise _bad("specprefill.question must be a non-empty string", param="specprefill.question")
    if question is not None:
        _text(question, "specprefill.question")
    raw = ext.get("passages")
    passages: list[Passage] | None = None
    if raw is not None:
        if not isinstance(raw, list):
            raise _bad("specprefill.passages must be a list", param="specprefill.passages")
        _at_most(raw, "specprefill.passages", "passages")
        passages = [_passage(item, n) for n, item in enumerate(raw)]
    return mode, None if keep_rate is None else float(keep_rate), passages, question


def _passage(item: object, n: int) -> Passage:
    param = f"specprefill.passages[{n}]"
    if isinstance(item, str):
        return Passage(_text(item, param))
    if isinstance(item, dict) and isinstance(item.get("text"), str):
        pid = item.get("id")
        metadata = item.get("metadata") or {}
        if pid is not None and not isinstance(pid, (str, int)):
            raise _bad(f"{param}.id must be a string", param=f"{param}.id")
        if not isinstance(metadata, dict):
            raise _bad(f"{param}.metadata must be an object", param=f"{param}.metadata")
        score = metadata.get(RETRIEVER_SCORE_KEY)  # the retriever's score, which selection weighs
        if score is not None and not is_finite_number(score):
            name = f"{param}.metadata.{RETRIEVER_SCORE_KEY}"
            raise _bad(f"{name} must be a finite number, got {_shown(score)}", param=name)
        pid = None if pid is None else _text(str(pid), f"{param}.id")
        return Passage(_text(item["text"], f"{param}.text"), id=pid, metadata=metadata)
    raise _bad(f"{param} must be a string or an object with a string 'text'", param=param)


def _content(message: Mapping[str, Any], n: int) -> str:
    param = f"messages[{n}].content"
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return _text(content, param)
    if not isinstance(content, list):
        raise _bad(f"{param} must be a string or a list of text parts", param=param)
    _at_most(content, param, "content parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise _bad(f"{param}[{j}] must be a content part object, got {_shown(part)}", param=f"{param}[{j}]")
        if part.get("type") != "text":
            raise _unsupported(param, f"content of type {_shown(part.get('type'))} (only text)")
        text = part.get("text")
        if not isinstance(text, str):
            raise _bad(f"{param}[{j}].text must be a string, got {_shown(text)}", param=f"{param}[{j}].text")
        texts.append(_text(text, f"{param}[{j}].text"))
    return "\n".join(texts)


def _turns(body: Mapping[str, Any]) -> list[tuple[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list", param="messages")
    _at_most(messages, "messages", "messages")
    turns = []
    for n, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(f"messages[{n}] must be an object", param=f"messages[{n}]")
        role = message.get("role")
        if role in ("tool", "function") or message.get("tool_calls") or message.get("function_call"):
            raise _unsupported(f"messages[{n}]", "tool and function calling")
        if not isinstance(role, str) or role not in _ROLES:  # a list or dict is no role (nor hashable)
            raise _bad(f"messages[{n}].role must be one of {sorted(_ROLES)}, got {_shown(role)}",
                       param=f"messages[{n}].role")
        turns.append((role, _content(message, n)))
    return turns


def _check_question(turns: list[tuple[str, str]]) -> None:
    """The last user message is the question: it must say something (before any shape is
    recognised in it, which would blame the documents)."""
    users = [n for n, (role, _) in enumerate(turns) if role == "user"]
    if not users:
        raise _bad("messages hold no user message: the last user message is the question", param="messages")
    n = users[-1]
    if not turns[n][1].strip():
        raise _bad(f"messages[{n}].content is empty: the last user message is the question",
                   param=f"messages[{n}].content")


def _prompt(body: Mapping[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not prompt:
            raise _bad("prompt is empty: send the prompt as a non-empty string", param="prompt")
        if all(isinstance(p, str) for p in prompt):
            raise _unsupported("prompt", "several prompts in one request")
        raise _unsupported("prompt", "a prompt given as token ids")
    if not isinstance(prompt, str) or not prompt.strip():
        raise _bad("prompt must be a non-empty string", param="prompt")
    return _text(prompt, "prompt")


def _parse(kind: Kind, body: Mapping[str, Any], turns: list[tuple[str, str]], defaults: GenerationConfig,
           default_mode: GatewayMode, shapes: tuple[PromptShape, ...]) -> GatewayRequest:
    _refuse_unsupported(body, kind)
    stream, include_usage = _stream_options(body)
    generation = _generation(body, defaults)
    mode, keep_rate, passages, question = _extension(body, default_mode)
    if question is None:
        _check_question(turns)
    segments, shape = to_segments(turns, passages=passages, question=question, shapes=shapes)
    return GatewayRequest(kind, segments, shape, mode, keep_rate, generation, stream, include_usage)


def parse_chat(body: Mapping[str, Any], defaults: GenerationConfig, default_mode: GatewayMode = "specprefill",
               shapes: tuple[PromptShape, ...] = DEFAULT_SHAPES) -> GatewayRequest:
    """A ``/v1/chat/completions`` body; ``APIError`` (400) or ``InputError`` when it cannot be served."""
    return _parse("chat", body, _turns(body), defaults, default_mode, shapes)


def parse_completion(body: Mapping[str, Any], defaults: GenerationConfig, default_mode: GatewayMode = "specprefill",
                     shapes: tuple[PromptShape, ...] = DEFAULT_SHAPES) -> GatewayRequest:
    """A ``/v1/completions`` body: the prompt is read as one user message."""
    return _parse("completion", body, [("user", _prompt(body))], defaults, default_mode, shapes)
