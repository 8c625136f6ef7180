"""How ``bench quality`` answers one example by each method at one keep rate (``RUNNERS``, one per
name in ``METHODS``), all through the same main model: SpecPrefill's selection and its ablations
prefilled at their positions, and the text compressors' kept passages (``COMPRESSORS``, which
``bench peer_evidence`` reads too) prefilled whole. The draft scores each example once (``Case``).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.lib.datasets import Example
from benchmarks.lib.llmlingua_peer import LinguaCompressor
from benchmarks.lib.machine import cold
from benchmarks.lib.tiny import tiny_engine

METHODS = ("specprefill", "reference", "contiguous", "random", "llmlingua", "text", "ragcompress")
INSTRUCTIONS = (
    "Answer the question using only the documents in the context. "
    "Reply with the answer only: a few words, no explanation."
)


def build_engine(args: argparse.Namespace) -> Any:
    """The main model and the draft every method answers through (tiny random ones for ``--tiny``)."""
    from specprefill_rag import DraftConfig, GenerationConfig, SelectionConfig, SpecPrefillConfig, SpecPrefillEngine

    config = SpecPrefillConfig(
        # Each keep rate is its own request, scored whole (``machine.cold``): the timings stay per request.
        draft=cold(DraftConfig(lookahead=args.lookahead or DraftConfig.lookahead)),
        selection=SelectionConfig(min_prompt_tokens=0),
        generation=GenerationConfig(max_new_tokens=args.max_new_tokens, stop=("\n",)),
        instructions=INSTRUCTIONS,
    )
    if args.tiny:
        return tiny_engine(config)
    return SpecPrefillEngine.from_pretrained(args.main, args.draft, config=config, dtype=args.dtype)


def answer(engine: Any, prompt: Any, plan: Any) -> tuple[str, int]:
    """Prefill ``plan`` and decode greedily; (answer text, tokens prefilled)."""
    result = engine.execute(prompt, plan).wait()
    return result.text, result.prefilled_tokens


# The reference implementation's scoring and units (the paper's defaults, as this library
# shipped them before the selection-quality work), at the same context budget.
REFERENCE_DRAFT = dict(
    lookahead=8, lookahead_tokens="greedy", lookahead_weight=1.0, layers="all", heads="max", normalize=False
)
REFERENCE_SELECTION = dict(unit="chunk", chunk_size=32)


@dataclass
class Case:
    """One example under measurement: its prompt, and the draft scores and plans its methods share."""

    engine: Any
    ex: Example
    index: int
    args: argparse.Namespace
    lingua: LinguaCompressor | None
    prompt: Any
    passages: list[Any]
    scores: dict[str, Any] = dataclasses.field(default_factory=dict)
    ragcompress: Any = None  # a RagCompressPeer where the run has the method

    def scored(self, kind: str) -> Any:
        """Draft scores, once per kind ("default": the library's; "reference": the paper's)."""
        from specprefill_rag import DraftConfig

        if kind not in self.scores:
            config = None if kind == "default" else DraftConfig(**REFERENCE_DRAFT)  # type: ignore[arg-type]
            self.scores[kind] = self.engine.score(self.prompt, draft=config)
        return self.scores[kind]

    def plan(self, sel: Any, scores: str = "default") -> Any:
        return self.engine.plan(self.prompt, selection=sel, scores=self.scored(scores)).plan

    def peer_budget(self, sel: Any) -> int:
        """A peer compressor's token budget: the context tokens SpecPrefill kept under ``sel``."""
        return max(self.plan(sel).n_kept - int(self.prompt.protected.sum()), 8)


Outcome = tuple[str, int, dict[str, Any]]  # answer text, prefilled tokens, extra row fields


def _specprefill(case: Case, sel: Any) -> Outcome:
    text, prefilled = answer(case.engine, case.prompt, case.plan(sel))
    return text, prefilled, {"score_s": case.scored("default").seconds}


def _reference(case: Case, sel: Any) -> Outcome:
    plan = case.plan(dataclasses.replace(sel, **REFERENCE_SELECTION), scores="reference")
    return *answer(case.engine, case.prompt, plan), {}


def _contiguous(case: Case, sel: Any) -> Outcome:
    return *answer(case.engine, case.prompt, case.plan(dataclasses.replace(sel, positions="contiguous"))), {}


def _random(case: Case, sel: Any) -> Outcome:
    from specprefill_rag import selection as selection_lib

    prompt = case.prompt
    g = torch.Generator().manual_seed(case.args.seed * 1000 + case.index)
    kept = selection_lib.select(torch.rand(prompt.n_tokens, generator=g), prompt.protected, prompt.segment_index,
                                sel, prompt.sentence_start, cut_level=prompt.cut_level)
    return *answer(case.engine, prompt, selection_lib.plan_from_indices(prompt, kept)), {}


Compressed = tuple[list[Any], dict[str, Any]]  # a text compressor's kept passages (Passage), extra row fields


def _llmlingua(case: Case, sel: Any) -> Compressed:
    """LongLLMLingua under the context tokens SpecPrefill kept: its compressed text as one passage."""
    from specprefill_rag import Passage

    assert case.lingua is not None
    budget = case.peer_budget(sel)
    compressed, seconds = case.lingua.compress([p.text for p in case.passages], case.ex.question, budget)
    return [Passage(compressed, id="compressed")] if compressed else [], {"compress_s": seconds,
                                                                           "budget_tokens": budget}


def _text(case: Case, sel: Any) -> Compressed:
    """Portable (text) mode, issue 51: the passages as ``engine.compress`` gives them (whole
    sentences, a marker where a run was dropped), as any LLM behind ``SpecPrefillCompressor`` or
    the gateway's text mode would read them."""
    from specprefill_rag import Passage

    compression = case.engine.compress(case.ex.question, case.passages, selection=sel)
    kept = [Passage(p.text, id=p.id) for p in compression.passages if p.text.strip()]
    return kept, {"compress_s": compression.seconds, "kept_context_tokens": sum(
        p.n_kept for p in compression.passages)}


def _ragcompress(case: Case, sel: Any) -> Compressed:
    """``ragcompress`` under LongLLMLingua's budget: its kept sentences per passage."""
    from specprefill_rag import Passage

    assert case.ragcompress is not None
    budget = case.peer_budget(sel)
    kept, seconds = case.ragcompress.compress([(p.id, p.text) for p in case.passages], case.ex.question, budget)
    return [Passage(t, id=pid) for pid, t in kept if t.strip()], {"compress_s": seconds, "budget_tokens": budget}


# Text compressor name → its kept passages for one example at one keep rate (``bench peer_evidence`` too).
COMPRESSORS: dict[str, Callable[[Case, Any], Compressed]] = {
    "llmlingua": _llmlingua, "text": _text, "ragcompress": _ragcompress,
}


def _prefilled_whole(compressor: Callable[[Case, Any], Compressed]) -> Callable[[Case, Any], Outcome]:
    """A runner that prefills ``compressor``'s kept passages whole, as an ordinary prompt."""

    def run(case: Case, sel: Any) -> Outcome:
        from specprefill_rag import Passage
        from specprefill_rag import selection as selection_lib

        kept, extra = compressor(case, sel)
        prompt = case.engine.assemble(case.ex.question, kept or [Passage(".", id="compressed")])
        return *answer(case.engine, prompt, selection_lib.full_plan(prompt)), extra

    return run


# Method name → how it answers one example at one keep rate (the selection ``sel``).
RUNNERS: dict[str, Callable[[Case, Any], Outcome]] = {
    "specprefill": _specprefill, "reference": _reference, "contiguous": _contiguous, "random": _random,
    **{name: _prefilled_whole(compressor) for name, compressor in COMPRESSORS.items()},
}
