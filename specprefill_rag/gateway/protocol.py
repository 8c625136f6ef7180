"""OpenAI request bodies → ``GatewayRequest``: segments, mode, keep rate, generation settings.

Requests are read as plain JSON objects and checked field by field, so every refusal is an
OpenAI-shaped 400 naming the field (``param``); the body's JSON depth and its schemas (the
``response_format``'s, the tools' parameters) are held to ``schema_limits`` first. Fields the
gateway cannot honour (``n > 1``, logprobs, penalties, ...) are refused rather than silently
ignored; a JSON ``response_format`` (``json_schema`` or ``json_object``) becomes the grammar the
answer is decoded under; fields that change nothing about the answer (``user``, ``metadata``,
``store``, ...) and unknown fields are ignored, as vLLM does. Tools, ``tool_choice``, an
assistant's ``tool_calls`` and tool messages are read by ``tools``. No web framework here:
``app.py`` moves these dicts over HTTP; the answers' shapes are in ``responses.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, get_args

from ..config import GenerationConfig, describe_choices
from ..errors import ConfigError
from ..grammar import json_grammar
from ..prompt import has_tool_messages
from ..schema_limits import SchemaChecker
from ..types import RETRIEVER_SCORE_KEY, Passage, Segment, is_finite_number, is_int
from . import GatewayMode, tools
from .fields import at_most, bad, check_json_depth, check_schema, check_strings, shown, unsupported, valid_text
from .messages import DEFAULT_SHAPES, PromptShape, to_segments
from .responses import Kind

__all__ = ["GatewayRequest", "parse_chat", "parse_completion", "passage_item"]

_ROLES = {"system", "developer", "user", "assistant", "tool"}
_EXTENSION_KEYS = {"keep_rate", "mode", "passages", "question"}


@dataclass(frozen=True)
class GatewayRequest:
    """One validated request: the segments to answer and how."""

    kind: Kind
    segments: tuple[Segment, ...]
    prompt_shape: str  # which documented layout the documents were recognised in ("chat": none; "tools")
    mode: GatewayMode
    keep_rate: float | None  # None: the engine's
    generation: GenerationConfig  # its tool_choice, parallel_tool_calls and grammar: the request's
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    # The text that opens the model's tool calls when the request offers tools (a stream shows no text
    # from it on), set by the gateway once it knows the model (``tools.check_support``); None: no tools.
    call_opener: str | None = None


# -- field checks ----------------------------------------------------------------------------


def _number(body: Mapping[str, Any], name: str, low: float, high: float, *, low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not is_finite_number(value) or value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise bad(f"{name} must be a number in {bracket}{low:g}, {high:g}], got {shown(value)}", param=name)
    return float(value)


def _positive_int(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not is_int(value) or value < 1:
        raise bad(f"{name} must be an integer >= 1, got {shown(value)}", param=name)
    return int(value)


_LEGACY = "the legacy function-calling API (functions, function_call, function messages: send tools and tool_choice)"


def _refuse_unsupported(body: Mapping[str, Any], kind: Kind) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise unsupported("n", f"n={shown(n)} (several choices per request)")
    if body.get("functions"):
        raise unsupported("functions", _LEGACY)
    if body.get("function_call") not in (None, "none"):
        raise unsupported("function_call", _LEGACY)
    if kind == "completion" and (body.get("tools") or body.get("tool_choice") not in (None, "none", "auto")):
        raise unsupported("tools", "tool calling in /v1/completions (send it to /v1/chat/completions)")
    if kind == "chat" and (body.get("logprobs") or body.get("top_logprobs")):
        raise unsupported("logprobs", "logprobs")
    if kind == "completion" and body.get("logprobs") is not None:
        raise unsupported("logprobs", "logprobs")
    if body.get("logit_bias"):
        raise unsupported("logit_bias", "logit_bias")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise unsupported(name, name)
    if body.get("audio") is not None or body.get("modalities") not in (None, ["text"]):
        raise unsupported("modalities", "audio output")
    if body.get("prediction") is not None:
        raise unsupported("prediction", "predicted outputs")
    if kind == "completion":
        if body.get("best_of") not in (None, 1):
            raise unsupported("best_of", "best_of")
        if body.get("echo"):
            raise unsupported("echo", "echo")
        if body.get("suffix"):
            raise unsupported("suffix", "suffix")


def _response_format(response_format: object, checker: SchemaChecker) -> str | None:
    """The grammar of a ``response_format``: None for text, JSON for ``json_object``, JSON under
    ``json_schema.schema`` for ``json_schema`` (decoded under it, then valid by construction), the
    schema within the request's limits (``checker``)."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json_grammar({"type": "object"})
    if kind != "json_schema":
        raise unsupported("response_format", f"response_format of type {shown(kind)} (text, json_object or "
                          "json_schema)")
    assert isinstance(response_format, dict)
    spec = response_format.get("json_schema")
    schema = spec.get("schema", {}) if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise bad(f"response_format.json_schema.schema must be a JSON schema object, got {shown(schema)}",
                  param="response_format")
    check_strings(schema, "response_format")
    check_schema(checker, schema, "response_format.json_schema.schema")
    return json_grammar(schema, checked=True)


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
            raise bad(f"top_k must be an integer >= -1, got {shown(top_k)}", param="top_k")
        changes["top_k"] = ("top_k", max(int(top_k), 0))
    seed = body.get("seed")
    if seed is not None:
        if not is_int(seed):
            raise bad(f"seed must be an integer, got {shown(seed)}", param="seed")
        changes["seed"] = ("seed", int(seed))
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise bad("stop must be a non-empty string or a list of non-empty strings", param="stop")
        changes["stop"] = ("stop", tuple(valid_text(s, "stop") for s in stops))
    salt = body.get("cache_salt")  # vLLM's field, on both endpoints: a prefix-cache namespace
    if salt is not None:
        if not isinstance(salt, str) or not salt:
            raise bad(f"cache_salt must be a non-empty string if provided, got {shown(salt)}", param="cache_salt")
        changes["cache_salt"] = ("cache_salt", valid_text(salt, "cache_salt"))
    config = defaults
    for field, (param, value) in changes.items():  # one at a time: a refusal names its field
        try:
            config = dataclasses.replace(config, **{field: value})
        except ConfigError as error:
            raise bad(str(error), param=param) from None
    return config


def _stream_options(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad(f"stream must be true or false, got {shown(stream)}", param="stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:  # as OpenAI and vLLM answer
        raise bad("stream_options is only allowed when stream is true", param="stream_options")
    if not isinstance(options, dict):
        raise bad("stream_options must be an object", param="stream_options")
    return stream, bool(options.get("include_usage"))


def _extension(body: Mapping[str, Any], default_mode: GatewayMode
               ) -> tuple[GatewayMode, float | None, list[Passage] | None, str | None]:
    """The ``specprefill`` extension object: mode, keep rate, passages, question."""
    ext = body.get("specprefill")
    if ext is None:
        return default_mode, None, None, None
    if not isinstance(ext, dict):
        raise bad("specprefill must be an object", param="specprefill")
    unknown = sorted(set(ext) - _EXTENSION_KEYS)
    if unknown:
        raise bad(f"unknown specprefill field(s) {unknown}; known: {sorted(_EXTENSION_KEYS)}", param="specprefill")
    mode = ext.get("mode", default_mode)
    if mode not in get_args(GatewayMode):
        raise bad(f"specprefill.mode must be {describe_choices(GatewayMode)}, got {shown(mode)}",
                  param="specprefill.mode", code="invalid_mode")
    keep_rate = ext.get("keep_rate")
    if keep_rate is not None and (not is_finite_number(keep_rate) or not 0 < keep_rate <= 1):
        raise bad(f"specprefill.keep_rate must be a number in (0, 1], got {shown(keep_rate)}",
                   param="specprefill.keep_rate")
    question = ext.get("question")
    if question is not None and (not isinstance(question, str) or not question.strip()):
        raise bad("specprefill.question must be a non-empty string", param="specprefill.question")
    if question is not None:
        valid_text(question, "specprefill.question")
    raw = ext.get("passages")
    passages: list[Passage] | None = None
    if raw is not None:
        if not isinstance(raw, list):
            raise bad("specprefill.passages must be a list", param="specprefill.passages")
        at_most(raw, "specprefill.passages", "passages")
        passages = [passage_item(item, f"specprefill.passages[{n}]") for n, item in enumerate(raw)]
    return mode, None if keep_rate is None else float(keep_rate), passages, question


def passage_item(item: object, param: str) -> Passage:
    """One passage a client sent at ``param``: a string, or an object with a string ``text``, an
    optional ``id`` (a string or an integer) and ``metadata`` (the retriever's score, checked)."""
    if isinstance(item, str):
        return Passage(valid_text(item, param))
    if isinstance(item, dict) and isinstance(item.get("text"), str):
        pid = item.get("id")
        metadata = item.get("metadata") or {}
        if pid is not None and (isinstance(pid, bool) or not isinstance(pid, (str, int))):
            raise bad(f"{param}.id must be a string, got {shown(pid)}", param=f"{param}.id")
        if not isinstance(metadata, dict):
            raise bad(f"{param}.metadata must be an object", param=f"{param}.metadata")
        score = metadata.get(RETRIEVER_SCORE_KEY)  # the retriever's score, which selection weighs
        if score is not None and not is_finite_number(score):
            name = f"{param}.metadata.{RETRIEVER_SCORE_KEY}"
            raise bad(f"{name} must be a finite number, got {shown(score)}", param=name)
        pid = None if pid is None else valid_text(str(pid), f"{param}.id")
        return Passage(valid_text(item["text"], f"{param}.text"), id=pid, metadata=metadata)
    raise bad(f"{param} must be a string or an object with a string 'text'", param=param)


def _content(message: Mapping[str, Any], n: int, joiner: str = "\n") -> str:
    param = f"messages[{n}].content"
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return valid_text(content, param)
    if not isinstance(content, list):
        raise bad(f"{param} must be a string or a list of text parts", param=param)
    at_most(content, param, "content parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise bad(f"{param}[{j}] must be a content part object, got {shown(part)}", param=f"{param}[{j}]")
        if part.get("type") != "text":
            raise unsupported(param, f"content of type {shown(part.get('type'))} (only text)")
        text = part.get("text")
        if not isinstance(text, str):
            raise bad(f"{param}[{j}].text must be a string, got {shown(text)}", param=f"{param}[{j}].text")
        texts.append(valid_text(text, f"{param}[{j}].text"))
    return joiner.join(texts)


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The messages, checked: a role, text content, an assistant's ``tool_calls`` and a tool
    message's ``tool_call_id`` (``tools``). A tool message's text parts are documents: joined by
    blank lines."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", param="messages")
    at_most(messages, "messages", "messages")
    out = []
    for n, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad(f"messages[{n}] must be an object", param=f"messages[{n}]")
        role = message.get("role")
        if role == "function" or message.get("function_call"):
            raise unsupported(f"messages[{n}]", _LEGACY)
        if not isinstance(role, str) or role not in _ROLES:  # a list or dict is no role (nor hashable)
            raise bad(f"messages[{n}].role must be one of {sorted(_ROLES)}, got {shown(role)}",
                      param=f"messages[{n}].role")
        entry: dict[str, Any] = {"role": role, "content": _content(message, n, "\n\n" if role == "tool" else "\n")}
        if role == "tool":
            entry.update(tools.tool_message(message, n, entry["content"]))
        elif message.get("tool_calls"):
            if role != "assistant":
                raise bad(f"messages[{n}] is a {role} message: only an assistant message makes tool calls",
                          param=f"messages[{n}].tool_calls")
            entry["tool_calls"] = tools.assistant_calls(message["tool_calls"], n)
        out.append(entry)
    return out


def _check_question(turns: list[tuple[str, str]]) -> None:
    """The last user message is the question: it must say something (before any shape is
    recognised in it, which would blame the documents)."""
    users = [n for n, (role, _) in enumerate(turns) if role == "user"]
    if not users:
        raise bad("messages hold no user message: the last user message is the question", param="messages")
    n = users[-1]
    if not turns[n][1].strip():
        raise bad(f"messages[{n}].content is empty: the last user message is the question",
                   param=f"messages[{n}].content")


def _prompt(body: Mapping[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not prompt:
            raise bad("prompt is empty: send the prompt as a non-empty string", param="prompt")
        if all(isinstance(p, str) for p in prompt):
            raise unsupported("prompt", "several prompts in one request")
        raise unsupported("prompt", "a prompt given as token ids")
    if not isinstance(prompt, str) or not prompt.strip():
        raise bad("prompt must be a non-empty string", param="prompt")
    return valid_text(prompt, "prompt")


def _parse(kind: Kind, body: Mapping[str, Any], messages: list[dict[str, Any]], defaults: GenerationConfig,
           default_mode: GatewayMode, shapes: tuple[PromptShape, ...]) -> GatewayRequest:
    _refuse_unsupported(body, kind)
    stream, include_usage = _stream_options(body)
    generation = _generation(body, defaults)
    mode, keep_rate, passages, question = _extension(body, default_mode)
    checker = SchemaChecker()  # the schema limits over all of this request's schemas
    offered = tools.parse_tools(body, checker)
    turns = [(m["role"], m["content"]) for m in messages]
    if question is None:
        _check_question(turns)
    if offered.tools or has_tool_messages(messages):
        if mode == "text":  # the upstream would render tools with its own template: not built yet
            raise bad('text mode does not carry tools or tool messages yet: send them with specprefill.mode '
                      '"specprefill" or "full"', param="specprefill.mode", code="unsupported_parameter")
        segments, shape = tools.agent_segments(messages, offered.tools, passages, question), "tools"
    else:
        segments, shape = to_segments(turns, passages=passages, question=question, shapes=shapes)
    grammar = _response_format(body.get("response_format"), checker)
    if grammar is not None and mode == "text":
        raise bad('text mode does not carry response_format yet: send it with specprefill.mode "specprefill" or '
                  '"full"', param="specprefill.mode", code="unsupported_parameter")
    generation = dataclasses.replace(generation, tool_choice=offered.choice, grammar=grammar,
                                     parallel_tool_calls=offered.parallel)
    return GatewayRequest(kind, segments, shape, mode, keep_rate, generation, stream, include_usage)


def parse_chat(body: Mapping[str, Any], defaults: GenerationConfig, default_mode: GatewayMode = "specprefill",
               shapes: tuple[PromptShape, ...] = DEFAULT_SHAPES) -> GatewayRequest:
    """A ``/v1/chat/completions`` body; ``APIError`` (400) or ``InputError`` when it cannot be served."""
    check_json_depth(body, "")
    return _parse("chat", body, _messages(body), defaults, default_mode, shapes)


def parse_completion(body: Mapping[str, Any], defaults: GenerationConfig, default_mode: GatewayMode = "specprefill",
                     shapes: tuple[PromptShape, ...] = DEFAULT_SHAPES) -> GatewayRequest:
    """A ``/v1/completions`` body: the prompt is read as one user message."""
    check_json_depth(body, "")
    return _parse("completion", body, [{"role": "user", "content": _prompt(body)}], defaults, default_mode, shapes)
