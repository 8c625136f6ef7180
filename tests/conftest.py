"""Shared fixtures; the helpers behind them live in ``helpers`` (tests import that module, never
this one). Nothing here reads files."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator

import pytest
from helpers import make_tokenizer
from servers import FakeServer, Script

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# Markers that say what a test starts besides real weights; each implies ``real_model``, so
# ``-m "not real_model"`` is the unit tests alone (tiny random models, no downloads).
COSTLY = ("vllm", "browser", "terminal", "install")


def pytest_collection_modifyitems(items):
    for item in items:
        if any(item.get_closest_marker(name) for name in COSTLY) and not item.get_closest_marker("real_model"):
            item.add_marker(pytest.mark.real_model)


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(params=["llama", "qwen2"])
def family(request):
    return request.param


@pytest.fixture
def serve() -> Iterator[Callable[[Script], FakeServer]]:
    """Start scripted fake vLLM servers (``servers.FakeServer``); all shut down after the test."""
    servers: list[FakeServer] = []

    def start(script: Script) -> FakeServer:
        server = FakeServer(script)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop.set()
        server.shutdown()
        server.server_close()
