"""Every public package exports exactly what its __all__ says."""

from __future__ import annotations

import importlib

import pytest

PACKAGES = [
    "specprefill_rag",
    "specprefill_rag.backends",
    "specprefill_rag.draft.batching",
    "specprefill_rag.compress",
    "specprefill_rag.config",
    "specprefill_rag.draft",
    "specprefill_rag.engine",
    "specprefill_rag.streams",
    "specprefill_rag.errors",
    "specprefill_rag.loading",
    "specprefill_rag.prompt",
    "specprefill_rag.prompt.length_guard",
    "specprefill_rag.prompt.render",
    "specprefill_rag.prompt.segments",
    "specprefill_rag.tools.retrieval",
    "specprefill_rag.draft.scoring",
    "specprefill_rag.payoff",
    "specprefill_rag.schema_limits",
    "specprefill_rag.selection",
    "specprefill_rag.types",
    "specprefill_rag.wire",
    "specprefill_rag.testing",
    "specprefill_rag.vllm_plugin",
    "specprefill_rag.vllm_plugin.admission",
    "specprefill_rag.vllm_plugin.runner",
    "specprefill_rag.tools.vllm_process",
    "specprefill_rag.backends.vllm_http",
    "specprefill_rag.backends.vllm_server",
    "specprefill_rag.backends.vllm_offline",
    "specprefill_rag.backends.openai_chat",
    "specprefill_rag.gateway",
    "specprefill_rag.gateway.admission",
    "specprefill_rag.gateway.app",
    "specprefill_rag.gateway.fields",
    "specprefill_rag.gateway.limits",
    "specprefill_rag.gateway.messages",
    "specprefill_rag.gateway.metrics",
    "specprefill_rag.gateway.openapi",
    "specprefill_rag.gateway.protocol",
    "specprefill_rag.gateway.responses",
    "specprefill_rag.gateway.runs",
    "specprefill_rag.gateway.text_mode",
    "specprefill_rag.gateway.tools",
]


@pytest.mark.parametrize("name", PACKAGES)
def test_all_names_resolve(name):
    module = importlib.import_module(name)
    assert module.__all__, name
    for symbol in module.__all__:
        assert hasattr(module, symbol), f"{name}.{symbol}"


EXPECTED_TOP_LEVEL = [
    "AssembledPrompt",
    "AsyncTextStream",
    "Backend",
    "BackendCapabilities",
    "BackendError",
    "BackendTimeoutError",
    "CompressedPassage",
    "Compression",
    "ConfigError",
    "ConfigTypeError",
    "DraftConfig",
    "DraftModel",
    "DraftRuntime",
    "GenerationConfig",
    "GenerationResult",
    "GrammarError",
    "InputError",
    "InputTypeError",
    "KeptSpan",
    "MissingDependencyError",
    "ModelNotFoundError",
    "Passage",
    "PassageReading",
    "PassagesRead",
    "PathChoice",
    "PlanError",
    "PlannedPrompt",
    "PluginMissingError",
    "PrefillPlan",
    "RequestOptions",
    "SchemaError",
    "ScoringConfig",
    "Segment",
    "SegmentKind",
    "SelectionConfig",
    "ServerError",
    "ServerStartError",
    "SpecPrefillConfig",
    "SpecPrefillEngine",
    "SpecPrefillError",
    "TextStream",
    "Timings",
    "TokenScores",
    "ToolCall",
    "ToolCallError",
    "UnsupportedVLLMError",
    "__version__",
    "available_backends",
    "create_backend",
    "register_backend",
]


def test_top_level_api_is_exactly_this_sorted_list():
    """A name joins or leaves the public API on purpose: this list changes with it."""
    import specprefill_rag as sp

    assert sp.__all__ == EXPECTED_TOP_LEVEL
    assert EXPECTED_TOP_LEVEL == sorted(EXPECTED_TOP_LEVEL)
    assert sp.__version__


def test_library_imports_no_optional_dependencies():
    import subprocess
    import sys

    code = (
        "import sys, specprefill_rag, specprefill_rag.engine, specprefill_rag.tools.retrieval;"
        "print(sorted(m for m in ('sentence_transformers', 'vllm', 'gguf') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
