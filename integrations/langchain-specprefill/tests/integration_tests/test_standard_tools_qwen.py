"""LangChain's standard tool-calling and structured-output tests for ChatSpecPrefill on
Qwen2.5-Coder-0.5B-Instruct drafting for itself (the packaged draft, in-process), whose chat
template renders tools: calls and JSON answers are decoded under their grammar (docs/tools.md).
Only those tests run here (the rest of the suite runs on SmolLM2 in
test_standard_integration.py): 20 tests in ~8 min on 2 cores in fp32 (the 1.5B main took ~19), so
``make test-all`` runs them once, in the core venv (``SPECPREFILL_QWEN_TOOL_SUITE=1``), not again
in the client venv. JSON mode's free-form joke runs on the demo pair (below)."""

from __future__ import annotations

import os
from typing import Any

import pytest
from langchain_core.language_models import BaseChatModel
from langchain_tests.integration_tests import ChatModelIntegrationTests
from lc_helpers import demo_pair_engine, qwen_engine

from langchain_specprefill import ChatSpecPrefill

pytestmark = [pytest.mark.real_model, pytest.mark.full, pytest.mark.skipif(
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

    def test_json_mode(self, model: BaseChatModel) -> None:
        """The standard test, on the demo pair (0.5B drafts for 1.5B): asked for a cat joke as JSON
        with no schema, the 0.5B repeats its setup until ``max_tokens`` and never writes the
        punchline (a valid object under the grammar, missing a key), which is the model, not the
        JSON mode under test."""
        super().test_json_mode(ChatSpecPrefill(engine=demo_pair_engine(), max_tokens=96))
