"""``SpecPrefillLLM``: a LlamaIndex ``CustomLLM`` over a ``SpecPrefillEngine``.

A translation layer only. Query engines call ``predict(template, context_str=..., query_str=...)``;
those two slots reach the engine as separate segments (passages + protected question), so
selection is passage-aware and reported per source node. The passage rule (docs/integrations.md):

- with ``PassageIdPostprocessor`` in the query engine, each node's LLM text starts with a
  ``passage_id: <node id>`` metadata line; ``context_str`` is cut at those lines and every
  passage keeps its node id (the marker line itself is not sent to the model);
- without it, ``context_str`` is cut at blank lines (LlamaIndex joins node texts with
  ``"\\n\\n"``), and passages are numbered 1, 2, ...

The template's own wording is replaced by the engine's RAG layout (instructions =
``system_prompt``, else ``instructions``, else the engine's). Any other call (``complete``,
other templates, templates with an output parser) sends the whole prompt as one prunable
context segment whose last tokens are protected.
"""

from __future__ import annotations

import re
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
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.instrumentation.events.llm import LLMPredictEndEvent, LLMPredictStartEvent
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.schema import NodeWithScore, QueryBundle
from llama_index.core.types import TokenAsyncGen, TokenGen
from specprefill_rag import GenerationResult, Passage, Segment, SegmentKind, SpecPrefillEngine
from specprefill_rag.backends.vllm_server import DEFAULT_MAX_RETRIES
from specprefill_rag.engine import LazyEngine, Mode
from specprefill_rag.prompt import build_segments, chat_segments, split_documents
from specprefill_rag.types import RETRIEVER_SCORE_KEY

__all__ = ["PassageIdPostprocessor", "SpecPrefillLLM", "split_context"]

dispatcher = instrument.get_dispatcher(__name__)

DEFAULT_PASSAGE_ID_KEY = "passage_id"
DEFAULT_PASSAGE_SCORE_KEY = "passage_score"


def split_context(
    context_str: str, id_key: str = DEFAULT_PASSAGE_ID_KEY, score_key: str = DEFAULT_PASSAGE_SCORE_KEY
) -> list[Passage]:
    """Passages of a query engine's ``context_str`` (the rule in the module docstring).

    A ``score_key`` line right after a node's id marker (written by ``PassageIdPostprocessor``)
    becomes the passage's ``metadata[RETRIEVER_SCORE_KEY]`` (the retriever's score, which
    ``SelectionConfig.retriever_weight`` can weigh) and is removed from the text.
    """
    marker = re.compile(rf"^{re.escape(id_key)}: *(\S+?) *$", re.MULTILINE)
    score_line = re.compile(rf"\s*{re.escape(score_key)}: *(-?[0-9.eE+-]+) *(?:\n|$)")
    marks = list(marker.finditer(context_str))
    if not marks:
        return split_documents(context_str)
    passages = []
    head = context_str[: marks[0].start()].strip()
    if head:  # text before the first node (a repacked chunk that starts mid-node)
        passages.append(Passage(text=head))
    ends = [m.start() for m in marks[1:]] + [len(context_str)]
    for mark, end in zip(marks, ends, strict=True):
        text = context_str[mark.end() : end]
        metadata = {}
        scored = score_line.match(text)
        if scored:
            try:
                metadata[RETRIEVER_SCORE_KEY] = float(scored.group(1))
                text = text[scored.end() :]
            except ValueError:
                pass
        if text.strip():
            passages.append(Passage(text=text.strip(), id=mark.group(1), metadata=metadata))
    return passages


class PassageIdPostprocessor(BaseNodePostprocessor):
    """Puts each node's id first in its LLM-visible metadata, so ``SpecPrefillLLM`` can cut
    ``context_str`` back into nodes and report kept spans per node id, and the retriever's score
    second (read back as ``Passage.metadata[RETRIEVER_SCORE_KEY]``, never shown to the model). Nodes are
    copied."""

    id_key: str = Field(default=DEFAULT_PASSAGE_ID_KEY, description="Metadata key of the marker line.")
    score_key: str | None = Field(
        default=DEFAULT_PASSAGE_SCORE_KEY, description="Metadata key of the retriever-score line; None: no score."
    )

    @classmethod
    def class_name(cls) -> str:
        return "PassageIdPostprocessor"

    def _postprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        marked = []
        for item in nodes:
            node = item.node
            marks = {self.id_key: node.node_id}
            if self.score_key and item.score is not None:
                marks[self.score_key] = f"{item.score:.6g}"
            metadata = {**marks, **{k: v for k, v in node.metadata.items() if k not in marks}}
            excluded = [k for k in node.excluded_llm_metadata_keys if k not in marks]
            copy = node.model_copy(update={"metadata": metadata, "excluded_llm_metadata_keys": excluded})
            marked.append(NodeWithScore(node=copy, score=item.score))
        return marked


class SpecPrefillLLM(CustomLLM):
    """LlamaIndex LLM whose prompts are prefilled with Speculative Prefill.

    Pass a ready ``engine`` (shares loaded models), or ``model_name`` (and optionally
    ``draft_model``) to have one built on first use with ``SpecPrefillEngine.from_pretrained``.
    ``CompletionResponse.additional_kwargs`` holds timings, keep ratio and kept spans.
    """

    model_name: str | None = Field(default=None, description="Main model (packaged name, HF dir or GGUF).")
    draft_model: str | None = Field(default=None, description="Draft model; None serves mode='full' only.")
    backend: str = Field(default="transformers", description="Main-model backend, by registry name.")
    mode: Mode = Field(default="specprefill", description="'full' = the baseline.")
    keep_rate: float | None = Field(
        default=None,
        description="Fraction of the context (retrieved passages, history) prefilled; the question always is.",
    )
    instructions: str | None = Field(
        default=None, description="Instructions for query-engine calls without system_prompt; None = engine's."
    )
    max_new_tokens: int | None = Field(default=None, description="Max generated tokens; None = engine default.")
    temperature: float | None = Field(default=None, description="0 = greedy; None = engine default.")
    timeout: float | None = Field(
        default=None,
        description="Seconds for the whole call (draft, prefill, every token, retries); then BackendTimeoutError.",
    )
    max_retries: int = Field(
        default=DEFAULT_MAX_RETRIES,
        description="Retries of a failed connection or a 502/503/504 before the first token, by the "
        "vllm_server backend this LLM builds (never a 4xx; the draft's plan is re-sent, not recomputed).",
    )
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
        instructions = self.system_prompt or self.instructions or self.engine.config.instructions
        return list(build_segments(question, passages, instructions))

    def _prompt_segments(self, prompt: str) -> list[Segment]:
        """A plain prompt: one prunable context segment after the ``system_prompt``, if any."""
        if not prompt.strip():
            raise ValueError("the prompt is empty")
        system = (self.system_prompt or "").strip()
        return [*([Segment(SegmentKind.INSTRUCTIONS, system)] if system else []), Segment(SegmentKind.CONTEXT, prompt)]

    def _chat_segments(self, messages: Sequence[ChatMessage]) -> list[Segment]:
        """System → instructions; last user message → question; earlier turns → history messages."""
        turns = [(str(m.role.value), m.content or "") for m in messages]
        return list(chat_segments(turns, instructions=self.system_prompt))

    def _request(self, segments: list[Segment], kwargs: dict[str, Any]) -> dict[str, Any]:
        kwargs = dict(kwargs)
        kwargs.pop("formatted", None)
        generation = self.engine.config.generation.with_overrides(
            max_new_tokens=kwargs.pop("max_new_tokens", self.max_new_tokens),
            temperature=kwargs.pop("temperature", self.temperature),
            timeout=kwargs.pop("timeout", self.timeout),
            stop=kwargs.pop("stop", None) or None,
        )
        mode = kwargs.pop("mode", self.mode)
        keep_rate = kwargs.pop("keep_rate", self.keep_rate)
        if kwargs:
            raise TypeError(f"unexpected arguments for SpecPrefillLLM: {sorted(kwargs)}")
        return {"question": segments, "mode": mode, "keep_rate": keep_rate, "generation": generation}

    def _response(self, result: GenerationResult) -> CompletionResponse:
        facts = {"model_name": str(self.model_name), **result.to_dict()}  # counts, keep ratio, timings, spans
        return CompletionResponse(text=result.text, additional_kwargs=facts)

    def _last_chunk(self, text: str, result: GenerationResult | None) -> CompletionResponse:
        """The stream's closing chunk: no new text, the result's metadata."""
        assert result is not None
        return CompletionResponse(text=text, delta="", additional_kwargs=self._response(result).additional_kwargs)

    def _run(self, segments: list[Segment], kwargs: dict[str, Any]) -> CompletionResponse:
        return self._response(self.engine.generate(**self._request(segments, kwargs)))

    async def _arun(self, segments: list[Segment], kwargs: dict[str, Any]) -> CompletionResponse:
        return self._response(await self.engine.agenerate(**self._request(segments, kwargs)))

    def _run_stream(self, segments: list[Segment], kwargs: dict[str, Any]) -> CompletionResponseGen:
        stream = self.engine.stream(**self._request(segments, kwargs))

        def gen() -> CompletionResponseGen:
            with stream:
                for delta in stream:
                    yield CompletionResponse(text=stream.text, delta=delta)
            yield self._last_chunk(stream.text, stream.result)

        return gen()

    async def _arun_stream(self, segments: list[Segment], kwargs: dict[str, Any]) -> CompletionResponseAsyncGen:
        stream = await self.engine.astream(**self._request(segments, kwargs))

        async def gen() -> CompletionResponseAsyncGen:
            async with stream:
                async for delta in stream:
                    yield CompletionResponse(text=stream.text, delta=delta)
            yield self._last_chunk(stream.text, stream.result)

        return gen()

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
        response = self._run(self._chat_segments(messages), kwargs)
        return ChatResponse(
            message=ChatMessage(role=MessageRole.ASSISTANT, content=response.text),
            additional_kwargs=response.additional_kwargs,
        )

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        completions = self._run_stream(self._chat_segments(messages), kwargs)

        def gen() -> ChatResponseGen:
            for r in completions:
                message = ChatMessage(role=MessageRole.ASSISTANT, content=r.text)
                yield ChatResponse(message=message, delta=r.delta, additional_kwargs=r.additional_kwargs)

        return gen()

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        response = await self._arun(self._chat_segments(messages), kwargs)
        return ChatResponse(
            message=ChatMessage(role=MessageRole.ASSISTANT, content=response.text),
            additional_kwargs=response.additional_kwargs,
        )

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        completions = await self._arun_stream(self._chat_segments(messages), kwargs)

        async def gen() -> ChatResponseAsyncGen:
            async for r in completions:
                message = ChatMessage(role=MessageRole.ASSISTANT, content=r.text)
                yield ChatResponse(message=message, delta=r.delta, additional_kwargs=r.additional_kwargs)

        return gen()

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
