"""LangChain's standard unit suite for ChatSpecPrefill (the engine is built lazily: never here)."""

from __future__ import annotations

from typing import Any

from langchain_tests.unit_tests import ChatModelUnitTests

from langchain_specprefill import ChatSpecPrefill


class TestChatSpecPrefillUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatSpecPrefill]:
        return ChatSpecPrefill

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model": "smollm2-135m-instruct", "draft_model": "smollm2-135m-instruct"}

    @property
    def has_tool_calling(self) -> bool:
        return True  # bind_tools: schemas through the chat template, calls parsed and validated

    @property
    def has_structured_output(self) -> bool:
        return True  # function calling (a forced call) or a JSON schema, decoded under a grammar

    @property
    def supports_model_override(self) -> bool:
        return False  # one engine per instance: loaded weights cannot be swapped per call
