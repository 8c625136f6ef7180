"""``SpecPrefillLLM``: a LlamaIndex ``FunctionCallingLLM`` over a ``SpecPrefillEngine``.

A translation layer only. Query engines call ``predict(template, context_str=..., query_str=...)``;
those two slots reach the engine as separate segments (passages + protected question), so
selection is passage-aware and reported per source node (``passages.split_context``'s rule,
docs/integrations.md). The template's own wording is replaced by the engine's RAG layout
(instructions = ``system_prompt``, else ``instructions``, else the engine's). Any other call
(``complete``, other templates, templates with an output parser) sends the whole prompt as one
prunable context segment whose last tokens are protected.

Chats go through ``chat.messages_to_segments``; with tools (``chat_with_tools``, ``FunctionAgent``)
the template renders the tool schemas and calls (protected) and each tool result is one prunable
passage per document (docs/tools.md). Tool calling needs a main model whose chat template renders
tools (``metadata.is_function_calling_model``); the ``FunctionCallingLLM`` hooks
(``_prepare_chat_with_tools``, ``structured_predict``, ...) are ``function_calling.FunctionCallingMixin``'s.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Any

import llama_index.core.instrumentation as instrument
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.instrumentation.events.llm import LLMPredictEndEvent, LLMPredictStartEvent
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.types import TokenAsyncGen, TokenGen
from specprefill_rag.adapters import (
    GenerationResult,
    LazyEngine,
    Mode,
    Segment,
    SegmentKind,
    SpecPrefillEngine,
    answer_report,
    build_segments,
    content_filter,
    option,
)

from .chat import assistant_message, messages_to_segments
from .function_calling import FunctionCallingMixin
from .passages import DEFAULT_PASSAGE_ID_KEY, split_context
from .streaming import achat_chunks, acompletion_chunks, chat_chunks, completion_chunks
from .tools import tool_calling_problem

__all__ = ["SpecPrefillLLM", "rag_instructions"]

dispatcher = instrument.get_dispatcher(__name__)


class SpecPrefillLLM(FunctionCallingMixin, FunctionCallingLLM):
    """LlamaIndex LLM whose prompts are prefilled with Speculative Prefill.

    Pass a ready ``engine`` (shares loaded models), or ``model_name`` (and optionally
    ``draft_model``) to have one built on first use with ``SpecPrefillEngine.from_pretrained``.
    ``CompletionResponse.additional_kwargs`` holds timings, keep ratio and kept spans.
    """

    model_name: str | None = option("model_name")
    draft_model: str | None = option("draft_model")
    backend: str = option("backend")
    mode: Mode = option("mode")
    keep_rate: float | None = option("keep_rate")
    instructions: str | None = Field(
        default=None, description="Instructions for query-engine calls without system_prompt; None = engine's."
    )
    max_new_tokens: int | None = option("max_tokens")
    temperature: float | None = option("temperature")
    timeout: float | None = option("timeout")
    max_retries: int = option("max_retries")
    passage_id_key: str = Field(
        default=DEFAULT_PASSAGE_ID_KEY, description="Metadata key marking node starts in context_str."
    )

    _engine: SpecPrefillEngine | None = PrivateAttr(default=None)
    _lazy: LazyEngine = PrivateAttr(default_factory=LazyEngine)

    def __init__(self, engine: SpecPrefillEngine | None = None, **kwargs: Any) -> None:
        if engine is not None and kwargs.get("model_name") is None:
            kwargs["model_name"] = engine.backend.model_name
        super().__init__(**kwargs)
        if engine is None and not self.model_name:
            raise ValueError("pass engine=SpecPrefillEngine(...) or model_name='<name, dir or GGUF>'")
        self._engine = engine

    @classmethod
    def class_name(cls) -> str:
        return "SpecPrefillLLM"

    @property
    def engine(self) -> SpecPrefillEngine:
        """The engine (built from ``model_name``/``draft_model`` on first use, once even when
        many threads ask at the same time)."""
        if self._engine is None:
            assert self.model_name is not None
            self._engine = self._lazy.get(self.model_name, self.draft_model, backend=self.backend,
                                          max_retries=self.max_retries)
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        engine = self.engine
        return LLMMetadata(
            context_window=engine.backend.max_context,
            num_output=self.max_new_tokens or engine.config.generation.max_new_tokens,
            model_name=str(self.model_name),
            is_chat_model=False,
            is_function_calling_model=tool_calling_problem(engine.tokenizer) is None,
        )

    # -- translation ----------------------------------------------------------------------

    def _rag_segments(self, prompt: BasePromptTemplate, prompt_args: dict[str, Any]) -> list[Segment] | None:
        """Segments for a query-engine template call, or None when it is not one. The instructions:
        ``system_prompt``, else ``instructions``, else the engine's."""
        if self.output_parser is not None or prompt.output_parser is not None:
            return None  # the parser's format instructions live in the template text
        args = {**prompt.kwargs, **prompt_args}
        context, question = args.get("context_str"), args.get("query_str")
        if not isinstance(context, str) or not isinstance(question, str) or not question.strip():
            return None
        passages = split_context(context, self.passage_id_key)
        if not passages:
            return None
        return list(build_segments(question, passages, rag_instructions(self)))

    def _prompt_segments(self, prompt: str) -> list[Segment]:
        """A plain prompt: one prunable context segment after the ``system_prompt``, if any."""
        if not prompt.strip():
            raise ValueError("the prompt is empty")
        system = (self.system_prompt or "").strip()
        return [*([Segment(SegmentKind.INSTRUCTIONS, system)] if system else []), Segment(SegmentKind.CONTEXT, prompt)]

    def _chat_request(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> dict[str, Any]:
        """System → instructions; last user message → question; earlier turns → history messages;
        ``tools`` (OpenAI format, from ``_prepare_chat_with_tools``) → schemas; tool calls and
        results as ``chat.messages_to_segments`` maps them."""
        kwargs = dict(kwargs)
        tools = kwargs.pop("tools", None) or ()
        segments = messages_to_segments(messages, tools, instructions=self.system_prompt, id_key=self.passage_id_key)
        return self._request(segments, kwargs)

    def _request(self, segments: list[Segment], kwargs: dict[str, Any]) -> dict[str, Any]:
        kwargs = dict(kwargs)
        kwargs.pop("formatted", None)
        generation = self.engine.config.generation.with_overrides(
            max_new_tokens=kwargs.pop("max_new_tokens", self.max_new_tokens),
            temperature=kwargs.pop("temperature", self.temperature),
            timeout=kwargs.pop("timeout", self.timeout),
            stop=kwargs.pop("stop", None) or None,
            tool_choice=kwargs.pop("tool_choice", None),
            parallel_tool_calls=kwargs.pop("parallel_tool_calls", None),
        )
        mode = kwargs.pop("mode", self.mode)
        keep_rate = kwargs.pop("keep_rate", self.keep_rate)
        if kwargs:
            raise TypeError(f"unexpected arguments for SpecPrefillLLM: {sorted(kwargs)}")
        return {"question": segments, "mode": mode, "keep_rate": keep_rate, "generation": generation}

    def _facts(self, result: GenerationResult) -> dict[str, Any]:
        """Counts, keep ratio, timings, kept spans (and tool calls): ``additional_kwargs`` and ``raw``."""
        return answer_report(str(self.model_name), result)

    def _response(self, result: GenerationResult) -> CompletionResponse:
        facts = self._facts(result)
        return CompletionResponse(text=result.text, additional_kwargs=facts, raw=facts)

    def _chat_response(self, result: GenerationResult) -> ChatResponse:
        """The answer: its text (with tools: the text outside the calls, and the calls in the
        message's ``additional_kwargs["tool_calls"]``), the facts in ``additional_kwargs`` and ``raw``."""
        facts = self._facts(result)
        return ChatResponse(message=assistant_message(result), delta="", additional_kwargs=facts, raw=facts)

    def _last_chunk(self, text: str, result: GenerationResult) -> CompletionResponse:
        """The stream's closing chunk: no new text, the result's facts."""
        facts = self._facts(result)
        return CompletionResponse(text=text, delta="", additional_kwargs=facts, raw=facts)

    def _run(self, segments: list[Segment], kwargs: dict[str, Any]) -> CompletionResponse:
        return self._response(self.engine.generate(**self._request(segments, kwargs)))

    async def _arun(self, segments: list[Segment], kwargs: dict[str, Any]) -> CompletionResponse:
        return self._response(await self.engine.agenerate(**self._request(segments, kwargs)))

    def _run_stream(self, segments: list[Segment], kwargs: dict[str, Any]) -> CompletionResponseGen:
        return completion_chunks(self.engine.stream(**self._request(segments, kwargs)), self._last_chunk)

    async def _arun_stream(self, segments: list[Segment], kwargs: dict[str, Any]) -> CompletionResponseAsyncGen:
        return acompletion_chunks(await self.engine.astream(**self._request(segments, kwargs)), self._last_chunk)

    # -- completion -----------------------------------------------------------------------

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._run(self._prompt_segments(prompt), kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return self._run_stream(self._prompt_segments(prompt), kwargs)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await self._arun(self._prompt_segments(prompt), kwargs)

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        return await self._arun_stream(self._prompt_segments(prompt), kwargs)

    # The RAG path: ``prompt`` (first argument) is the rendered template, shown to callbacks.
    @llm_completion_callback()
    def _complete_segments(self, prompt: str, segments: list[Segment]) -> CompletionResponse:
        return self._run(segments, {})

    @llm_completion_callback()
    def _stream_segments(self, prompt: str, segments: list[Segment]) -> CompletionResponseGen:
        return self._run_stream(segments, {})

    @llm_completion_callback()
    async def _acomplete_segments(self, prompt: str, segments: list[Segment]) -> CompletionResponse:
        return await self._arun(segments, {})

    @llm_completion_callback()
    async def _astream_segments(self, prompt: str, segments: list[Segment]) -> CompletionResponseAsyncGen:
        return await self._arun_stream(segments, {})

    # -- chat -----------------------------------------------------------------------------

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._chat_response(self.engine.generate(**self._chat_request(messages, kwargs)))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        request = self._chat_request(messages, kwargs)
        stream = self.engine.stream(**request)  # bad input raises here, before any model runs
        return chat_chunks(stream, content_filter(request["question"], self.engine.tokenizer), self._chat_response)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._chat_response(await self.engine.agenerate(**self._chat_request(messages, kwargs)))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        request = self._chat_request(messages, kwargs)
        stream = await self.engine.astream(**request)
        return achat_chunks(stream, content_filter(request["question"], self.engine.tokenizer), self._chat_response)

    # -- query-engine templates (predict / stream) ----------------------------------------

    @dispatcher.span
    def predict(self, prompt: BasePromptTemplate, **prompt_args: Any) -> str:
        segments = self._rag_segments(prompt, prompt_args)
        if segments is None:
            return super().predict(prompt, **prompt_args)
        dispatcher.event(LLMPredictStartEvent(template=prompt, template_args=prompt_args))
        output = self._complete_segments(self._get_prompt(prompt, **prompt_args), segments).text
        dispatcher.event(LLMPredictEndEvent(output=output))
        return output

    @dispatcher.span
    def stream(self, prompt: BasePromptTemplate, **prompt_args: Any) -> TokenGen:
        segments = self._rag_segments(prompt, prompt_args)
        if segments is None:
            return super().stream(prompt, **prompt_args)
        dispatcher.event(LLMPredictStartEvent(template=prompt, template_args=prompt_args))
        responses = self._stream_segments(self._get_prompt(prompt, **prompt_args), segments)
        return (r.delta for r in responses if r.delta)

    @dispatcher.span
    async def apredict(self, prompt: BasePromptTemplate, **prompt_args: Any) -> str:
        segments = self._rag_segments(prompt, prompt_args)
        if segments is None:
            return await super().apredict(prompt, **prompt_args)
        dispatcher.event(LLMPredictStartEvent(template=prompt, template_args=prompt_args))
        response = await self._acomplete_segments(self._get_prompt(prompt, **prompt_args), segments)
        dispatcher.event(LLMPredictEndEvent(output=response.text))
        return response.text

    @dispatcher.span
    async def astream(self, prompt: BasePromptTemplate, **prompt_args: Any) -> TokenAsyncGen:
        segments = self._rag_segments(prompt, prompt_args)
        if segments is None:
            return await super().astream(prompt, **prompt_args)
        dispatcher.event(LLMPredictStartEvent(template=prompt, template_args=prompt_args))
        responses = await self._astream_segments(self._get_prompt(prompt, **prompt_args), segments)

        async def gen() -> AsyncGenerator[str, None]:
            async for r in responses:
                if r.delta:
                    yield r.delta

        return gen()


def rag_instructions(llm: SpecPrefillLLM) -> str | None:
    """The instructions of a query-engine call (``predict`` with a RAG template): ``system_prompt``,
    else ``instructions``, else the engine's; ``SpecPrefillPassageReader`` reads passages after them."""
    return llm.system_prompt or llm.instructions or llm.engine.config.instructions

