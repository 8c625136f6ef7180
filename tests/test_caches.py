"""The draft's score memo: an identical request skips the draft, anything that changes the
scores misses, and the memo stays within its entries and bytes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import assembly, draft_runs

from specprefill_rag import ConfigError, DraftConfig, DraftRuntime, Passage, ScoringConfig
from specprefill_rag.caches import ScoreMemo, digest
from specprefill_rag.testing import tiny_engine
from specprefill_rag.types import TokenScores

PASSAGES = [Passage(f"Passage {i} says the river number {i} is {100 + i} metres wide and slow.") for i in range(8)]


def _scores(n: int) -> TokenScores:
    return TokenScores(scores=torch.arange(n, dtype=torch.float32), lookahead_token_ids=(1, 2), seconds=1.5)


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
    runs = draft_runs(engine)
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
    runs = draft_runs(engine)
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
    runs = draft_runs(engine)
    engine.generate("How wide is river 3?", PASSAGES)
    engine.config = dataclasses.replace(
        engine.config, draft=dataclasses.replace(engine.config.draft, on_overflow="raise", memo_entries=8))
    assert engine.generate("How wide is river 3?", PASSAGES).draft_memo_hit and runs.runs == 1
    off = tiny_engine(dataclasses.replace(engine.config, draft=DraftConfig(lookahead=2, memo_entries=0)))
    runs = draft_runs(off)
    results = [off.generate("How wide is river 3?", PASSAGES) for _ in range(2)]
    assert runs.runs == 2 and not any(r.draft_memo_hit for r in results)
    assert off.scorer is not None and len(off.scorer.memo) == 0


def test_cross_family_scores_are_remembered_per_main_prompt(monkeypatch):
    engine = tiny_engine(cross_family=True)
    assert engine.maps_tokens
    runs = draft_runs(engine)
    assembled = assembly(monkeypatch)
    first = engine.generate("How wide is river 3?", PASSAGES)
    assert assembled.runs == 2  # the main prompt, and the draft's own rendering of it
    second = engine.generate("How wide is river 3?", PASSAGES)
    assert runs.runs == 1 and second.draft_memo_hit and torch.equal(first.plan.position_ids, second.plan.position_ids)
    assert assembled.runs == 2  # a retry renders neither again


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"memo_entries": -1}, "memo_entries must be >= 0, got -1"),
    ({"memo_bytes": -5}, "memo_bytes must be >= 0, got -5"),
    ({"memo_entries": 1.5}, "memo_entries must be an int, got 1.5"),
])
def test_memo_fields_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DraftConfig(**kwargs)



def test_a_retry_skips_assembly_and_gets_the_same_prompt(monkeypatch):
    """The same request again reuses its assembled prompt (a retry's time before the main
    prefill is then the memo's, not the tokenizer's); anything assembly reads misses."""
    engine = tiny_engine()
    counting = assembly(monkeypatch)
    first = engine.assemble("How wide is river 3?", PASSAGES)
    again = engine.assemble("How wide is river 3?", list(PASSAGES))
    assert counting.runs == 1 and again is not first  # a new object carrying the request's own segments
    for field in ("token_ids", "segment_index", "protected", "offsets", "sentence_start", "cut_level"):
        assert torch.equal(getattr(first, field), getattr(again, field)), field
    assert again.text == first.text and again.segment_spans == first.segment_spans
    changed = [*PASSAGES[:-1], Passage("Passage 7 says the river number 7 is 999 metres wide and slow.")]
    engine.assemble("How wide is river 3?", changed)
    engine.assemble("How wide is river 4?", PASSAGES)
    engine.assemble("How wide is river 3?", PASSAGES, instructions="Answer in French.")
    from specprefill_rag import SelectionConfig

    free = engine.assemble("How wide is river 3?", PASSAGES, selection=SelectionConfig(protect_instructions=False))
    assert counting.runs == 5 and int(free.protected.sum()) < int(first.protected.sum())
    result = engine.generate("How wide is river 3?", PASSAGES)  # the engine's own path: a hit
    assert counting.runs == 5 and result.text


def test_a_remembered_prompt_carries_the_requests_metadata(monkeypatch):
    """Assembly never reads ids or metadata, so a request that differs only there reuses the
    prompt, with its own segments: the retriever's scores the selection weighs are this request's."""
    engine = tiny_engine()
    counting = assembly(monkeypatch)
    scored = [Passage(p.text, id=f"p{i}", metadata={"score": 0.1 * i}) for i, p in enumerate(PASSAGES)]
    rescored = [Passage(p.text, id=f"q{i}", metadata={"score": 1.0 - 0.1 * i}) for i, p in enumerate(PASSAGES)]
    engine.assemble("How wide is river 3?", scored)
    again = engine.assemble("How wide is river 3?", rescored)
    assert counting.runs == 1
    passages = [s for s in again.segments if s.metadata]
    assert [s.metadata["score"] for s in passages] == [1.0 - 0.1 * i for i in range(8)]
    assert [s.id for s in passages] == [f"q{i}" for i in range(8)]


def test_zero_memo_entries_assemble_every_time_and_the_window_still_refuses(monkeypatch):
    from specprefill_rag.errors import InputError

    off = tiny_engine(dataclasses.replace(tiny_engine().config, draft=DraftConfig(lookahead=2, memo_entries=0)))
    counting = assembly(monkeypatch)
    for _ in range(2):
        off.assemble("How wide is river 3?", PASSAGES)
    assert counting.runs == 2 and len(off.prompts) == 0
    engine = tiny_engine()
    long = [Passage("river " * 3000)]
    for _ in range(2):  # remembered or not, a prompt over the window is refused
        with pytest.raises(InputError, match="window"):
            engine.assemble("How wide?", long)


def test_the_draft_config_is_a_scoring_rule_and_run_time_settings():
    """``DraftConfig``'s fields are exactly the rule's and the run-time settings', no field in
    both; the memo keys on the rule, so run-time fields never split it and each rule field does."""
    rule = {f.name for f in dataclasses.fields(ScoringConfig)}
    runtime = {f.name for f in dataclasses.fields(DraftRuntime)}
    assert not rule & runtime and {f.name for f in dataclasses.fields(DraftConfig)} == rule | runtime
    config = DraftConfig(lookahead=4, max_batch=3, on_overflow="raise")
    assert config.rule == ScoringConfig(lookahead=4)
    assert config.runtime == DraftRuntime(max_batch=3, on_overflow="raise")
    assert dataclasses.replace(config, max_batch=1, memo_entries=0, cuda_graphs=False).rule == config.rule
    assert dataclasses.replace(config, pool_kernel=3).rule != config.rule
    with pytest.raises(ConfigError, match="max_batch must be >= 1"):
        DraftConfig(max_batch=0)
    with pytest.raises(ConfigError, match="pool_kernel must be a positive odd number"):
        ScoringConfig(pool_kernel=2)
