"""``SpecPrefillLLM``'s ``FunctionCallingLLM`` side: tools offered, calls read back, structured output.

``FunctionCallingMixin`` holds the hooks LlamaIndex's ``FunctionCallingLLM`` calls
(``chat_with_tools``, ``FunctionAgent``, ``structured_predict``); the translation itself is in
``tools`` (docs/tools.md, "LlamaIndex"). A mixin of methods only, no fields: it comes before
``FunctionCallingLLM`` in ``SpecPrefillLLM``'s bases, so pydantic sees the fields of the LLM alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from llama_index.core.base.llms.types import ChatMessage, ChatResponse, MessageRole
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from specprefill_rag.adapters import InputError

from .tools import engine_tool_choice, first_call_only, openai_tools, tool_calling_problem, tool_selections

if TYPE_CHECKING:
    from llama_index.core.tools.types import BaseTool
    from specprefill_rag.adapters import SpecPrefillEngine

    _Base = FunctionCallingLLM  # what the mixin is mixed into, for the type checker
else:
    _Base = object

__all__ = ["FunctionCallingMixin"]


class FunctionCallingMixin(_Base):
    """The tool-calling hooks of ``SpecPrefillLLM`` (methods only; needs the LLM's ``engine``)."""

    if TYPE_CHECKING:

        @property
        def engine(self) -> SpecPrefillEngine: ...

    def _prepare_chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """``chat`` arguments offering ``tools`` (OpenAI schemas) with the engine's ``tool_choice``
        (``tools.engine_tool_choice``) and, without ``allow_parallel_tool_calls``, at most one call
        (decoded under that grammar where the backend can); a model that cannot call tools is an
        ``InputError`` here.

        The signature is ``FunctionCallingLLM``'s: LlamaIndex looks for ``tool_required`` in it, and
        passes ``tool_choice`` (``FunctionAgent.initial_tool_choice``, ``llm_kwargs``) by keyword,
        so it arrives in ``kwargs``."""
        tool_choice: str | dict[str, Any] | None = kwargs.pop("tool_choice", None)
        schemas = openai_tools(tools)
        if schemas and (problem := tool_calling_problem(self.engine.tokenizer)) is not None:
            raise InputError(problem)
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(ChatMessage(role=MessageRole.USER, content=user_msg) if isinstance(user_msg, str)
                            else user_msg)
        names = [schema["function"]["name"] for schema in schemas]
        choice = engine_tool_choice(tool_choice, tool_required, names) if schemas else None
        return {"messages": messages, "tools": schemas, "tool_choice": choice,
                "parallel_tool_calls": allow_parallel_tool_calls if schemas else None, **kwargs}

    def _validate_chat_with_tools_response(
        self, response: ChatResponse, tools: Sequence[BaseTool], allow_parallel_tool_calls: bool = False,
        **kwargs: Any,
    ) -> ChatResponse:
        """Without ``allow_parallel_tool_calls``, only the first call is kept (as LlamaIndex's OpenAI LLM)."""
        return response if allow_parallel_tool_calls else first_call_only(response)

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        """The calls the model wrote (validated against the tools when it answered), as ``ToolSelection``s."""
        return tool_selections(response, error_on_no_tool_call)

    # As LlamaIndex's OpenAI LLM: structured output by function calling forces the call.
    def structured_predict(self, output_cls: Any, prompt: Any, llm_kwargs: dict[str, Any] | None = None,
                           **prompt_args: Any) -> Any:
        return super().structured_predict(output_cls, prompt, _forced(llm_kwargs), **prompt_args)

    async def astructured_predict(self, output_cls: Any, prompt: Any, llm_kwargs: dict[str, Any] | None = None,
                                  **prompt_args: Any) -> Any:
        return await super().astructured_predict(output_cls, prompt, _forced(llm_kwargs), **prompt_args)

    def stream_structured_predict(self, output_cls: Any, prompt: Any, llm_kwargs: dict[str, Any] | None = None,
                                  **prompt_args: Any) -> Any:
        return super().stream_structured_predict(output_cls, prompt, _forced(llm_kwargs), **prompt_args)

    async def astream_structured_predict(self, output_cls: Any, prompt: Any,
                                         llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any) -> Any:
        return await super().astream_structured_predict(output_cls, prompt, _forced(llm_kwargs), **prompt_args)


def _forced(llm_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """``llm_kwargs`` of a structured prediction: the schema's call is required unless said otherwise."""
    llm_kwargs = dict(llm_kwargs or {})
    if "tool_choice" not in llm_kwargs:
        llm_kwargs.setdefault("tool_required", True)
    return llm_kwargs
