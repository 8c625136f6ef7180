"""End to end on real weights, across families: SmolLM2-135M drafts for Qwen2.5-Coder-0.5B.

The two models share neither vocabulary nor chat template; the draft scores its own rendering
of a ~1.5k-token passkey haystack, the scores are mapped onto Qwen's tokens by character
offsets, and Qwen must prefill every needle token and answer with the passkey.
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

pytestmark = [pytest.mark.real_model, pytest.mark.full]

DRAFT = "smollm2-135m-instruct"
MAIN = "qwen2.5-coder-0.5b-instruct"


@pytest.fixture(scope="module")
def engine():
    from specprefill_rag.loading import load_model

    config = SpecPrefillConfig(
        selection=SelectionConfig(keep_rate=0.2),
        generation=GenerationConfig(max_new_tokens=10),
        instructions="Answer the question from the context.",
    )
    main, main_tok = load_model(MAIN)
    draft, draft_tok = load_model(DRAFT)
    return SpecPrefillEngine(TransformersBackend(main, main_tok, name=MAIN), DraftModel(draft, draft_tok), config)


def test_smollm2_draft_keeps_the_needle_for_qwen(engine, record_property):
    assert engine.maps_tokens
    passages = haystack(n_passages=8, repeats=8, needle_at=5)
    prompt = engine.assemble(QUESTION, passages)
    assert 1200 <= prompt.n_tokens <= 2000, prompt.n_tokens
    planned = engine.plan(prompt)
    plan, scores = planned.plan, planned.scores
    assert scores is not None
    start = prompt.text.index(NEEDLE)
    needle_tokens = [
        i for i, (a, b) in enumerate(prompt.offsets.tolist()) if a < start + len(NEEDLE) and b > start
    ]
    kept = set(plan.position_ids.tolist())
    missing = [i for i in needle_tokens if i not in kept]
    assert not missing, f"needle tokens not kept: {missing}"
    assert plan.keep_ratio < 0.3
    spans = {s.id: s for s in plan.kept_spans if s.kind is SegmentKind.PASSAGE}

    # Prefill the plan just made (one draft run for the whole test).
    result = engine.execute(prompt, plan, scores=scores).wait()
    assert PASSKEY in result.text, result.text
    report = (
        f"prompt {prompt.n_tokens} Qwen tokens, kept {result.prefilled_tokens} ({result.keep_ratio:.1%}); "
        f"per passage {[round(s.keep_ratio, 2) for s in spans.values()]}; draft {result.timings.draft_s:.1f} s, "
        f"main prefill {result.timings.prefill_s:.1f} s → {result.text.strip()!r}"
    )
    record_property("cross_family_needle", report)
    print(report)
