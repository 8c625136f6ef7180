"""Which path a request takes and why (``payoff``): every answer names it, and with
``skip_when_slower`` a prompt whose draft would cost more than the prefill it saves is prefilled
whole, from the engine's own running costs."""

from __future__ import annotations

import dataclasses
import threading

import pytest
from helpers import draft_runs

from specprefill_rag import ConfigError, DraftConfig, GenerationConfig, Passage, SelectionConfig, SpecPrefillConfig
from specprefill_rag.payoff import NEWEST_WEIGHT, PrefillCosts
from specprefill_rag.testing import tiny_engine

PASSAGES = [Passage(f"Passage {i} says the river number {i} is {100 + i} metres wide and slow.") for i in range(8)]
QUESTION = "How wide is river 3?"


def _engine(**draft: object):
    return tiny_engine(SpecPrefillConfig(
        draft=DraftConfig(**{"lookahead": 2, "memo_entries": 0, **draft}),  # type: ignore[arg-type]
        selection=SelectionConfig(keep_rate=0.3, min_prompt_tokens=32, chunk_size=8),
        generation=GenerationConfig(max_new_tokens=2),
    ))


def test_costs_are_running_averages_and_the_queue_counts_what_is_inside():
    costs = PrefillCosts()
    assert costs.slower(100, 100) is None  # nothing measured: prune
    costs.observe_draft(100, 1.0)
    costs.observe_draft(100, 2.0)
    assert costs.draft_per_token == pytest.approx(0.01 + NEWEST_WEIGHT * 0.01)
    costs.observe_draft(0, 5.0)  # a run of no tokens measures nothing
    assert costs.draft_per_token == pytest.approx(0.01 + NEWEST_WEIGHT * 0.01)
    costs.observe_prefill(100, 2.0)  # main: 0.02 s per token
    with costs.queued(500):
        assert costs.queued_tokens == 500
        slower = costs.slower(100, 200)  # (500 + 100) × 0.012 = 7.2 s against 200 × 0.02 = 4 s
    assert costs.queued_tokens == 0
    assert slower is not None and slower.code == "draft_slower"
    assert "queue (500 tokens)" in slower.reason and "~7.20 s" in slower.reason and "~4.00 s" in slower.reason
    assert costs.slower(100, 200) is None  # 1.2 s < 4 s once the queue is gone


def test_the_queue_is_released_when_the_draft_raises():
    costs = PrefillCosts()
    with pytest.raises(RuntimeError), costs.queued(7):
        raise RuntimeError("draft failed")
    assert costs.queued_tokens == 0


@pytest.mark.parametrize(("change", "code"), [
    ({}, "pruned"),
    ({"mode": "full"}, "full_mode"),
    ({"keep_rate": 1.0}, "keeps_everything"),
])
def test_every_answer_names_its_path(change, code):
    result = _engine().generate(QUESTION, PASSAGES, **change)
    assert result.path.code == code and result.plan.speculated == (code == "pruned")
    assert result.to_dict()["path"] == code and result.to_dict()["path_reason"] == result.path.reason
    if code == "pruned":
        assert f"chose {result.prefilled_tokens} of the prompt's {result.prompt_tokens} tokens" in result.path.reason


def test_a_short_prompt_and_an_unreadable_one_say_why():
    engine = _engine(on_overflow="full")
    selection = dataclasses.replace(engine.config.selection, min_prompt_tokens=10_000)
    short = engine.generate(QUESTION, PASSAGES, selection=selection)
    assert short.path.code == "short_prompt" and "fewer than min_prompt_tokens=10000" in short.path.reason
    engine.draft.model.config.max_position_embeddings = 64
    whole = engine.generate(QUESTION, PASSAGES)
    assert whole.path.code == "draft_cannot_read" and not whole.plan.speculated
    assert "on_overflow='full'" in whole.path.reason


def test_a_draft_slower_than_the_prefill_it_saves_is_skipped_only_when_asked():
    engine = _engine(skip_when_slower=True)
    runs = draft_runs(engine)
    first = engine.generate(QUESTION, PASSAGES)  # nothing measured yet: pruned, and both costs measured
    assert first.path.code == "pruned" and runs.runs == 1
    assert engine.costs.draft_per_token is not None and engine.costs.main_per_token is not None
    engine.costs.draft_per_token = 1000 * engine.costs.main_per_token  # a draft far slower than the main model
    skipped = engine.generate(QUESTION, PASSAGES)
    assert skipped.path.code == "draft_slower" and not skipped.plan.speculated and runs.runs == 1
    assert skipped.timings.draft_s is None and skipped.prefilled_tokens == skipped.prompt_tokens
    engine.costs.draft_per_token = engine.costs.main_per_token / 1000  # and far cheaper: pruned again
    assert engine.generate(QUESTION, PASSAGES).path.code == "pruned" and runs.runs == 2
    off = _engine()  # skip_when_slower off (the default): always pruned, whatever it costs
    off.costs.observe_draft(1, 1000.0)
    off.costs.observe_prefill(1, 0.001)
    assert off.generate(QUESTION, PASSAGES).path.code == "pruned"


def test_the_queue_ahead_decides_and_a_remembered_prompt_always_pays():
    engine = _engine(skip_when_slower=True, memo_entries=8)
    engine.generate(QUESTION, PASSAGES)  # measured, and its scores remembered
    engine.costs.draft_per_token = engine.costs.main_per_token / 10  # a draft 10× cheaper per token
    other = [Passage(p.text.replace("slow", "calm")) for p in PASSAGES]
    assert engine.generate(QUESTION, other).path.code == "pruned"  # a tenth of the prompt < the 70% it saves
    with engine.costs.queued(100_000):  # a long queue ahead of it
        assert engine.generate(QUESTION, [*other, Passage("One more.")]).path.code == "draft_slower"
        again = engine.generate(QUESTION, PASSAGES)  # its scores are in the memo: the draft does not run
        assert again.path.code == "pruned" and again.draft_memo_hit


def test_concurrent_requests_count_each_others_draft_tokens():
    engine = _engine()
    groups = [PASSAGES[:6], PASSAGES[2:]]
    both = sum(engine.assemble(QUESTION, g).n_tokens for g in groups)
    assert engine.scorer is not None
    real = engine.scorer._score_readings
    queued_together = threading.Event()

    def spy(readings, config):
        if engine.costs.queued_tokens == both:  # the other request's tokens are counted with these
            queued_together.set()
        queued_together.wait(timeout=10)  # the first in holds the draft until the second is queued
        return real(readings, config)

    engine.scorer._score_readings = spy  # type: ignore[method-assign]
    threads = [threading.Thread(target=engine.generate, args=(QUESTION, g)) for g in groups]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert queued_together.is_set() and engine.costs.queued_tokens == 0


def test_skip_when_slower_is_checked():
    with pytest.raises(ConfigError, match="skip_when_slower must be True or False"):
        DraftConfig(skip_when_slower=1)  # type: ignore[arg-type]
    assert dataclasses.replace(DraftConfig(), skip_when_slower=True).rule == DraftConfig().rule


def test_the_gateway_answers_with_the_path_and_counts_it():
    pytest.importorskip("fastapi")
    pytest.importorskip("prometheus_client")
    from fastapi.testclient import TestClient

    from specprefill_rag.gateway import create_app

    engine = _engine(skip_when_slower=True)
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": QUESTION}],
            "specprefill": {"passages": [p.text for p in PASSAGES]}}
    with TestClient(create_app(engine)) as client:
        first = client.post("/v1/chat/completions", json=body).json()["specprefill"]
        engine.costs.draft_per_token = 1000 * (engine.costs.main_per_token or 1.0)
        second = client.post("/v1/chat/completions", json=body).json()["specprefill"]
        metrics = client.get("/metrics").text
    assert first["path"] == "pruned" and first["speculated"]
    assert second["path"] == "draft_slower" and not second["speculated"]
    assert "main-model prefill" in second["path_reason"]
    assert 'specprefill_gateway_paths_total{path="pruned"} 1.0' in metrics
    assert 'specprefill_gateway_paths_total{path="draft_slower"} 1.0' in metrics
