"""LlamaIndex tools ↔ the engine's tool calling (docs/tools.md, "LlamaIndex").

- ``openai_tools``: ``BaseTool``s as OpenAI function schemas (``tool.metadata.to_openai_tool()``);
- ``engine_tool_choice``: LlamaIndex's ``tool_required`` / ``tool_choice`` as the engine's
  "auto", "required", "none" or a tool's name;
- ``tool_selections``: the calls of an answer (``ChatResponse.message.additional_kwargs
  ["tool_calls"]``) as ``ToolSelection``s;
- ``tool_calling_problem``: why a main model cannot call tools (its chat template never reads
  ``tools``, or no call parser knows it), or None;
- ``tool_result_message`` and ``DocumentsTool``: a tool's retrieved nodes (a ``RetrieverTool``'s
  ``NodeWithScore`` list, a ``QueryEngineTool``'s ``Response.source_nodes``) reach the prompt as
  documents, one prunable passage per node with the node's id.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, ChatResponse, MessageRole
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.schema import BaseNode, NodeWithScore
from llama_index.core.tools import AsyncBaseTool, BaseTool, ToolMetadata, ToolOutput, adapt_to_async_tool
from specprefill_rag.adapters import RETRIEVER_SCORE_KEY, InputError, Passage, parser_for

from .chat import tool_call
from .passages import DEFAULT_PASSAGE_ID_KEY, DEFAULT_PASSAGE_SCORE_KEY, node_passages

__all__ = [
    "DocumentsTool",
    "engine_tool_choice",
    "first_call_only",
    "openai_tools",
    "tool_calling_problem",
    "tool_result_message",
    "tool_selections",
]


def openai_tools(tools: Sequence[BaseTool]) -> list[dict[str, Any]]:
    """The tools in OpenAI's function format, as the chat template renders them."""
    return [tool.metadata.to_openai_tool() for tool in tools]


def engine_tool_choice(tool_choice: object, tool_required: bool, names: Sequence[str]) -> str:
    """The engine's ``tool_choice``: LlamaIndex's ``tool_choice`` ("auto", "none", "required"/"any",
    a tool's name, or OpenAI's ``{"type": "function", "function": {"name": ...}}``), else
    "required" when ``tool_required``, else "auto". A required call with one tool is that tool."""
    choice = tool_choice if tool_choice is not None else "required" if tool_required else "auto"
    if isinstance(choice, Mapping):
        choice = (choice.get("function") or {}).get("name") or choice.get("name")
    if choice in ("auto", "none"):
        return str(choice)
    if choice in ("required", "any"):
        return "required" if len(names) != 1 else names[0]
    if isinstance(choice, str) and choice in names:
        return choice
    raise ValueError(f"tool_choice must be 'auto', 'required', 'any', 'none' or one of the tools "
                     f"({', '.join(names)}), got {tool_choice!r:.80}")


def tool_calling_problem(tokenizer: Any) -> str | None:
    """Why the main model cannot call tools, or None when it can: its chat template must render
    ``tools`` and a call parser must know the template (``specprefill_rag.toolcalls``)."""
    template = getattr(tokenizer, "chat_template", None)
    template = " ".join(template.values()) if isinstance(template, dict) else str(template or "")
    if "tools" not in template:
        return ("the main model's chat template does not support tool calling (it never reads `tools`): use a "
                "model whose template renders tools (the packaged Qwen2.5-Coder models do, SmolLM2 does not)")
    try:
        parser_for(tokenizer)
    except InputError as error:
        return str(error)
    return None


def tool_selections(response: ChatResponse, error_on_no_tool_call: bool = True) -> list[ToolSelection]:
    """The calls in ``response`` (its message's ``additional_kwargs["tool_calls"]``, as this LLM
    writes them, OpenAI's dicts or objects, or ``ToolSelection``s); none is a ``ValueError`` when
    ``error_on_no_tool_call``."""
    calls = response.message.additional_kwargs.get("tool_calls") or []
    if not calls and error_on_no_tool_call:
        raise ValueError("Expected at least one tool call, but got 0 tool calls: the model answered in text")
    selections = []
    for n, raw in enumerate(calls):
        call = tool_call(raw, n)
        function = call.get("function", call)
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            arguments = json.loads(arguments) if arguments.strip() else {}
        selections.append(ToolSelection(tool_id=str(call.get("id") or f"call_{n}"), tool_name=function["name"],
                                        tool_kwargs=arguments))
    return selections


def first_call_only(response: ChatResponse) -> ChatResponse:
    """``response`` with at most its first tool call (when parallel calls are not allowed)."""
    calls = response.message.additional_kwargs.get("tool_calls") or []
    if len(calls) > 1:
        response.message.additional_kwargs["tool_calls"] = calls[:1]
    return response


def _nodes(raw_output: Any) -> Any:
    """The retrieved nodes a tool's raw output holds (a ``Response``'s source nodes, a list of
    nodes), or None."""
    if getattr(raw_output, "source_nodes", None):
        return raw_output.source_nodes
    if isinstance(raw_output, list) and raw_output and all(isinstance(n, NodeWithScore | BaseNode) for n in raw_output):
        return raw_output
    return None


def tool_result_message(output: ToolOutput, tool_call_id: str) -> ChatMessage:
    """The message answering the call ``tool_call_id`` with ``output``. When the output holds
    retrieved nodes (``RetrieverTool``: its nodes; ``QueryEngineTool``: its ``Response``'s source
    nodes) they are the result, one prunable passage per node with its id; else the output's text."""
    extra: dict[str, Any] = {"tool_call_id": tool_call_id}
    nodes = _nodes(output.raw_output)
    if nodes is not None:
        extra["documents"] = node_passages(nodes)
    return ChatMessage(role=MessageRole.TOOL, content=str(output.content), additional_kwargs=extra)


class DocumentsTool(AsyncBaseTool):
    """A tool whose text is the nodes its wrapped tool retrieved, each after a ``passage_id: <node
    id>`` line: what an agent that passes only a tool's text (``FunctionAgent``) needs for
    per-node passages. ``SpecPrefillLLM`` cuts the text back into nodes and drops the marker lines.

    Wrap a ``QueryEngineTool`` (a query engine with a ``NoText`` synthesizer only retrieves) or a
    ``RetrieverTool``; an output without nodes passes unchanged.
    """

    def __init__(self, tool: BaseTool, id_key: str = DEFAULT_PASSAGE_ID_KEY) -> None:
        self._tool = adapt_to_async_tool(tool)
        self._id_key = id_key

    @property
    def metadata(self) -> ToolMetadata:
        return self._tool.metadata

    def _documents(self, output: ToolOutput) -> ToolOutput:
        nodes = _nodes(output.raw_output)
        if nodes is None or output.is_error:
            return output
        text = "\n\n".join(self._marked(p) for p in node_passages(nodes))
        return ToolOutput(content=text, tool_name=output.tool_name, raw_input=output.raw_input,
                          raw_output=output.raw_output)

    def _marked(self, passage: Passage) -> str:
        """A node's text after its id line and score line (``split_context`` reads both back)."""
        if passage.id is None:
            return passage.text
        score = passage.metadata.get(RETRIEVER_SCORE_KEY)
        scored = "" if score is None else f"{DEFAULT_PASSAGE_SCORE_KEY}: {score:.6g}\n"
        return f"{self._id_key}: {passage.id}\n{scored}{passage.text}"

    def call(self, *args: Any, **kwargs: Any) -> ToolOutput:
        return self._documents(self._tool.call(*args, **kwargs))

    async def acall(self, *args: Any, **kwargs: Any) -> ToolOutput:
        return self._documents(await self._tool.acall(*args, **kwargs))
