"""Test helpers: a tiny random engine (no files), real SmolLM2-135M (draft = main), MiniLM embeddings."""

from __future__ import annotations

import functools
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from langchain_core.embeddings import Embeddings  # noqa: E402
from specprefill_rag import (  # noqa: E402
    SpecPrefillEngine,
    testing,
)


@functools.lru_cache(maxsize=1)
def tiny_engine() -> SpecPrefillEngine:
    """A 2-layer random Llama as draft and main, with a small trained BPE tokenizer."""
    return testing.tiny_engine(max_position_embeddings=2048)


@functools.lru_cache(maxsize=1)
def tiny_cross_family_engine() -> SpecPrefillEngine:
    """The tiny engine with a draft from "another family" (own tokenizer and chat template)."""
    return testing.tiny_engine(max_position_embeddings=2048, cross_family=True)


@functools.lru_cache(maxsize=1)
def smollm_engine() -> SpecPrefillEngine:
    """Real SmolLM2-135M-Instruct; one set of weights serves as draft and main."""
    return testing.small_real_engine()


class MiniLMEmbeddings(Embeddings):
    """LangChain embeddings over the packaged all-MiniLM-L6-v2 (``load_embedder()``), offline."""

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        from specprefill_rag.tools.retrieval import load_embedder

        vectors = load_embedder().encode(texts, normalize_embeddings=True, show_progress_bar=False)
        return [v.tolist() for v in vectors]

    def embed_query(self, text: str) -> list[float]:
        return self.embed_documents([text])[0]
