"""Engine streams as LlamaIndex responses: completion chunks (the text so far and each delta),
chat chunks, and with tools, the text before the first call only (the calls come parsed, in the
last chunk's message, as in a whole answer). Every stream ends with a chunk that carries the
answer's facts (``additional_kwargs``, ``raw``)."""

from __future__ import annotations

from collections.abc import Callable

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    MessageRole,
)
from specprefill_rag.adapters import AsyncTextStream, GenerationResult, TextStream

__all__ = ["achat_chunks", "acompletion_chunks", "chat_chunks", "completion_chunks"]


def completion_chunks(stream: TextStream, last: Callable[[str, GenerationResult], CompletionResponse]
                      ) -> CompletionResponseGen:
    """A completion stream: a response per delta (the text so far), then ``last(text, result)``."""
    with stream:
        for delta in stream:
            yield CompletionResponse(text=stream.text, delta=delta)
    assert stream.result is not None
    yield last(stream.text, stream.result)


async def acompletion_chunks(stream: AsyncTextStream, last: Callable[[str, GenerationResult], CompletionResponse]
                             ) -> CompletionResponseAsyncGen:
    """``completion_chunks`` over an async stream."""
    async with stream:
        async for delta in stream:
            yield CompletionResponse(text=stream.text, delta=delta)
    assert stream.result is not None
    yield last(stream.text, stream.result)


def _chunk(text: str, delta: str) -> ChatResponse:
    return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=delta)


def chat_chunks(stream: TextStream, shown: Callable[[str], str],
                last: Callable[[GenerationResult], ChatResponse]) -> ChatResponseGen:
    """A chat stream: a response per shown delta (the text so far), then ``last(result)``."""
    text = ""
    with stream:
        for raw in stream:
            if delta := shown(raw):
                text += delta
                yield _chunk(text, delta)
    assert stream.result is not None
    yield last(stream.result)


async def achat_chunks(stream: AsyncTextStream, shown: Callable[[str], str],
                       last: Callable[[GenerationResult], ChatResponse]) -> ChatResponseAsyncGen:
    """``chat_chunks`` over an async stream."""
    text = ""
    async with stream:
        async for raw in stream:
            if delta := shown(raw):
                text += delta
                yield _chunk(text, delta)
    assert stream.result is not None
    yield last(stream.result)
