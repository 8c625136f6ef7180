"""Segments → chat messages → the chat-templated text, with each segment's character span in it.

The user message is laid out as::

    Context:
    [1]
    <passage 1>

    [2]
    <passage 2>

    Question: <question>

Messages, in the segments' order: the instructions as the system message; each history
segment as a message of its role (with the tool calls of its turn); each tool message's
documents joined back into that message; the last user message (context and question) where
the question stands. Tool schemas go to the template's ``tools``.

Spans come from construction, never from searching the client's text: the template is rendered
with a placeholder for each message's content, and the content is put in its place. Tool schemas
and call arguments are rendered by the template itself (``tojson``); their JSON text is found in
the layout (which holds no client content, only placeholders), and one that cannot be found is
refused when it holds a token the tokenizer would read as markup.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import InputError
from ..types import Segment, SegmentKind
from .tool_segments import _NAME

__all__ = ["Message", "check_tool_support", "layout", "messages"]

_TOOL_KINDS = (SegmentKind.TOOL_SCHEMA, SegmentKind.TOOL_CALL, SegmentKind.TOOL_RESULT)


@dataclass
class Message:
    """One chat message: its role, content, the (segment, start, end) spans in the content, the
    ``TOOL_CALL`` segments it carries (an assistant's) and the call it answers (a tool's)."""

    role: str
    content: str
    spans: list[tuple[int, int, int]] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)
    tool_call_id: str | None = None


def _user_content(segments: Sequence[Segment]) -> tuple[str, list[tuple[int, int, int]]]:
    """User message text and (segment index, start, end) character spans inside it."""
    parts: list[str] = []
    spans: list[tuple[int, int, int]] = []
    length = 0

    def add(text: str, segment: int | None = None) -> None:
        nonlocal length
        if segment is not None:
            spans.append((segment, length, length + len(text)))
        parts.append(text)
        length += len(text)

    context = [i for i, s in enumerate(segments) if s.kind in (SegmentKind.PASSAGE, SegmentKind.CONTEXT)]
    if context:
        add("Context:\n")
        for number, i in enumerate(context, start=1):
            if segments[i].kind is SegmentKind.PASSAGE:
                add(f"[{number}]\n")
            add(segments[i].text, i)
            add("\n\n")
    for i, s in enumerate(segments):
        if s.kind is SegmentKind.QUESTION:
            add("Question: ")
            add(s.text, i)
    return "".join(parts).rstrip("\n"), spans


def _system_content(segments: Sequence[Segment]) -> tuple[str, list[tuple[int, int, int]]]:
    """System message text (the instructions, joined by blank lines) and their character spans."""
    parts: list[str] = []
    spans: list[tuple[int, int, int]] = []
    length = 0
    for i, s in enumerate(segments):
        if s.kind is SegmentKind.INSTRUCTIONS:
            if parts:
                parts.append("\n\n")
                length += 2
            spans.append((i, length, length + len(s.text)))
            parts.append(s.text)
            length += len(s.text)
    return "".join(parts), spans


def messages(segments: Sequence[Segment]) -> list[Message]:
    """The chat messages of ``segments``, in order (the module docstring)."""
    out: list[Message] = []
    system, system_spans = _system_content(segments)
    if system:
        out.append(Message("system", system, system_spans))
    groups: dict[object, Message] = {}  # metadata["message"] → the message its segments join
    asked = False
    for i, s in enumerate(segments):
        key = s.metadata.get("message")
        if s.kind is SegmentKind.HISTORY:
            out.append(Message(str(s.role), s.text, [(i, 0, len(s.text))]))
            if key is not None:
                groups[key] = out[-1]
        elif s.kind is SegmentKind.TOOL_CALL:
            owner = groups.get(key) if key is not None else (out[-1] if out else None)
            if owner is None or owner.role != "assistant" or owner is not out[-1]:
                owner = Message("assistant", "")
                out.append(owner)
                groups[key] = owner
            owner.calls.append(i)
        elif s.kind is SegmentKind.TOOL_RESULT:
            owner = groups.get(key)
            if owner is None or owner.role != "tool" or key is None:
                call_id = s.metadata.get("tool_call_id")
                owner = Message("tool", "", tool_call_id=None if call_id is None else str(call_id))
                out.append(owner)
                groups[key] = owner
            owner.content += str(s.metadata.get("lead", ""))
            owner.spans.append((i, len(owner.content), len(owner.content) + len(s.text)))
            owner.content += s.text + str(s.metadata.get("tail", ""))
        elif s.kind is SegmentKind.QUESTION and not asked:
            out.append(Message("user", *_user_content(segments)))
            asked = True
    if not asked:
        out.append(Message("user", *_user_content(segments)))
    return out


def _plain_layout(roles: Sequence[str], markers: Sequence[str]) -> str:
    """The layout without a chat template: the system text, "User: ..." / "Assistant: ..." turns,
    the last user message, then "Answer:"."""
    parts = []
    for n, (role, marker) in enumerate(zip(roles, markers, strict=True)):
        if n == len(roles) - 1:
            parts.append(f"{marker}\nAnswer:")
        elif role == "system":
            parts.append(f"{marker}\n\n")
        else:
            parts.append(f"{role.capitalize()}: {marker}\n\n")
    return "".join(parts)


def check_tool_support(tokenizer: Any, segments: Sequence[Segment]) -> None:
    """``InputError`` unless the chat template renders what the tool segments need: a template that
    never reads ``tools`` would drop the tools (and ``tool_calls`` the calls) without a word. The
    message names the tokenizer's model: the draft's template is checked too where it renders the
    prompt itself (another family). Segments without tools need nothing."""
    kinds = {s.kind for s in segments}
    if kinds.isdisjoint(_TOOL_KINDS):
        return
    template = getattr(tokenizer, "chat_template", None)
    template = " ".join(template.values()) if isinstance(template, dict) else str(template or "")
    missing = "tools" if "tools" not in template else "tool_calls" \
        if SegmentKind.TOOL_CALL in kinds and "tool_calls" not in template else None
    if missing:
        name = str(getattr(tokenizer, "name_or_path", None) or "")
        name = name if len(name) <= 120 else f"…{name[-119:]}"  # a long local path: its end names the model
        whose = f"the chat template of {name!r}" if name else "the chat template"
        raise InputError(
            f"{whose} does not support tool calling (it never reads `{missing}`): "
            "tools, tool calls and tool messages would be dropped or garbled; use a model whose template "
            "renders tools (the packaged Qwen2.5-Coder models do, SmolLM2 does not)"
        )


def _template_messages(segments: Sequence[Segment], chat: Sequence[Message], markers: Sequence[str | None]
                       ) -> list[dict[str, Any]]:
    out = []
    for message, marker in zip(chat, markers, strict=True):
        entry: dict[str, Any] = {"role": message.role, "content": marker or ""}
        if message.calls:
            entry["tool_calls"] = [_call(segments[i]) for i in message.calls]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        out.append(entry)
    return out


def _call(segment: Segment) -> dict[str, Any]:
    name = segment.metadata.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise InputError(f"a tool call's name must be 1 to 64 letters, digits, '_' or '-', got {name!r:.80}")
    try:
        arguments = json.loads(segment.text)
    except json.JSONDecodeError as error:
        raise InputError(f"the arguments of the call to {name} are not JSON: {error}") from None
    if not isinstance(arguments, dict):
        raise InputError(f"the arguments of the call to {name} must be a JSON object")
    call: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return call | ({"id": segment.id} if segment.id else {})


def _template(tokenizer: Any, template_messages: list[dict[str, Any]], tools: list[Any] | None) -> str:
    roles = ", ".join(m["role"] for m in template_messages)
    try:
        return str(tokenizer.apply_chat_template(template_messages, tools=tools, tokenize=False,
                                                 add_generation_prompt=True))
    except Exception as error:  # jinja's TemplateError: e.g. "roles must alternate user/assistant"
        if type(error).__module__.split(".")[0] != "jinja2":
            raise
        raise InputError(f"the model's chat template refused the conversation ({roles}): {error}") from None


def _json_anchors(layout_text: str, segments: Sequence[Segment], chat: Sequence[Message],
                  marker_ends: Sequence[int], markup: Sequence[str]) -> list[tuple[int, int, int]]:
    """(start, end, segment) of each tool schema's and call's JSON in the layout, found in order
    (schemas from the start, a message's calls after its content); one not found is template text,
    refused when it holds markup (``InputError``)."""
    wanted = [(0, [i for i, s in enumerate(segments) if s.kind is SegmentKind.TOOL_SCHEMA])]
    wanted += [(end, message.calls) for message, end in zip(chat, marker_ends, strict=True) if message.calls]
    anchors: list[tuple[int, int, int]] = []
    for at, indices in wanted:
        for i in indices:
            text = segments[i].text
            found = layout_text.find(text, at) if text else -1
            if found < 0:
                if any(token in text for token in markup):
                    raise InputError(
                        f"the chat template does not render {segments[i].kind.value} {segments[i].id or i} "
                        "verbatim and its text holds a markup token: it cannot be kept from becoming one"
                    )
                continue
            anchors.append((found, found + len(text), i))
            at = found + len(text)
    anchors.sort()
    return [a for n, a in enumerate(anchors) if n == 0 or a[0] >= anchors[n - 1][1]]


def layout(tokenizer: Any, segments: Sequence[Segment], markup: Sequence[str] = ()
           ) -> tuple[str, list[tuple[int, int, int]], bool]:
    """Full prompt text, segment character spans in it, and whether a chat template was used.
    ``markup``: the tokenizer's added-token strings (what client text must not become)."""
    chat = messages(segments)
    markers = [None if m.role == "assistant" and m.calls and not m.content else f"\x00specprefill-content-{n}\x00"
               for n, m in enumerate(chat)]
    with_template = bool(getattr(tokenizer, "chat_template", None))
    tools = [json.loads(s.text) for s in segments if s.kind is SegmentKind.TOOL_SCHEMA]
    check_tool_support(tokenizer, segments)
    if with_template:
        text = _template(tokenizer, _template_messages(segments, chat, markers), tools or None)
    else:
        text = _plain_layout([m.role for m in chat], [str(m) for m in markers])
    anchors: list[tuple[int, int, Message | None, int]] = []  # (start, end, message, segment)
    at = 0
    marker_ends = []
    for message, marker in zip(chat, markers, strict=True):
        if marker is None:
            marker_ends.append(at)
            continue
        found = text.find(marker, at)
        if found < 0 or marker in text[found + len(marker):]:
            raise ValueError(
                "the chat template does not place each message's content once and verbatim; "
                "cannot locate the segments"
            )
        anchors.append((found, found + len(marker), message, -1))
        at = found + len(marker)
        marker_ends.append(at)
    anchors += [(a, b, None, i) for a, b, i in _json_anchors(text, segments, chat, marker_ends, markup)]
    anchors.sort(key=lambda anchor: anchor[0])
    pieces: list[str] = []
    spans: list[tuple[int, int, int]] = []
    at = length = 0
    for start, end, owner, index in anchors:
        pieces.append(text[at:start])
        length += start - at
        if owner is None:  # a tool schema's or call's JSON, rendered by the template
            spans.append((index, length, length + end - start))
            pieces.append(text[start:end])
            length += end - start
        else:
            spans.extend((i, length + a, length + b) for i, a, b in owner.spans)
            pieces.append(owner.content)
            length += len(owner.content)
        at = end
    pieces.append(text[at:])
    return "".join(pieces), spans, with_template
