"""OpenAI tool calling at the gateway: ``tools``, ``tool_choice``, an assistant's ``tool_calls`` and
tool messages in a request; what of a streamed answer is shown while its calls are read.

Request side: ``parse_tools`` and the message checks (``tool_message``, ``assistant_calls``) refuse
a bad field with a 400 naming it; ``agent_segments`` builds the segments through
``prompt.message_segments``, as ``engine.chat`` does: the tool schemas, the assistant's calls and
the last user turn protected, each document of a tool result a prunable passage of its own.
``check_support`` refuses tools a model's chat template cannot render (never a dropped tool).

Answer side: the calls are parsed from the generated text by the engine (``toolcalls``) once the
answer is complete, and any failure is a ``ToolCallError`` with no call reported. ``toolcalls.CallText``
decides what a stream shows as content meanwhile: the text before the first call's opener, without
the white space around it, and once the answer is parsed, the rest of its content; so a streamed
answer's content equals the whole answer's ``message.content``. docs/gateway.md, "Tool calling".
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .. import toolcalls
from ..errors import InputError
from ..prompt import check_tool_support, message_segments, tool_schema
from ..schema_limits import SchemaChecker
from ..types import Passage, Segment, SegmentKind
from .fields import at_most, bad, check_json_depth, check_schema, check_strings, shown, unsupported, valid_text
from .messages import MAX_PARTS
from .responses import APIError

__all__ = [
    "ToolFields",
    "agent_segments",
    "assistant_calls",
    "check_support",
    "parse_tools",
    "tool_message",
]

_CHOICES = ("auto", "none", "required")
# OpenAI's rule for a function's name: what every chat template can print without escaping.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# A call's id may be printed by a chat template and is sent back: the characters of the ids OpenAI,
# LangChain, LlamaIndex and Anthropic write (base64 included), nothing a template reads as markup.
_CALL_ID = re.compile(r"^[A-Za-z0-9_.:+/=-]{1,128}$")
_BLANK_LINE = re.compile(r"\n[ \t]*\n")  # where prompt.split_tool_result cuts a text into documents
_NOT_BLANK = re.compile(r"\S")
_TOOL_KINDS = {SegmentKind.TOOL_SCHEMA, SegmentKind.TOOL_CALL, SegmentKind.TOOL_RESULT}


@dataclass(frozen=True)
class ToolFields:
    """A request's tool fields, checked: the tools offered (OpenAI function format), the engine's
    ``GenerationConfig.tool_choice`` and ``parallel_tool_calls``."""

    tools: tuple[dict[str, Any], ...] = ()
    choice: str = "auto"  # "auto", "none", "required" or the name of one of ``tools``
    parallel: bool = True  # False: at most one call (``GenerationConfig.parallel_tool_calls``)


# -- the request -----------------------------------------------------------------------------------


def parse_tools(body: Mapping[str, Any], checker: SchemaChecker | None = None) -> ToolFields:
    """``tools`` (functions only, unique names, valid Unicode throughout, parameters within the
    request's schema limits: ``checker``), ``tool_choice`` and ``parallel_tool_calls``; 400 naming
    the field."""
    checker = checker or SchemaChecker()
    raw = body.get("tools")
    raw = [] if raw is None else raw
    if not isinstance(raw, list):
        raise bad(f"tools must be a list of tools, got {shown(raw)}", param="tools")
    at_most(raw, "tools", "tools")
    offered: list[dict[str, Any]] = []
    names: set[str] = set()
    for n, tool in enumerate(raw):
        param = f"tools[{n}]"
        check_strings(tool, param)
        if isinstance(tool, dict) and tool.get("type", "function") != "function":
            raise unsupported(f"{param}.type", f"tools of type {shown(tool.get('type'))} (only 'function')")
        _check_parameters(tool, param, checker)
        try:
            schema = tool_schema(tool)
        except InputError as error:
            raise bad(f"{param}: {error}", param=param) from None
        name = schema["function"]["name"]
        if name in names:
            raise bad(f"{param}: two tools are named {name!r}; tool names must be unique", param=param)
        names.add(name)
        offered.append(schema)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad(f"parallel_tool_calls must be true or false, got {shown(parallel)}", param="parallel_tool_calls")
    return ToolFields(tuple(offered), _choice(body.get("tool_choice"), [t["function"]["name"] for t in offered]),
                      parallel is not False)


def _check_parameters(tool: object, param: str, checker: SchemaChecker) -> None:
    """A tool's parameters (where ``prompt.tool_schema`` reads them) within the schema limits."""
    function = tool.get("function", tool) if isinstance(tool, dict) else None
    parameters = function.get("parameters") if isinstance(function, dict) else None
    if isinstance(parameters, dict):
        where = f"{param}.function.parameters" if function is not tool else f"{param}.parameters"
        check_schema(checker, parameters, where)


def _choice(value: object, names: Sequence[str]) -> str:
    """OpenAI's ``tool_choice`` as the engine's: "auto", "none", "required" or a tool's name."""
    expected = "'auto', 'none', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}"
    if value is None:
        return "auto"
    function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    if isinstance(value, str) and value in _CHOICES:
        choice = value
    elif isinstance(function, dict):
        name = function.get("name")
        if not isinstance(name, str) or name not in names:
            raise bad(f"tool_choice names the function {shown(name)}, which is not among the tools "
                      f"{shown(list(names))}", param="tool_choice")
        if name in _CHOICES:
            raise bad(f"a tool named {name!r} cannot be chosen by name: rename it", param="tool_choice")
        choice = name
    else:
        raise bad(f"tool_choice must be {expected}, got {shown(value)}", param="tool_choice")
    if not names and choice == "required":
        raise bad("tool_choice 'required' is only allowed when tools are specified", param="tool_choice")
    return choice if names else "auto"


def _call_id(value: object, param: str) -> str:
    if not isinstance(value, str) or not _CALL_ID.match(value):
        raise bad(f"{param} must be 1 to 128 letters, digits or '_.:+/=-' (a call's id may be printed in the "
                  f"prompt), got {shown(value)}", param=param)
    return value


def _arguments(value: object, param: str) -> dict[str, Any]:
    """A call's arguments: a JSON object, or its JSON text (OpenAI's form); empty: no arguments."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(valid_text(value, param))
        except ValueError as error:
            raise bad(f"{param} is not JSON: {error}", param=param) from None
        except RecursionError:
            raise bad(f"{param} nests JSON arrays or objects too deeply", param=param) from None
    check_json_depth(value, param)  # JSON text is a root of its own: the body's depth does not bound it
    if not isinstance(value, dict):
        raise bad(f"{param} must be a JSON object (or its JSON text), got {shown(value)}", param=param)
    check_strings(value, param)  # JSON escapes may have written a lone surrogate
    return value


def assistant_calls(calls: object, n: int) -> list[dict[str, Any]]:
    """The ``tool_calls`` of the assistant message ``n``, checked: function calls with a valid name,
    id and arguments (a JSON object)."""
    param = f"messages[{n}].tool_calls"
    if not isinstance(calls, list):
        raise bad(f"{param} must be a list of tool calls, got {shown(calls)}", param=param)
    at_most(calls, param, "tool calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{param}[{j}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise bad(f"{at} must be an object with a 'function' object, got {shown(call)}", param=at)
        if call.get("type", "function") != "function":
            raise unsupported(f"{at}.type", f"tool calls of type {shown(call.get('type'))} (only 'function')")
        name = call["function"].get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad(f"{at}.function.name must be 1 to 64 letters, digits, '_' or '-', got {shown(name)}",
                      param=f"{at}.function.name")
        arguments = _arguments(call["function"].get("arguments"), f"{at}.function.arguments")
        entry: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
        if call.get("id") is not None:
            entry["id"] = _call_id(call["id"], f"{at}.id")
        out.append(entry)
    return out


def _too_many_documents(text: str) -> bool:
    """Whether ``prompt.split_tool_result`` would make more than ``MAX_PARTS`` documents of a tool's
    output (blank-line separated texts, or the items of a JSON array), counted without splitting and
    stopping past the limit: a megabyte of blank lines or commas must not become a million segments."""
    count, at = 0, 0
    for gap in _BLANK_LINE.finditer(text):
        count += _NOT_BLANK.search(text, at, gap.start()) is not None
        at = gap.end()
        if count > MAX_PARTS:
            return True
    stripped = text.strip()
    if not (stripped.startswith("[") and stripped.endswith("]")):
        return False
    decoder, at, count = json.JSONDecoder(), text.index("[") + 1, 0
    while count <= MAX_PARTS:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        if at >= len(text) or text[at] == "]":
            return False
        try:
            _, at = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            return False  # not a JSON array: its documents were counted as text
        count += 1
    return True


def tool_message(message: Mapping[str, Any], n: int, content: str) -> dict[str, Any]:
    """The fields of tool message ``n`` besides its role and ``content`` (its text parts joined by
    blank lines: a document each): the ``tool_call_id`` it answers."""
    if _too_many_documents(content):
        raise bad(f"messages[{n}].content holds more than the gateway's limit of {MAX_PARTS} documents (texts "
                  "separated by blank lines, or items of a JSON array): return fewer, longer documents",
                  param=f"messages[{n}].content")
    param = f"messages[{n}].tool_call_id"
    if message.get("tool_call_id") is None:
        raise bad(f"{param} is missing: a tool message answers the tool call of that id", param=param)
    return {"tool_call_id": _call_id(message["tool_call_id"], param)}


def agent_segments(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]],
                   passages: Sequence[Passage] | None, question: str | None) -> tuple[Segment, ...]:
    """The segments of a chat with tools or tool messages (``prompt.message_segments``): no shape is
    recognised in its messages; its documents are the tool results' (and ``specprefill.passages``)."""
    if question is not None:
        raise bad("specprefill.question cannot be used in a chat with tools or tool messages: the last user "
                  "message is the question, and the documents are the tool results'", param="specprefill.question")
    chat = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    try:
        return message_segments(chat, tools, passages or ())
    except InputError as error:
        raise bad(str(error), param="messages") from None


def check_support(segments: Sequence[Segment], tokenizer: Any) -> str | None:
    """The opener of the model's calls when ``segments`` offer tools (a stream holds text back from
    it), else None. 400 when the model's chat template cannot render the tools, calls or tool
    messages, or no parser reads its calls (``toolcalls.parser_for``)."""
    kinds = {s.kind for s in segments}
    if not kinds & _TOOL_KINDS:
        return None
    offered = SegmentKind.TOOL_SCHEMA in kinds
    try:
        check_tool_support(tokenizer, segments)
        return toolcalls.parser_for(tokenizer).opener if offered else None
    except InputError as error:
        raise APIError(400, f"tool calling is not supported by this model: {error}", param="tools" if offered
                       else "messages", code="unsupported_parameter") from None
