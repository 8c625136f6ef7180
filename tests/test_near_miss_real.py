"""End to end on real weights: near-miss distractors (Qwen2.5-Coder 0.5B drafts for 1.5B).

Each case of ``benchmarks/data/near_miss.json`` has one passage with the answer and
distractor passages about entities of the same type stating the same attribute with another
value. At keep rate 0.3 the main model must answer from the kept tokens with the right value,
never the distractor's, and the evidence sentence must be prefilled.
"""

from __future__ import annotations

import pytest

from benchmarks.suites import quality
from specprefill_rag import GenerationConfig, Passage, SelectionConfig, SpecPrefillConfig, SpecPrefillEngine

pytestmark = [pytest.mark.real_model, pytest.mark.full, pytest.mark.timeout(900)]

CASES = ("lighthouse-automation", "drug-max-daily-dose", "satellite-launch-site", "school-blazer-colour")


@pytest.fixture(scope="module")
def engine() -> SpecPrefillEngine:
    config = SpecPrefillConfig(
        selection=SelectionConfig(keep_rate=0.3),
        generation=GenerationConfig(max_new_tokens=12, stop=("\n",)),
        instructions=quality.INSTRUCTIONS,
    )
    return SpecPrefillEngine.from_pretrained(
        "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", config=config
    )


@pytest.mark.parametrize("case", CASES)
def test_near_miss_answer_survives_pruning(engine: SpecPrefillEngine, case: str) -> None:
    (ex,) = [e for e in quality.load_near_miss() if e.id == case]
    passages = [Passage(text, id=pid) for pid, text in ex.passages]
    result = engine.generate(ex.question, passages)
    assert result.plan.speculated and result.keep_ratio < 0.5
    # The evidence sentence is prefilled whole.
    prompt = engine.assemble(ex.question, passages)
    (passage, a, b), = ex.evidence
    evidence = prompt.text.index(ex.passages[passage][1][a:b])
    tokens = [i for i, (s, e) in enumerate(prompt.offsets.tolist()) if s < evidence + (b - a) and e > evidence]
    kept = set(result.plan.position_ids.tolist())
    assert all(i in kept for i in tokens), f"evidence tokens dropped: {[i for i in tokens if i not in kept]}"
    scored = quality.score_prediction(ex.task, result.text, ex.answers, ex.meta)
    assert scored == {"acc": 1.0, "distractor": 0.0}, (result.text, ex.answers, ex.meta["distractor_answers"])
