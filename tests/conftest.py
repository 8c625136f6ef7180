"""Shared fixtures; the helpers behind them live in ``helpers`` (tests import that module, never
this one). Nothing here reads files."""

from __future__ import annotations

import os

import pytest
from helpers import make_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(params=["llama", "qwen2"])
def family(request):
    return request.param
