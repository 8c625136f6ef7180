"""LangChain's standard integration suite for ChatSpecPrefill on real SmolLM2-135M (draft = main)."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests
from lc_helpers import smollm_engine

from langchain_specprefill import ChatSpecPrefill

pytestmark = [pytest.mark.real_model, pytest.mark.full]


class TestChatSpecPrefillIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatSpecPrefill]:
        return ChatSpecPrefill

    @property
    def chat_model_params(self) -> dict[str, Any]:
        # max_tokens stays small: the suite makes ~25 calls on a 2-core CPU.
        return {"engine": smollm_engine(), "max_tokens": 8}

    # The model under test is SmolLM2, whose chat template renders no tools: ChatSpecPrefill
    # refuses tools on it (InputError), so the tool-calling and structured-output tests are off
    # here. They run on the Qwen pair in test_standard_tools_qwen.py, and in the unit suite.
    @property
    def has_tool_calling(self) -> bool:
        return False

    @property
    def has_structured_output(self) -> bool:
        return False

    @property
    def supports_model_override(self) -> bool:
        return False  # one engine per instance: loaded weights cannot be swapped per call
