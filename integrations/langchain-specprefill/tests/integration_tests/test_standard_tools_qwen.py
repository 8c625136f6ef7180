"""LangChain's standard tool-calling and structured-output tests for ChatSpecPrefill on the packaged
Qwen2.5-Coder pair (0.5B drafts for 1.5B, in-process), whose chat template renders tools: calls
and JSON answers are decoded under their grammar (docs/tools.md). Only those tests run here (the
rest of the suite runs on SmolLM2 in test_standard_integration.py): each call is a 1.5B decode on
a CPU, 20 tests in 10-30 min on 2 cores, so ``make test`` runs them once, in the core venv
(``SPECPREFILL_QWEN_TOOL_SUITE=1``), not again in the client venv."""

from __future__ import annotations

import os
from typing import Any

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests
from lc_helpers import qwen_engine

from langchain_specprefill import ChatSpecPrefill

pytestmark = [pytest.mark.real_model, pytest.mark.skipif(
    not os.environ.get("SPECPREFILL_QWEN_TOOL_SUITE"),
    reason="the Qwen tool suite runs once per make test, in the core venv (SPECPREFILL_QWEN_TOOL_SUITE=1)")]

TOOLS_AND_STRUCTURE = ("tool", "structured", "json_mode", "bind_runnables")


@pytest.fixture(autouse=True)
def only_tools_and_structure(request: pytest.FixtureRequest) -> None:
    if not any(word in request.node.name for word in TOOLS_AND_STRUCTURE):
        pytest.skip("runs on SmolLM2 in test_standard_integration.py")


class TestChatSpecPrefillQwenTools(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatSpecPrefill]:
        return ChatSpecPrefill

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"engine": qwen_engine(), "max_tokens": 96}

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supports_model_override(self) -> bool:
        return False
