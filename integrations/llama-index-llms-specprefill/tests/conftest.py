"""Offline settings for every test and the ``recorder`` fixture; helpers live in ``li_helpers``
(this folder is on sys.path)."""

import os

import pytest
from li_helpers import CompletionRecorder
from llama_index.core.instrumentation import get_dispatcher

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def recorder():
    """The completions the LLM under test made while the test ran (``CompletionRecorder``)."""
    handler = CompletionRecorder()
    root = get_dispatcher()
    root.add_event_handler(handler)
    yield handler
    root.event_handlers.remove(handler)
