"""Test helpers: a tiny random engine (no files), real SmolLM2-135M (draft = main), MiniLM embeddings."""

from __future__ import annotations

import functools
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from langchain_core.callbacks import CallbackManagerForRetrieverRun  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from langchain_core.retrievers import BaseRetriever  # noqa: E402
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





QUESTION = "Which city hosts the lantern festival?"
CORPUS = [
    "The river runs north. Boats carry grain to the mills. The mills grind it at night.",
    "Lanterns fill the sky in Hoian every spring! Visitors come from far away. Street food is sold until dawn.",
    "Cats sleep most of the day. Dogs bark at the postman. Birds sing before sunrise; owls sing at night.",
    "The festival began centuries ago. Its lanterns are made of silk and bamboo. The city glows for a week.",
    "Trains leave the station every hour. The last one departs at midnight. Tickets are sold on board.",
]


def corpus_documents() -> list[Document]:
    """The corpus as Documents, each with an id and its own metadata."""
    return [Document(text, id=f"doc-{i}", metadata={"source": f"{i}.txt", "rank": i}) for i, text in enumerate(CORPUS)]


class KeywordRetriever(BaseRetriever):
    """Ranks ``CORPUS`` by words shared with the query (ties in corpus order); ``k`` documents,
    also per call: what a compression retriever wraps in the tests."""

    k: int = 4

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, k: int | None = None
    ) -> list[Document]:
        words = set(query.lower().split())
        ranked = sorted(corpus_documents(), key=lambda d: -len(words & set(d.page_content.lower().split())))
        return ranked[: k or self.k]


@functools.lru_cache(maxsize=1)
def demo_pair_engine() -> SpecPrefillEngine:
    """The packaged Qwen2.5-Coder pair (0.5B drafts for 1.5B), as ``make demo`` runs it."""
    from specprefill_rag.loading import DEFAULT_DRAFT, DEFAULT_MAIN

    return SpecPrefillEngine.from_pretrained(DEFAULT_MAIN, DEFAULT_DRAFT)


@functools.lru_cache(maxsize=1)
def qwen_engine() -> SpecPrefillEngine:
    """Qwen2.5-Coder-0.5B-Instruct drafting for itself (the packaged draft; one set of weights),
    whose chat template renders tools: the tool suite's answers need a real tool-trained model, not
    the 1.5B's size (a third of the CPU time per call)."""
    from specprefill_rag.loading import DEFAULT_DRAFT

    return SpecPrefillEngine.from_pretrained(DEFAULT_DRAFT, DEFAULT_DRAFT)


def tiny_reading_engine() -> SpecPrefillEngine:
    """``testing.tiny_reading_engine``: a draft that reads passages apart, a fresh store each call."""
    return testing.tiny_reading_engine(max_position_embeddings=2048)
