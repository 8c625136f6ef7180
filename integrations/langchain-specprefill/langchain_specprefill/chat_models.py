"""``ChatSpecPrefill``: a LangChain chat model over a ``SpecPrefillEngine``.

A translation layer only: LangChain messages become prompt segments, the engine does the
work, and its ``GenerationResult`` becomes an ``AIMessage`` with usage and SpecPrefill
metadata. How messages map to segments (see docs/integrations.md):

- system messages → the instructions (protected); without one, ``instructions`` if set;
- the last human message → the question (protected);
- earlier human and AI turns → history segments with id ``turn-<i>``, each rendered as the chat
  message it was (kept whole unless ``SelectionConfig.protect_history`` is False);
- with tools bound (``bind_tools``), AI tool calls or ``ToolMessage``s: the chat goes through the
  template's tool rendering (``specprefill_rag.prompt.message_segments``, docs/tools.md): tool
  schemas and AI tool calls protected, each tool result one prunable segment per document (the
  ``Document``s of a ``ToolMessage.artifact`` keep their ids); without tools, a tool message is a
  prunable context segment ``"Tool: <text>"``;
- ``passages=[Document | Passage | str, ...]`` passed to ``invoke``/``stream`` (or ``bind``)
  → one prunable passage segment each, with the document's id (else its 1-based number).

``read_documents`` reads documents into the draft's passage store ahead of the calls that will
send them as passages (beside ``vector_store.add_documents``), when the engine's draft reads
passages apart (``DraftConfig(passages=PassageReading())``). ``bind_tools`` and
``with_structured_output`` are ``tool_calling.ToolCallingMixin``'s.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any, TypeAlias

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ToolMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import ConfigDict, Field, PrivateAttr, model_validator
from specprefill_rag.adapters import (
    OPTIONS,
    GenerationResult,
    InputTypeError,
    LazyEngine,
    Mode,
    Passage,
    PassagesRead,
    Segment,
    SpecPrefillEngine,
    answer_report,
    content_filter,
    message_segments,
    option,
    to_passage,
)

from .tool_calling import ToolCallingMixin

__all__ = ["ChatSpecPrefill", "messages_to_segments"]


PassageLike: TypeAlias = Document | Passage | str


def _to_passage(item: PassageLike, number: int) -> Passage | str:
    """A Document as a Passage (its id, else the core numbers it); Passages and str as they are."""
    if isinstance(item, Document):
        return to_passage(item.page_content, item.id, item.metadata)
    if isinstance(item, (Passage, str)):
        return item
    raise InputTypeError(f"passage {number - 1} must be a Document, Passage or str, got {type(item).__name__}")


def _openai_message(message: BaseMessage) -> dict[str, Any]:
    """A LangChain message as the core's OpenAI-style message (tool calls, tool call id, the
    documents of a retriever tool's artifact)."""
    out: dict[str, Any] = {"role": message.type, "content": message.text}
    if isinstance(message, AIMessage) and message.tool_calls:
        out["tool_calls"] = [{"id": c.get("id"), "name": c["name"], "arguments": c["args"]} for c in message.tool_calls]
    if isinstance(message, ToolMessage):
        out["role"], out["tool_call_id"] = "tool", message.tool_call_id
        artifact = message.artifact
        if isinstance(artifact, list) and artifact and all(isinstance(d, Document) for d in artifact):
            out["documents"] = [to_passage(d.page_content, d.id, d.metadata) for d in artifact]
    return out


def messages_to_segments(
    messages: Sequence[BaseMessage],
    passages: Sequence[PassageLike] | PassageLike = (),
    *,
    default_instructions: str | None = None,
    tools: Sequence[Mapping[str, Any]] = (),
) -> list[Segment]:
    """Engine segments for a chat turn (the mapping in the module docstring); one Document,
    Passage or str alone is one passage. ``tools``: OpenAI-format tools offered to the model."""
    if isinstance(passages, (str, Document, Passage)):
        passages = [passages]
    elif isinstance(passages, (Mapping, bytes)):
        raise InputTypeError(f"passages must be a list of Documents, Passages or str, got {type(passages).__name__}")
    items = [_to_passage(item, number) for number, item in enumerate(passages, start=1)]
    chat = [_openai_message(m) for m in messages]
    return list(message_segments(chat, tools, items, instructions=default_instructions))


class ChatSpecPrefill(ToolCallingMixin, BaseChatModel):
    """Chat model whose prompts are prefilled with Speculative Prefill.

    Pass a ready ``engine`` (shares loaded models), or ``model`` (and optionally
    ``draft_model``) to have one built on first use with ``SpecPrefillEngine.from_pretrained``.

    Example:
        ```python
        from langchain_specprefill import ChatSpecPrefill

        llm = ChatSpecPrefill(model="smollm2-135m-instruct", draft_model="smollm2-135m-instruct")
        llm.invoke("Who runs the station?", passages=docs)
        ```
    """

    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True)

    engine: SpecPrefillEngine | None = option("engine", exclude=True)
    # The alias stays a literal Field argument: type checkers read the constructor's names from it.
    model_name: str | None = Field(default=None, alias="model", description=OPTIONS["model_name"].description)
    draft_model: str | None = option("draft_model")
    backend: str = option("backend")
    mode: Mode = option("mode")
    keep_rate: float | None = option("keep_rate")
    instructions: str | None = Field(default=None, description="System text used when no system message.")
    temperature: float | None = option("temperature")
    max_tokens: int | None = option("max_tokens")
    top_p: float | None = Field(default=None, description="Nucleus sampling mass; None = engine default.")
    seed: int | None = Field(default=None, description="Sampling seed.")
    stop: list[str] | None = Field(default=None, description="Stop strings (text is cut before them).")
    timeout: float | None = option("timeout")
    max_retries: int = option("max_retries")
    streaming: bool = Field(default=False, description="invoke() streams internally (callbacks see tokens).")

    _lazy: LazyEngine = PrivateAttr(default_factory=LazyEngine)

    @model_validator(mode="after")
    def _check_source(self) -> ChatSpecPrefill:
        if self.engine is None and not self.model_name:
            raise ValueError("pass engine=SpecPrefillEngine(...) or model='<name, dir or GGUF>'")
        if self.model_name is None and self.engine is not None:
            self.model_name = self.engine.backend.model_name
        return self

    # -- LangChain metadata ---------------------------------------------------------------

    @property
    def _llm_type(self) -> str:
        return "specprefill"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "draft_model": self.draft_model,
            "backend": self.backend,
            "mode": self.mode,
            "keep_rate": self.keep_rate,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="specprefill",
            ls_model_name=str(kwargs.get("model") or self.model_name),
            ls_model_type="chat",
            ls_temperature=kwargs.get("temperature", self.temperature),
        )
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if max_tokens is not None:
            params["ls_max_tokens"] = max_tokens
        stop = stop if stop is not None else self.stop
        if stop:
            params["ls_stop"] = stop
        return params

    # -- translation ----------------------------------------------------------------------

    def _get_engine(self) -> SpecPrefillEngine:
        """The engine; built once on first use, even when many threads call at once."""
        if self.engine is None:
            assert self.model_name is not None
            self.engine = self._lazy.get(self.model_name, self.draft_model, backend=self.backend,
                                         max_retries=self.max_retries)
        return self.engine

    def _request(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Keyword arguments for ``engine.stream`` from messages, fields and per-call kwargs."""
        model = kwargs.pop("model", None)
        if model is not None and model != self.model_name:
            raise ValueError(
                f"ChatSpecPrefill serves one engine ({self.model_name}); a per-call model "
                f"override ({model!r}) is not supported: build another ChatSpecPrefill"
            )
        engine = self._get_engine()
        passages = kwargs.pop("passages", None) or ()
        tools = kwargs.pop("tools", None) or ()
        tool_choice = kwargs.pop("tool_choice", None) or "auto"
        parallel = kwargs.pop("parallel_tool_calls", None)  # None: the engine's own setting
        grammar = kwargs.pop("grammar", None)
        kwargs.pop("ls_structured_output_format", None)  # LangSmith's tracing hint
        default = engine.config.instructions if passages else None
        segments = messages_to_segments(messages, passages, default_instructions=self.instructions or default,
                                        tools=tools)
        stop = stop if stop is not None else self.stop
        generation = engine.config.generation.with_overrides(
            temperature=kwargs.pop("temperature", self.temperature),
            max_new_tokens=kwargs.pop("max_tokens", self.max_tokens),
            top_p=kwargs.pop("top_p", self.top_p),
            seed=kwargs.pop("seed", self.seed),
            timeout=kwargs.pop("timeout", self.timeout),
            stop=stop,
            tool_choice=tool_choice,
            parallel_tool_calls=parallel,
            grammar=grammar,
        )
        mode = kwargs.pop("mode", self.mode)
        keep_rate = kwargs.pop("keep_rate", self.keep_rate)
        if kwargs:
            raise TypeError(f"unexpected arguments for ChatSpecPrefill: {sorted(kwargs)}")
        return {"question": segments, "mode": mode, "keep_rate": keep_rate, "generation": generation}

    def _final_chunk(self, result: GenerationResult) -> ChatGenerationChunk:
        usage = UsageMetadata(
            input_tokens=result.prompt_tokens,
            output_tokens=result.generated_tokens,
            total_tokens=result.prompt_tokens + result.generated_tokens,
        )
        metadata = answer_report(self.model_name, result)  # counts, keep ratio, timings, spans
        calls = [tool_call_chunk(name=c.name, args=json.dumps(dict(c.arguments)), id=c.id, index=n)
                 for n, c in enumerate(result.tool_calls)]
        message = AIMessageChunk(content="", usage_metadata=usage, response_metadata=metadata, chunk_position="last",
                                 tool_call_chunks=calls)
        return ChatGenerationChunk(message=message, generation_info={"finish_reason": result.finish_reason})

    def _shown(self, request: dict[str, Any]) -> Callable[[str], str]:
        """What of each streamed delta to show (``toolcalls.content_filter``)."""
        return content_filter(request["question"], self._get_engine().tokenizer)

    # -- reading ahead ----------------------------------------------------------------------

    def read_documents(self, documents: Sequence[PassageLike] | PassageLike, *, instructions: str | None = None
                       ) -> PassagesRead:
        """Read ``documents`` into the draft's passage store now (``SpecPrefillEngine.read_passages``),
        as calls with them as ``passages`` (``create_specprefill_rag_chain``'s) will send them, so those
        calls cost the draft only their other tokens. ``instructions``: the system message those calls
        send (the chain's ``instructions``); None: this model's ``instructions``, else the engine's, as
        such a call without a system message has. Returns the passages found already and read now."""
        engine = self._get_engine()
        if isinstance(documents, (str, Document, Passage)):  # one alone is one passage, as in ``passages=``
            documents = [documents]
        items = [_to_passage(item, number) for number, item in enumerate(documents, start=1)]
        return engine.read_passages(items, instructions=instructions or self.instructions or engine.config.instructions,
                                    cache_salt=engine.config.generation.cache_salt)

    async def aread_documents(self, documents: Sequence[PassageLike] | PassageLike, *,
                              instructions: str | None = None) -> PassagesRead:
        """``read_documents`` in a worker thread (the event loop is never blocked)."""
        return await asyncio.to_thread(self.read_documents, documents, instructions=instructions)

    # -- LangChain entry points -----------------------------------------------------------

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        request = self._request(messages, stop, kwargs)
        with self._get_engine().stream(**request) as stream:
            for delta in map(self._shown(request), stream):
                if not delta:
                    continue
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta))
                if run_manager:
                    run_manager.on_llm_new_token(delta, chunk=chunk)
                yield chunk
        assert stream.result is not None
        yield self._final_chunk(stream.result)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        request = self._request(messages, stop, kwargs)
        engine = await asyncio.to_thread(self._get_engine)  # a first call loads models off the loop
        async with await engine.astream(**request) as stream:
            shown = self._shown(request)
            async for raw in stream:
                if not (delta := shown(raw)):
                    continue
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta))
                if run_manager:
                    await run_manager.on_llm_new_token(delta, chunk=chunk)
                yield chunk
        assert stream.result is not None
        yield self._final_chunk(stream.result)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        chunks = list(self._stream(messages, stop, run_manager if self.streaming else None, **kwargs))
        return _chat_result(chunks)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        stream = self._astream(messages, stop, run_manager if self.streaming else None, **kwargs)
        return _chat_result([chunk async for chunk in stream])


def _chat_result(chunks: Sequence[ChatGenerationChunk]) -> ChatResult:
    """One ``AIMessage`` from the streamed chunks (the last carries usage and metadata)."""
    final = chunks[-1]
    text = "".join(str(c.message.content) for c in chunks)
    last: Mapping[str, Any] = final.message.response_metadata
    calls = [{"name": c["name"], "args": json.loads(c["args"] or "{}"), "id": c["id"], "type": "tool_call"}
             for c in getattr(final.message, "tool_call_chunks", [])]
    message = AIMessage(
        content=text.strip() if calls else text,
        usage_metadata=getattr(final.message, "usage_metadata", None),
        response_metadata=dict(last),
        tool_calls=calls,
    )
    return ChatResult(generations=[ChatGeneration(message=message, generation_info=final.generation_info)])
