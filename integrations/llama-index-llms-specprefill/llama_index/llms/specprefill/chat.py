"""LlamaIndex chat messages ↔ the engine's OpenAI-style messages, and the chat answers back.

A translation layer only (the mapping is docs/tools.md's, "LlamaIndex"):

- roles: system (and 0.14's developer) → instructions; the last user message → the protected
  question; earlier user and assistant turns → history; ``TOOL`` (and the old ``FUNCTION``) →
  a tool result answering ``additional_kwargs["tool_call_id"]``;
- an assistant message's tool calls: ``additional_kwargs["tool_calls"]`` (OpenAI dicts, OpenAI
  SDK objects or ``ToolSelection``s) or, in llama-index-core 0.14, its ``ToolCallBlock``s;
- a tool result's documents, one prunable passage each, with their own ids:
  ``additional_kwargs["documents"]`` (nodes, ``NodeWithScore``s, a ``Response``, ``Passage``s or
  str; the message's text is then their blank-line join), else the ``passage_id`` marker lines
  that ``PassageIdPostprocessor`` writes (a ``RetrieverTool`` with it: node ids), else the core's
  rule (blank lines, JSON array items);
- answers: ``ChatResponse.message`` holds the text outside the calls and, when the model called
  tools, ``additional_kwargs["tool_calls"]`` in OpenAI's format (``id``, ``function.name``,
  ``function.arguments`` as JSON text).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, MessageRole
from specprefill_rag.adapters import GenerationResult, InputTypeError, Segment, message_segments

from .passages import DEFAULT_PASSAGE_ID_KEY, node_passages, split_context

__all__ = ["assistant_message", "engine_message", "messages_to_segments", "tool_call"]

_ROLES = {"developer": "system", "function": "tool", "chatbot": "assistant", "model": "assistant"}


def _role(message: ChatMessage) -> str:
    role = message.role.value if isinstance(message.role, MessageRole) else str(message.role)
    return _ROLES.get(role, role)


def tool_call(call: Any, number: int) -> dict[str, Any]:
    """One tool call as the core's ``{"id", "name", "arguments"}`` (or OpenAI's dict as it is)."""
    if isinstance(call, Mapping):
        return dict(call)
    if hasattr(call, "tool_name"):  # a ToolSelection
        return {"id": getattr(call, "tool_id", None), "name": call.tool_name, "arguments": call.tool_kwargs}
    function = getattr(call, "function", None)  # an OpenAI SDK tool call
    if function is not None and hasattr(function, "name"):
        return {"id": getattr(call, "id", None), "name": function.name, "arguments": function.arguments}
    raise InputTypeError(f"tool call {number} must be a dict, a ToolSelection or an OpenAI tool call, "
                         f"got {type(call).__name__}")


def _tool_calls(message: ChatMessage) -> list[dict[str, Any]]:
    calls = message.additional_kwargs.get("tool_calls") or ()
    if not calls:  # llama-index-core 0.14 may carry them as blocks instead
        calls = [{"id": block.tool_call_id, "name": block.tool_name, "arguments": block.tool_kwargs}
                 for block in getattr(message, "blocks", ()) if getattr(block, "block_type", None) == "tool_call"]
    return [tool_call(call, n) for n, call in enumerate(calls)]


def engine_message(message: ChatMessage, id_key: str = DEFAULT_PASSAGE_ID_KEY) -> dict[str, Any]:
    """A ``ChatMessage`` as the core's OpenAI-style message (the module docstring's mapping)."""
    role, content = _role(message), message.content or ""
    out: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant" and (calls := _tool_calls(message)):
        out["tool_calls"] = calls
    if role != "tool":
        return out
    extra = message.additional_kwargs
    call_id = extra.get("tool_call_id")
    out["tool_call_id"] = None if call_id is None else str(call_id)
    documents = extra.get("documents")
    passages = node_passages(documents) if documents is not None else \
        split_context(content, id_key) if f"{id_key}:" in content else []
    if passages and (documents is not None or any(p.id for p in passages)):
        out["documents"] = passages
        out["content"] = "\n\n".join(p.text for p in passages)
    return out


def messages_to_segments(
    messages: Sequence[ChatMessage],
    tools: Sequence[Mapping[str, Any]] = (),
    *,
    instructions: str | None = None,
    id_key: str = DEFAULT_PASSAGE_ID_KEY,
) -> list[Segment]:
    """Engine segments for a chat (``specprefill_rag.prompt.message_segments`` of the translated
    messages); ``tools``: OpenAI-format tools offered to the model; ``instructions``: the system
    text when the chat has no system message."""
    return list(message_segments([engine_message(m, id_key) for m in messages], tools, instructions=instructions))


def _openai_call(call: Any) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(dict(call.arguments), ensure_ascii=False)}}


def assistant_message(result: GenerationResult) -> ChatMessage:
    """The answer as an assistant message: without tools its text; with tools the text outside the
    calls, and the calls in ``additional_kwargs["tool_calls"]``."""
    if result.content is None:
        return ChatMessage(role=MessageRole.ASSISTANT, content=result.text)
    calls = [_openai_call(call) for call in result.tool_calls]
    return ChatMessage(role=MessageRole.ASSISTANT, content=result.content,
                       additional_kwargs={"tool_calls": calls} if calls else {})
