"""The draft's score memo: an identical request skips the draft, anything that changes the
scores misses, and the memo stays within its entries and bytes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specprefill_rag import DraftConfig, Passage
from specprefill_rag.memo import ScoreMemo, digest
from specprefill_rag.testing import tiny_engine
from specprefill_rag.types import TokenScores

PASSAGES = [Passage(f"Passage {i} says the river number {i} is {100 + i} metres wide and slow.") for i in range(8)]


def _scores(n: int) -> TokenScores:
    return TokenScores(scores=torch.arange(n, dtype=torch.float32), lookahead_token_ids=(1, 2), seconds=1.5)


class Counting:
    """Counts the draft's scoring runs of an engine."""

    def __init__(self, engine) -> None:
        self.runs = 0
        original = engine.draft.score_batch

        def score_batch(*args, **kwargs):
            self.runs += 1
            return original(*args, **kwargs)

        engine.draft.score_batch = score_batch


def test_memo_keeps_the_last_entries_and_bytes():
    memo = ScoreMemo(entries=2, max_bytes=1000)
    memo.put(b"a", _scores(10))
    memo.put(b"b", _scores(10))
    got = memo.get(b"a")  # a is now the most recent
    assert got is not None and got.from_memo and got.seconds == 0.0 and torch.equal(got.scores, torch.arange(10.0))
    memo.put(b"c", _scores(10))  # evicts b, the least recently used
    assert memo.get(b"b") is None and memo.get(b"a") is not None and memo.get(b"c") is not None
    assert len(memo) == 2 and memo.nbytes == 2 * (40 + 16)
    memo.put(b"d", _scores(240))  # 976 bytes: a goes for the count, c for the bytes
    assert len(memo) == 1 and memo.get(b"d") is not None and memo.nbytes == 976
    memo.put(b"e", _scores(1000))  # larger than the whole memo: not kept, nothing evicted
    assert memo.get(b"e") is None and memo.get(b"d") is not None
    off = ScoreMemo(entries=0, max_bytes=1000)
    off.put(b"a", _scores(10))
    assert off.get(b"a") is None and len(off) == 0


def test_digest_sees_contents_dtype_shape_and_settings():
    ids = torch.tensor([1, 2, 3])
    base = digest([ids, None], "x")
    assert digest([ids.clone(), None], "x") == base
    assert digest([torch.tensor([1, 2, 4]), None], "x") != base
    assert digest([ids.to(torch.int32), None], "x") != base
    assert digest([ids.reshape(3, 1), None], "x") != base
    assert digest([ids, torch.tensor([True])], "x") != base
    assert digest([ids, None], "y") != base


def test_an_identical_request_skips_the_draft_and_gets_the_same_plan():
    engine = tiny_engine()
    runs = Counting(engine)
    first = engine.generate("How wide is river 3?", PASSAGES)
    second = engine.generate("How wide is river 3?", PASSAGES)
    assert runs.runs == 1
    assert not first.draft_memo_hit and second.draft_memo_hit and second.to_dict()["draft_memo_hit"] is True
    assert second.timings.draft_s == 0.0 and first.timings.draft_s > 0.0
    assert torch.equal(first.plan.position_ids, second.plan.position_ids) and first.token_ids == second.token_ids
    # Another keep rate selects again from the same scores: still no draft run.
    other = engine.generate("How wide is river 3?", PASSAGES, keep_rate=0.6)
    assert runs.runs == 1 and other.draft_memo_hit and other.prefilled_tokens > first.prefilled_tokens


@pytest.mark.parametrize("change", ["question", "passage", "draft config"])
def test_anything_that_changes_the_scores_misses(change):
    engine = tiny_engine()
    runs = Counting(engine)
    engine.generate("How wide is river 3?", PASSAGES)
    question, passages = "How wide is river 3?", PASSAGES
    if change == "question":
        question = "How wide is river 4?"
    elif change == "passage":
        passages = [*PASSAGES[:-1], Passage("Passage 7 says the river number 7 is 999 metres wide and slow.")]
    else:
        engine.config = dataclasses.replace(
            engine.config, draft=dataclasses.replace(engine.config.draft, pool_kernel=3))
    result = engine.generate(question, passages)
    assert runs.runs == 2 and not result.draft_memo_hit


def test_settings_that_never_change_a_score_share_the_memo_and_zero_entries_turn_it_off():
    engine = tiny_engine()
    runs = Counting(engine)
    engine.generate("How wide is river 3?", PASSAGES)
    engine.config = dataclasses.replace(
        engine.config, draft=dataclasses.replace(engine.config.draft, on_overflow="raise", memo_entries=8))
    assert engine.generate("How wide is river 3?", PASSAGES).draft_memo_hit and runs.runs == 1
    off = tiny_engine(dataclasses.replace(engine.config, draft=DraftConfig(lookahead=2, memo_entries=0)))
    runs = Counting(off)
    results = [off.generate("How wide is river 3?", PASSAGES) for _ in range(2)]
    assert runs.runs == 2 and not any(r.draft_memo_hit for r in results) and len(off.memo) == 0


def test_cross_family_scores_are_remembered_per_main_prompt():
    engine = tiny_engine(cross_family=True)
    assert engine.maps_tokens
    runs = Counting(engine)
    first = engine.generate("How wide is river 3?", PASSAGES)
    second = engine.generate("How wide is river 3?", PASSAGES)
    assert runs.runs == 1 and second.draft_memo_hit and torch.equal(first.plan.position_ids, second.plan.position_ids)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"memo_entries": -1}, "memo_entries must be >= 0, got -1"),
    ({"memo_bytes": -5}, "memo_bytes must be >= 0, got -5"),
    ({"memo_entries": 1.5}, "memo_entries must be an int, got 1.5"),
])
def test_memo_fields_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DraftConfig(**kwargs)
