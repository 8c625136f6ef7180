"""``ChatSpecPrefill``'s tool calling and structured output (docs/tools.md, "LangChain").

``ToolCallingMixin`` holds ``bind_tools`` and ``with_structured_output``: what they bind
(OpenAI-format tools, the engine's ``tool_choice``, a JSON grammar) reaches the engine through
``ChatSpecPrefill``'s request. A mixin of methods only, no fields: it comes before
``BaseChatModel`` in ``ChatSpecPrefill``'s bases, so pydantic sees the fields of the chat model alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from operator import itemgetter
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from pydantic import BaseModel
from specprefill_rag.adapters import json_grammar

if TYPE_CHECKING:
    _Base = BaseChatModel  # what the mixin is mixed into, for the type checker
else:
    _Base = object

__all__ = ["ToolCallingMixin", "ToolLike"]

ToolLike: TypeAlias = Mapping[str, Any] | type | Callable[..., Any] | BaseTool


def _tool_choice(choice: object, names: Sequence[str]) -> str:
    """LangChain's ``tool_choice`` as the engine's: "auto", "required", "none" or a tool's name."""
    if choice is None or choice == "auto":
        return "auto"
    if choice in ("any", "required", True):
        return "required" if len(names) != 1 else names[0]
    if choice == "none":
        return "none"
    if isinstance(choice, Mapping):
        choice = (choice.get("function") or {}).get("name") or choice.get("name")
    if isinstance(choice, str) and choice in names:
        return choice
    raise ValueError(f"tool_choice must be 'auto', 'any', 'required', 'none', True or one of the tools "
                     f"({', '.join(names)}), got {choice!r:.80}")


class ToolCallingMixin(_Base):
    """``bind_tools`` and ``with_structured_output`` of ``ChatSpecPrefill`` (methods only)."""

    def bind_tools(
        self,
        tools: Sequence[ToolLike],
        *,
        tool_choice: str | bool | Mapping[str, Any] | Literal["auto", "any", "required", "none"] | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Offer ``tools`` (pydantic classes, functions, ``BaseTool``s or OpenAI dicts) to the model.

        ``tool_choice``: "auto" (default), "any"/"required"/True (at least one call; one tool: that
        tool), "none", or a tool's name; ``parallel_tool_calls=False``: at most one call. On a
        backend that decodes under a grammar (transformers, vLLM) the answer is constrained to
        text and calls that fit their tools' schemas; on any backend it is checked, and one that
        breaks the choice (or calls a tool wrongly) raises ``ToolCallError``.
        """
        formatted = [convert_to_openai_tool(tool) for tool in tools]
        names = [tool["function"]["name"] for tool in formatted]
        if "ls_structured_output_format" in kwargs:  # with_structured_output: one object, one call
            kwargs.setdefault("parallel_tool_calls", False)
        return super().bind(tools=formatted, tool_choice=_tool_choice(tool_choice, names), **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type,
        *,
        include_raw: bool = False,
        method: Literal["function_calling", "json_schema", "json_mode"] = "function_calling",
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | BaseModel]:
        """Answers as ``schema`` (a pydantic class, TypedDict, JSON schema or OpenAI tool).

        ``method="function_calling"`` (default): a forced call of the schema as a tool (LangChain's
        own ``with_structured_output``); ``"json_schema"``: the answer itself is JSON decoded under
        the schema's grammar; ``"json_mode"``: any JSON object (say the shape in the prompt).
        """
        if method == "function_calling":
            return super().with_structured_output(schema, include_raw=include_raw, **kwargs)
        if method not in ("json_schema", "json_mode"):
            raise ValueError(f"method must be 'function_calling', 'json_schema' or 'json_mode', got {method!r:.40}")
        kwargs.pop("strict", None)
        if kwargs:
            raise ValueError(f"Received unsupported arguments {kwargs}")
        wanted = convert_to_json_schema(schema) if method == "json_schema" else {"type": "object"}
        llm = self.bind(grammar=json_grammar(wanted), ls_structured_output_format={
            "kwargs": {"method": method}, "schema": wanted})
        parser: Runnable = JsonOutputParser()
        if isinstance(schema, type) and issubclass(schema, BaseModel):
            parser = PydanticOutputParser(pydantic_object=schema)
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([fallback], exception_key="parsing_error")
