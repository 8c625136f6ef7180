"""How much of the gold evidence a selection keeps: the gold spans on a prompt's tokens, the
library's selection from a variant's scores, and each variant's metrics per keep rate for one
example of ``bench evidence`` (``METRICS``; its scores read off the captured rows, or the
library default's scored in windows where the prompt is longer than the draft's window).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from benchmarks.lib.datasets import Example
from benchmarks.lib.evidence_capture import variant_scores
from benchmarks.lib.evidence_variants import Variant
from benchmarks.lib.machine import cold, model_dtype_name
from benchmarks.lib.results import prompt_digest
from specprefill_rag import DraftConfig, DraftModel, SelectionConfig
from specprefill_rag import selection as selection_lib
from specprefill_rag.errors import InputError
from specprefill_rag.types import AssembledPrompt, SegmentKind

METRICS = ("recall", "complete", "context_kept")  # the columns of each result entry


def span_masks(
    prompt: AssembledPrompt, ex: Example, spans: Sequence[tuple[int, int, int]]
) -> list[torch.Tensor]:
    """Token masks (n,) bool of each (passage index, start, end) character span of ``ex``."""
    seg_of_passage = [i for i, s in enumerate(prompt.segments) if s.kind is SegmentKind.PASSAGE]
    where = {segment: (a, b) for segment, a, b in prompt.segment_spans}
    starts, ends = prompt.offsets[:, 0], prompt.offsets[:, 1]
    masks = []
    for passage, a, b in spans:
        raw = ex.passages[passage][1]
        shift = len(raw) - len(raw.lstrip())  # segments hold stripped text
        base = where[seg_of_passage[passage]][0] - shift
        lo, hi = base + a, base + b
        masks.append((starts < hi) & (ends > lo) & (ends > starts))
    return masks


_EMBEDDER: list[Any] = []


def retriever_prior(prompt: AssembledPrompt, ex: Example) -> torch.Tensor:
    """(n_segments,) cosine similarity of the question to each passage under MiniLM (the demo
    retriever's embedder), NaN for other segments: what a dense retriever would have scored."""
    from specprefill_rag.tools.retrieval import load_embedder

    if not _EMBEDDER:
        _EMBEDDER.append(load_embedder())
    texts = [s.text for s in prompt.segments if s.kind is SegmentKind.PASSAGE]
    emb = _EMBEDDER[0].encode([ex.question, *texts], convert_to_tensor=True, normalize_embeddings=True)
    cosine = (emb[1:] @ emb[0]).float().cpu()
    prior = torch.full((len(prompt.segments),), float("nan"))
    prior[[i for i, s in enumerate(prompt.segments) if s.kind is SegmentKind.PASSAGE]] = cosine
    return prior


def gold_mask(prompt: AssembledPrompt, ex: Example) -> torch.Tensor:
    """(n,) bool: the tokens of ``ex``'s gold evidence."""
    evidence = span_masks(prompt, ex, ex.evidence)
    return torch.stack(evidence).any(0) if evidence else torch.zeros(prompt.n_tokens, dtype=torch.bool)


def kept_metrics(prompt: AssembledPrompt, ex: Example, scores: torch.Tensor, sel: SelectionConfig,
                 prior: torch.Tensor | None = None, gold: torch.Tensor | None = None) -> list[float]:
    """[recall, complete, context_kept] (``METRICS``) of the library's selection from ``scores``."""
    gold = gold_mask(prompt, ex) if gold is None else gold
    kept_idx = selection_lib.select(
        scores, prompt.protected, prompt.segment_index, sel, prompt.sentence_start, prior, prompt.cut_level,
    )
    kept = torch.zeros(prompt.n_tokens, dtype=torch.bool)
    kept[kept_idx] = True
    recall = float((kept & gold).sum()) / max(int(gold.sum()), 1)
    keys = span_masks(prompt, ex, ex.key)
    complete = all(float((kept & m).sum()) >= ex.key_share * float(m.sum()) for m in keys if m.any())
    context_kept = float((kept & ~prompt.protected).sum()) / max(prompt.n_context, 1)
    return [round(recall, 4), int(complete), round(context_kept, 4)]


def evaluate(
    prompt: AssembledPrompt, ex: Example, rows: dict[str, Any] | None, variants: Iterable[Variant],
    keep_rates: Sequence[float], seed: int, default: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Each variant's metrics per keep rate, its scores read off the captured ``rows``; ``default``:
    the library default's scores when they were computed instead (``default_scores``)."""
    gold = gold_mask(prompt, ex)
    results: dict[str, Any] = {}
    cache: dict[tuple[DraftConfig, str], torch.Tensor] = {}
    if default is not None:
        cache[DraftConfig(), "draft"] = default
    prior = retriever_prior(prompt, ex) if any(v.prior for v in variants) else None
    for v in variants:
        if v.scores == "random":
            scores = torch.rand(prompt.n_tokens, generator=torch.Generator().manual_seed(seed))
        elif v.scores == "oracle":
            scores = gold.float() + 1e-3 * torch.rand(prompt.n_tokens, generator=torch.Generator().manual_seed(seed))
        else:
            if (v.draft, v.scores) not in cache:
                assert rows is not None, f"{v.name} reads captured rows"
                cache[v.draft, v.scores] = variant_scores(rows, v.draft, "lens" if v.scores == "lens" else None)
            scores = cache[v.draft, v.scores]
        for keep in keep_rates:
            sel = dataclasses.replace(v.selection, keep_rate=keep)
            results[f"{v.name}@{keep:g}"] = kept_metrics(prompt, ex, scores, sel, prior if v.prior else None, gold)
    return results


def default_scores(
    draft: DraftModel, prompt: AssembledPrompt, window: int | None = None,
) -> tuple[torch.Tensor, int, float]:
    """(scores, windows read, seconds) of the library's default scoring of ``prompt`` through
    ``DraftModel.score``, as the engine reads it: in windows when it is longer than the draft's
    window (``window``: that window in tokens for the call; None: the draft's own)."""
    config = draft.model.config
    own = config.max_position_embeddings
    if window is not None:
        config.max_position_embeddings = window
    try:
        start = time.perf_counter()
        scored = draft.score(prompt.token_ids, question=prompt.positions_of(SegmentKind.QUESTION),
                             context=~prompt.protected, config=cold(DraftConfig()))
        return scored.scores, scored.windows, time.perf_counter() - start
    finally:
        config.max_position_embeddings = own


def windowed_variants(variants: Iterable[Variant]) -> list[Variant]:
    """The variants an example read in windows can be measured with: those scored by the library
    default (``default_scores``) and the draft-free baselines. The others read captured
    attention rows of one pass over the whole prompt, which a draft shorter than it cannot give."""
    default = DraftConfig()
    return [v for v in variants if v.scores in ("random", "oracle") or (v.scores == "draft" and v.draft == default)]


def windowed_record(draft: DraftModel, prompt: AssembledPrompt, ex: Example, variants: Iterable[Variant],
                    keep_rates: Sequence[float], seed: int) -> dict[str, Any] | None:
    """The results row of a prompt longer than the draft's window, read in windows as the engine
    reads it (``windowed_variants`` only); None when windows cannot hold its context."""
    try:
        scores, windows, seconds = default_scores(draft, prompt)
    except InputError:
        return None
    return {"task": ex.task, "id": ex.id, "n_prompt": prompt.n_tokens, "n_context": prompt.n_context,
            "prompt_sha": prompt_digest(prompt), "draft_s": seconds, "windows": windows,
            "draft_dtype": model_dtype_name(draft.model),
            "results": evaluate(prompt, ex, None, windowed_variants(variants), keep_rates, seed, default=scores)}
