"""Agent chats → segments: tool schemas, the assistant's tool calls and tool results.

An agent chat is a list of OpenAI-style messages (``role``, ``content``, an assistant's
``tool_calls``, a tool message's ``tool_call_id``) and the tools offered (OpenAI function format).
``message_segments`` builds, in the chat's order:

* ``TOOL_SCHEMA``: one protected segment per tool, its text the JSON the chat template's
  ``tojson`` writes (so the rendered schema is the segment's text, and client text in it is
  never read as special tokens);
* ``HISTORY`` / ``QUESTION``: user and assistant text as in ``chat_segments``; the last user
  turn is the protected question and keeps its place (the calls and results after it follow it);
* ``TOOL_CALL``: one protected segment per call, its text the arguments' JSON, the tool's name
  in ``metadata["name"]``;
* ``TOOL_RESULT``: a tool message's content, one prunable segment per document (documents
  joined by blank lines, LangChain's retriever tool and LlamaIndex's node text; the items of a
  JSON array; the documents a client hands in with the message), each with its own id. JSON
  items and code blocks are *atomic*: kept or dropped whole, never cut inside.

Segments of one chat message share ``metadata["message"]`` (the message's index); the text
between a tool message's documents is kept in ``metadata["lead"]`` (before each) and
``metadata["tail"]`` (after the last), so the rendered content is exactly the tool's output.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import InputError, InputTypeError
from ..types import Passage, Segment, SegmentKind
from .segments import MAX_SEGMENTS, Passages, _question, chat_segments, passage_segments

__all__ = [
    "count_documents",
    "echoed_question",
    "has_tool_messages",
    "message_segments",
    "split_tool_result",
    "tool_call_segments",
    "tool_schema",
    "tool_schema_segments",
]

# OpenAI's rule for a function's name: what every chat template can print without escaping.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_BLANK_LINE = re.compile(r"\n[ \t]*\n")
_NOT_BLANK = re.compile(r"\S")
_WHITESPACE = re.compile(r"[ \t\r\n]*")  # JSON's white space
_FENCE = "```"
# A tool's output is read as JSON (items, or one value) only when it holds at most this many commas,
# colons and brackets, which bound the values decoding builds: megabytes of "{}," would otherwise
# become millions of dicts (+200 MB for 8 MB) just to learn they are JSON. Beyond it (far past what
# a context window holds) the output is documents of text.
_MAX_JSON_VALUES = 4 * MAX_SEGMENTS


def _name(name: object, what: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise InputError(f"{what} must be 1 to 64 letters, digits, '_' or '-', got {name!r:.80}")
    return name


def _json_text(value: object, what: str) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)  # what the chat templates' ``tojson`` writes
    except (TypeError, ValueError) as error:
        raise InputTypeError(f"{what} must be JSON data: {error}") from None


def tool_schema(tool: object) -> dict[str, Any]:
    """A tool in OpenAI's function format (``{"type": "function", "function": {...}}``); a bare
    ``{"name", "description", "parameters"}`` is wrapped. The parameters must be a JSON-schema object."""
    if not isinstance(tool, Mapping):
        raise InputTypeError(f"a tool must be a dict in OpenAI's function format, got {type(tool).__name__}")
    function = tool.get("function", tool) if tool.get("type", "function") == "function" else None
    if not isinstance(function, Mapping):
        raise InputError(f"only tools of type 'function' are supported, got {tool.get('type')!r:.40}")
    name = _name(function.get("name"), "a tool's name")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, Mapping) or parameters.get("type", "object") != "object":
        raise InputError(f"tool {name!r}: parameters must be a JSON schema of type 'object'")
    out: dict[str, Any] = {"name": name}
    if function.get("description") is not None:
        out["description"] = str(function["description"])
    out["parameters"] = dict(parameters)
    return {"type": "function", "function": out}


def tool_schema_segments(tools: Sequence[object]) -> list[Segment]:
    """One protected ``TOOL_SCHEMA`` segment per tool (id: the tool's name; names must be unique)."""
    segments: list[Segment] = []
    for tool in tools:
        schema = tool_schema(tool)
        name = schema["function"]["name"]
        if any(s.id == name for s in segments):
            raise InputError(f"two tools are named {name!r}: tool names must be unique")
        segments.append(Segment(SegmentKind.TOOL_SCHEMA, _json_text(schema, f"tool {name!r}"), name))
    return segments


def tool_call_segments(calls: Sequence[object], message: int) -> list[Segment]:
    """One protected ``TOOL_CALL`` segment per call of the assistant message ``message``: a call is
    ``{"id", "name", "arguments"}`` or OpenAI's ``{"id", "function": {"name", "arguments"}}``, its
    arguments a JSON object (or its JSON text)."""
    segments = []
    for n, call in enumerate(calls):
        if not isinstance(call, Mapping):
            raise InputTypeError(f"tool call {n} must be a dict, got {type(call).__name__}")
        function = call.get("function", call)
        if not isinstance(function, Mapping):
            raise InputTypeError(f"tool call {n}: 'function' must be a dict")
        name = _name(function.get("name"), f"tool call {n}'s name")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as error:
                raise InputError(f"tool call {n} ({name}): arguments are not JSON: {error}") from None
        if not isinstance(arguments, Mapping):
            raise InputError(f"tool call {n} ({name}): arguments must be a JSON object")
        call_id = call.get("id")
        metadata = {"message": message, "name": name}
        text = _json_text(dict(arguments), f"tool call {n}'s arguments")
        segments.append(Segment(SegmentKind.TOOL_CALL, text, str(call_id) if call_id else None, metadata))
    return segments


def _skip_space(text: str, at: int) -> int:
    found = _WHITESPACE.match(text, at)  # matches always (maybe nothing)
    return found.end() if found is not None else at


class _TooMany(InputError):
    """More documents than a limit: ``message_segments`` names its own limit instead."""


def _json_items(text: str, limit: int | None = None) -> list[tuple[int, int]] | None:
    """[start, end) of each item of the JSON array ``text``, or None if it is not one. Read item by
    item (one item built at a time, then dropped); with ``limit``, reading stops at ``limit + 1``
    items (too many, whatever follows)."""
    stripped = text.strip()
    if not (stripped.startswith("[") and stripped.endswith("]")):
        return None
    decoder = json.JSONDecoder()
    items: list[tuple[int, int]] = []
    at = _skip_space(text, text.index("[") + 1)
    if text.startswith("]", at):
        return items if not text[at + 1:].strip() else None
    while limit is None or len(items) <= limit:
        try:
            _, end = decoder.raw_decode(text, at)
        except (json.JSONDecodeError, RecursionError):
            return None
        items.append((at, end))
        at = _skip_space(text, end)
        if text.startswith("]", at):
            return items if not text[at + 1:].strip() else None
        if not text.startswith(",", at):
            return None
        at = _skip_space(text, at + 1)
    return items


def _text_documents(text: str, limit: int | None) -> list[tuple[int, int]]:
    """[start, end) of each document of ``text`` joined by blank lines (white space around it
    left out), found one at a time: at most ``limit + 1`` of them."""
    bounds: list[tuple[int, int]] = []
    at = 0
    for gap in itertools.chain(_BLANK_LINE.finditer(text), [None]):
        end = len(text) if gap is None else gap.start()
        first = _NOT_BLANK.search(text, at, end)
        if first is not None:
            bounds.append((first.start(), at + len(text[at:end].rstrip())))
            if limit is not None and len(bounds) > limit:
                break
        at = len(text) if gap is None else gap.end()
    return bounds


def _document_bounds(text: str, limit: int | None) -> tuple[list[tuple[int, int]], list[bool]]:
    """The documents of a tool's output (``split_tool_result``) as [start, end) bounds and whether
    each is atomic; with ``limit``, at most ``limit + 1`` of them are found (then: too many). JSON
    that would decode into more than ``_MAX_JSON_VALUES`` values is read as text: never built."""
    decodable = sum(text.count(mark) for mark in ",:[{") <= _MAX_JSON_VALUES
    bounds = _json_items(text, limit) if decodable else None
    if bounds is not None:
        return bounds, [True] * len(bounds)
    try:
        if decodable:
            json.loads(text)
            stripped = text.strip()
            if stripped:
                start = text.index(stripped)
                return [(start, start + len(stripped))], [True]
    except (json.JSONDecodeError, RecursionError):
        pass
    bounds = _text_documents(text, limit)
    return bounds, [_FENCE in text[a:b] for a, b in bounds]


def count_documents(text: str, limit: int) -> int:
    """How many documents ``split_tool_result`` makes of ``text``, counted up to ``limit + 1``
    (one past: too many) without building them: a text of a million blank lines or JSON items
    costs time linear in its length and holds ``limit`` bounds at most."""
    return len(_document_bounds(text, limit)[0])


def split_tool_result(text: str, limit: int | None = None) -> tuple[list[tuple[str, str, bool]], str]:
    """A tool's output as (lead, item, atomic) triples and a tail, ``"".join(lead + item) + tail``
    being ``text``: the items of a JSON array (atomic); a JSON object or value alone (one atomic
    item); else documents joined by blank lines, a document holding a code fence atomic.

    ``limit``: more documents than this is an ``InputError``, found before any is built."""
    bounds, atomic = _document_bounds(text, limit)
    if limit is not None and len(bounds) > limit:
        raise _TooMany(f"a tool result holds more than {limit} documents (texts separated by blank lines, or "
                       "items of a JSON array): return fewer, longer documents")
    items: list[tuple[str, str, bool]] = []
    at = 0
    for (a, b), whole in zip(bounds, atomic, strict=True):
        items.append((text[at:a], text[a:b], whole))
        at = b
    return items, text[at:]


def _result_segments(content: str, message: int, call_id: str | None, documents: Sequence[Passage] | None,
                     limit: int | None = None) -> list[Segment]:
    """The ``TOOL_RESULT`` segments of one tool message (one per document; ids ``<call id>:<n>``, or
    the documents' own ids when the client handed them in and ``content`` is their blank-line join);
    more than ``limit`` of them is an ``InputError`` raised before they are built."""
    base = call_id or f"turn-{message}"
    if documents and content == "\n\n".join(d.text for d in documents):
        if limit is not None and len(documents) > limit:
            raise _TooMany(f"a tool result holds more than {limit} documents: return fewer, longer documents")
        items = [("" if n == 0 else "\n\n", d.text, False) for n, d in enumerate(documents)]
        ids = [d.id or f"{base}:{n}" for n, d in enumerate(documents, start=1)]
        tail = ""
    else:
        items, tail = split_tool_result(content, limit)
        ids = [f"{base}:{n}" for n in range(1, len(items) + 1)]
    if not items:
        items, ids = [("", "", False)], [f"{base}:1"]
        tail = content
    segments = []
    for n, ((lead, text, atomic), pid) in enumerate(zip(items, ids, strict=True)):
        metadata = {"message": message, "lead": lead, "tail": tail if n == len(items) - 1 else "",
                    "atomic": atomic, "tool_call_id": call_id}
        segments.append(Segment(SegmentKind.TOOL_RESULT, text, pid, metadata))
    return segments


def has_tool_messages(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a chat holds a tool message or an assistant's tool calls."""
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def _content(message: Mapping[str, Any], n: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if not isinstance(content, str):
        raise InputTypeError(f"message {n}'s content must be a str, got {type(content).__name__}")
    return content


def message_segments(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[object] = (),
    passages: Passages = (),
    *,
    instructions: str | None = None,
    max_segments: int | None = MAX_SEGMENTS,
) -> tuple[Segment, ...]:
    """Segments of an agent chat (the module docstring), oldest message first. A chat without
    tools, tool calls or tool messages is ``chat_segments``' (the same segments, the same prompt).
    A tool message may carry ``documents``: the ``Passage`` list its content was joined from.

    ``max_segments``: more segments in all is an ``InputError``, raised as soon as a message's
    documents or calls pass it, before they are built (None: no limit)."""
    for n, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise InputTypeError(f"message {n} must be a dict with a 'role', got {message!r:.80}")
    if not tools and not has_tool_messages(messages):
        return chat_segments([(m["role"], _content(m, n)) for n, m in enumerate(messages)], passages,
                             instructions=instructions)
    system = [_content(m, n).strip() for n, m in enumerate(messages) if m["role"] == "system"]
    users = [n for n, m in enumerate(messages) if m["role"] in ("user", "human")]
    if not users:
        raise InputError("an agent chat needs a user message: the question the tools serve")
    segments: list[Segment] = []
    joined = "\n\n".join(s for s in system if s) or instructions
    if joined:
        segments.append(Segment(SegmentKind.INSTRUCTIONS, joined))
    segments.extend(tool_schema_segments(tools))
    segments.extend(_turn_segments(messages, users[-1], passages, max_segments, len(segments)))
    if max_segments is not None and len(segments) > max_segments:
        raise _over(max_segments, len(messages) - 1)
    return tuple(segments)


def _turn_segments(messages: Sequence[Mapping[str, Any]], asked: int, passages: Passages,
                   max_segments: int | None, used: int) -> list[Segment]:
    """The segments of an agent chat's messages after its head (``message_segments``), oldest
    first, system messages left out: user and assistant turns, an assistant's tool calls, the
    tools' results, and at message ``asked`` (the last user turn) ``passages`` then the question.
    ``used``: the head's segments; once a message's calls or documents would take the chat past
    ``max_segments``, an ``InputError`` names that message, before they are built."""
    segments: list[Segment] = []
    for n, message in enumerate(messages):
        role, text = message["role"], _content(message, n)
        left = None if max_segments is None else max_segments - used - len(segments)
        if role == "system":
            continue
        if n == asked:
            segments.extend(passage_segments(passages))
            segments.append(Segment(SegmentKind.QUESTION, _question(text, "the last user message")))
        elif role in ("user", "human"):
            segments.append(Segment(SegmentKind.HISTORY, text.strip(), f"turn-{n}", {"message": n}, role="user"))
        elif role in ("assistant", "ai"):
            if text.strip():
                segments.append(Segment(SegmentKind.HISTORY, text.strip(), f"turn-{n}", {"message": n},
                                        role="assistant"))
            calls = message.get("tool_calls") or ()
            if left is not None and len(calls) > left:
                raise _over(max_segments, n)
            segments.extend(tool_call_segments(calls, n))
        elif role == "tool":
            call_id = message.get("tool_call_id")
            try:
                segments.extend(_result_segments(text, n, str(call_id) if call_id else None,
                                                 message.get("documents"), left))
            except _TooMany:
                raise _over(max_segments, n) from None
        else:
            raise InputError(f"message {n} has the role {role!r:.40}; an agent chat takes system, user, "
                             "assistant and tool messages")
    return segments


def _over(limit: int | None, n: int) -> InputError:
    return InputError(f"the chat holds more than {limit} segments in all (tool documents, tool calls, turns, "
                      f"passages), passed at message {n}: return fewer, longer documents")


def echoed_question(segments: Sequence[Segment]) -> tuple[Segment, ...] | None:
    """What the draft reads of a prompt whose question comes before prunable context (an agent's
    tool results follow the user's turn), or None when nothing prunable follows the question.

    Causal attention lets a token see only what precedes it: the question's own tokens cannot
    attend to the tool results after them, and the draft's look-ahead continues the tool's turn.
    So the draft reads the question once more after the last message (``ScoringConfig.
    echo_question``): the question stays where it was as the user turn it is (a user ``HISTORY``
    segment of the same text, at the same index) and one more ``QUESTION`` segment ends the chat.
    Every segment of the prompt keeps its index and text, so the draft's scores carry back to the
    main prompt by segment (``draft.token_mapping``)."""
    asked = [i for i, s in enumerate(segments) if s.kind is SegmentKind.QUESTION]
    if not asked or not any(s.prunable for s in segments[asked[-1] + 1:]):
        return None
    question = segments[asked[-1]]
    out = list(segments)
    out[asked[-1]] = Segment(SegmentKind.HISTORY, question.text, question.id, question.metadata, role="user")
    return (*out, question)
