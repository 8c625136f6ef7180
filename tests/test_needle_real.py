"""End to end on real weights: a passkey in a ~2.5k-token haystack, SmolLM2-135M as draft and main.

The draft must pick the needle's chunk at a 25% keep rate and the main model must answer with
the passkey. The same kept tokens re-indexed contiguously (the ablation) are run and reported
alongside.
"""

from __future__ import annotations

import pytest
from helpers import NEEDLE, PASSKEY, QUESTION, haystack

from specprefill_rag import (
    DraftModel,
    GenerationConfig,
    SegmentKind,
    SelectionConfig,
    SpecPrefillConfig,
    SpecPrefillEngine,
)
from specprefill_rag.backends.transformers import TransformersBackend

pytestmark = pytest.mark.real_model

MODEL = "smollm2-135m-instruct"



@pytest.fixture(scope="module")
def engine():
    from specprefill_rag.loading import load_model

    model, tokenizer = load_model(MODEL)
    config = SpecPrefillConfig(
        selection=SelectionConfig(keep_rate=0.25),
        generation=GenerationConfig(max_new_tokens=12),
        instructions="Answer the question from the context.",
    )
    # One set of weights serves as draft and main (the draft gets the capturing attention).
    return SpecPrefillEngine(TransformersBackend(model, tokenizer, name=MODEL), DraftModel(model, tokenizer), config)


def test_needle_is_kept_and_answered(engine, record_property):
    passages = haystack()
    prompt = engine.assemble(QUESTION, passages)
    assert 2000 <= prompt.n_tokens <= 4000, prompt.n_tokens
    scores = engine.score(prompt)
    plan = engine.plan(prompt, scores=scores).plan
    # The needle's characters → its tokens; every one of them must be prefilled.
    start = prompt.text.index(NEEDLE)
    needle_tokens = [
        i for i, (a, b) in enumerate(prompt.offsets.tolist()) if a < start + len(NEEDLE) and b > start
    ]
    kept = set(plan.position_ids.tolist())
    missing = [i for i in needle_tokens if i not in kept]
    assert not missing, f"needle tokens not kept: {missing}"
    assert plan.keep_ratio < 0.35
    spans = {s.id: s for s in plan.kept_spans if s.kind is SegmentKind.PASSAGE}
    assert spans["p7"].n_kept >= len(needle_tokens)

    result = engine.generate(QUESTION, passages)
    assert PASSKEY in result.text, result.text
    assert result.plan.position_ids.tolist() == plan.position_ids.tolist()

    ablation = engine.generate(
        QUESTION, passages, selection=SelectionConfig(keep_rate=0.25, positions="contiguous")
    )
    assert ablation.plan.token_ids.tolist() == result.plan.token_ids.tolist()
    report = (
        f"prompt {prompt.n_tokens} tokens, kept {result.prefilled_tokens} ({result.keep_ratio:.1%}); "
        f"per passage {[round(s.keep_ratio, 2) for s in spans.values()]}; "
        f"original positions → {result.text.strip()!r}; contiguous positions → {ablation.text.strip()!r}"
    )
    record_property("needle", report)
    print(report)
