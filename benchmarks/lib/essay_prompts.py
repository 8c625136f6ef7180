"""The prompts ``bench ttft`` (and ``bench reuse``) time: Paul Graham essay text cut into passages
of ``PASSAGE_TOKENS`` tokens, assembled with ``QUESTION`` to about a target length.
"""

from __future__ import annotations

from typing import Any

from benchmarks.lib.datasets import essay_text

QUESTION = "According to these essays, what should the founders of a startup do first, and why?"
PASSAGE_TOKENS = 256  # tokens per synthetic passage


def essay_passages(tokenizer: Any, n_tokens: int) -> list[str]:
    """About ``n_tokens`` tokens of essay text, cut into passages of PASSAGE_TOKENS tokens."""
    text = essay_text()[: n_tokens * 8]
    ids = tokenizer.encode(text, add_special_tokens=False)[:n_tokens]
    return [tokenizer.decode(ids[i : i + PASSAGE_TOKENS]) for i in range(0, len(ids), PASSAGE_TOKENS)]


def build_passages(engine: Any, target: int) -> tuple[list[str], int]:
    """Passages whose assembled prompt (with QUESTION) has about ``target`` tokens."""
    overhead = engine.assemble(QUESTION, ["x"]).n_tokens
    passages = essay_passages(engine.tokenizer, max(target - overhead, 16))
    n = engine.assemble(QUESTION, passages).n_tokens
    # Per-passage headers add a few tokens each; trim the last passage so we land on the target.
    while n > target and passages:
        ids = engine.tokenizer.encode(passages[-1], add_special_tokens=False)
        cut = min(len(ids), n - target)
        passages[-1] = engine.tokenizer.decode(ids[: len(ids) - cut])
        if not passages[-1].strip():
            passages.pop()
        n = engine.assemble(QUESTION, passages).n_tokens
        if cut == 0:
            break
    return passages, n

def essay_passages_ids(tokenizer: Any, n_tokens: int) -> list[int]:
    ids = tokenizer.encode(essay_text()[: n_tokens * 8], add_special_tokens=False)[:n_tokens]
    return list(ids)
