"""Test helpers: a tiny random engine (no files), real SmolLM2-135M (draft = main), MiniLM embeddings."""

from __future__ import annotations

import functools
from typing import Any

from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMCompletionEndEvent
from specprefill_rag import (
    SpecPrefillEngine,
    testing,
)


@functools.lru_cache(maxsize=1)
def tiny_engine() -> SpecPrefillEngine:
    """A 2-layer random Llama as draft and main, with a small trained BPE tokenizer."""
    return testing.tiny_engine(max_position_embeddings=4096)


@functools.lru_cache(maxsize=1)
def tiny_cross_family_engine() -> SpecPrefillEngine:
    """The tiny engine with a draft from "another family" (own tokenizer and chat template)."""
    return testing.tiny_engine(max_position_embeddings=4096, cross_family=True)


@functools.lru_cache(maxsize=1)
def smollm_engine() -> SpecPrefillEngine:
    """Real SmolLM2-135M-Instruct; one set of weights serves as draft and main."""
    return testing.small_real_engine(max_new_tokens=48)




class CompletionRecorder(BaseEventHandler):
    """Keeps every ``CompletionResponse`` the instrumentation reports (additional_kwargs included)."""

    responses: list[Any] = []

    @classmethod
    def class_name(cls) -> str:
        return "CompletionRecorder"

    def handle(self, event: Any, **kwargs: Any) -> None:
        if isinstance(event, LLMCompletionEndEvent):
            self.responses.append(event.response)


@functools.lru_cache(maxsize=1)
def tiny_tool_engine() -> SpecPrefillEngine:
    """The tiny engine with a chat template that renders tools (Qwen2.5's way: ``<tool_call>``)."""
    return testing.tiny_engine(max_position_embeddings=4096, tools=True)


def scripted_engine(text: str, *then: str) -> SpecPrefillEngine:
    """The tiny tool-calling engine (its draft scores for real) whose main model writes ``text``,
    then each of ``then`` (``testing.ScriptedBackend``)."""
    inner = tiny_tool_engine()
    return SpecPrefillEngine(testing.ScriptedBackend(inner.backend, text, *then), inner.draft, inner.config)


def tiny_reading_engine() -> SpecPrefillEngine:
    """``testing.tiny_reading_engine``: a draft that reads passages apart, a fresh store each call."""
    return testing.tiny_reading_engine(max_position_embeddings=4096)
