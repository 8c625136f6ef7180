"""``ragcompress`` (PyPI, extractive and provenance-preserving) as a peer in ``bench quality``.

It keeps whole sentences as SpecPrefill's text mode does, so it is the closest peer: a question-
conditioned sentence scorer and a token budget. Offline deviations from a stock ``Compressor()``:

- its default scorer is a cross-encoder from the Hugging Face hub (not reachable here): it runs
  its own ``AttentionScorer`` instead (``ragcompress[attention]``: sentences, then the question,
  one forward pass, the question's last-layer attention per sentence), on the **same draft LM**
  as SpecPrefill and LongLLMLingua. That scorer needs attention weights, which SDPA does not
  return: it gets an eager-attention copy of the draft's transformer (the body, no LM head);
- token counts (its budget) use the draft's tokenizer, not tiktoken's cl100k_base (a download),
  so the budget is in the same tokens as LongLLMLingua's;
- duplicates are dropped lexically (``dedup_threshold`` 0.9, its default without an embedder).

The kept sentences go back to the main model per passage, in order, as text mode's do.
"""

from __future__ import annotations

import copy
import importlib.metadata
import time
from collections.abc import Sequence
from typing import Any

import torch

RAGCOMPRESS_VERSION = "0.1.0"  # the version whose Compressor / AttentionScorer API this wraps


class RagCompressPeer:
    """``ragcompress.Compressor`` with ``AttentionScorer`` on a copy of ``model`` (a causal LM)."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        try:
            from ragcompress.scoring.attention import AttentionScorer
        except ImportError:
            raise SystemExit(
                f"ragcompress is missing: pip install ragcompress=={RAGCOMPRESS_VERSION} (the bench extra)"
            ) from None
        version = importlib.metadata.version("ragcompress")
        if version != RAGCOMPRESS_VERSION:
            print(f"warning: ragcompress {version} (written for {RAGCOMPRESS_VERSION}); its API may differ", flush=True)
        body = copy.deepcopy(getattr(model, "model", model))  # the transformer without its LM head
        body.set_attn_implementation("eager")
        self._tokenizer = tokenizer
        self._scorer = AttentionScorer(body.eval(), tokenizer, max_length=1 << 16)

    def count(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False))

    def compress(self, passages: Sequence[tuple[str, str]], question: str, target_tokens: int
                 ) -> tuple[list[tuple[str, str]], float]:
        """``(id, text)`` per passage that kept a sentence (its kept sentences in order, joined by
        spaces) under a budget of ``target_tokens``, and the seconds it took."""
        from ragcompress import Chunk, Compressor, FixedBudget

        compressor = Compressor(scorer=self._scorer, budget=FixedBudget(max_tokens=max(int(target_tokens), 1)),
                                token_counter=self.count)
        chunks = [Chunk(doc_id=str(i), chunk_id=str(i), text=text) for i, (_, text) in enumerate(passages)]
        start = time.perf_counter()
        with torch.inference_mode():
            result = compressor.compress(question, chunks)
        seconds = time.perf_counter() - start
        kept: dict[str, list[str]] = {}
        for sentence in result.sentences:  # in reading order already
            kept.setdefault(sentence.source_chunk_id, []).append(sentence.text)
        return [(pid, " ".join(kept[str(i)])) for i, (pid, _) in enumerate(passages) if str(i) in kept], seconds
