"""Shared fixtures: a tiny in-memory tokenizer with a chat template and tiny random models
(``specprefill_rag.testing``). Nothing here reads files."""

from __future__ import annotations

import os

import pytest

from specprefill_rag.testing import tiny_model, tiny_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CORPUS = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Context: passages retrieved for the question. Answer the question using the context.",
    "Question: what is the passkey? The passkey is 48213. Remember it.",
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.",
    "Alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho.",
    "0123456789 [1] [2] [3] system user assistant instructions be concise",
]


def make_tokenizer():
    return tiny_tokenizer(CORPUS, vocab_size=400)


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


def make_model(family: str, vocab_size: int, *, seed: int = 0, layers: int = 3, eos_token_id: int | None = None):
    # Sharper attention than the default init, so scores are not nearly uniform.
    return tiny_model(family, vocab_size, seed=seed, layers=layers, eos_token_id=eos_token_id, qk_scale=8.0)


@pytest.fixture(params=["llama", "qwen2"])
def family(request):
    return request.param
