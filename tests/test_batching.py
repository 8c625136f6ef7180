"""Concurrent requests share draft passes: the micro-batcher and the engine's use of it."""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import PASSAGES, QUESTION, make_engine, make_tokenizer

from specprefill_rag import ConfigError, SpecPrefillEngine
from specprefill_rag.draft.batching import MicroBatcher


def test_concurrent_calls_form_one_batch_in_order():
    calls = []

    def run(key, items):
        calls.append((key, list(items)))
        return [f"{key}:{x}" for x in items]

    batcher = MicroBatcher(run, max_batch=4, window_s=1.0)
    with ThreadPoolExecutor(4) as pool:
        began = time.monotonic()
        out = list(pool.map(lambda x: batcher.submit("k", x), range(4)))
    assert out == ["k:0", "k:1", "k:2", "k:3"]
    assert len(calls) == 1 and sorted(calls[0][1]) == [0, 1, 2, 3]
    assert time.monotonic() - began < 0.9  # a full batch does not wait out the window


def test_more_callers_than_max_batch_and_other_keys():
    calls = []
    lock = threading.Lock()

    def run(key, items):
        with lock:
            calls.append((key, len(items)))
        return [(key, x) for x in items]

    batcher = MicroBatcher(run, max_batch=3, window_s=0.2)
    jobs = [("a", i) for i in range(7)] + [("b", i) for i in range(2)]
    with ThreadPoolExecutor(9) as pool:
        out = list(pool.map(lambda job: batcher.submit(*job), jobs))
    assert out == jobs
    assert all(size <= 3 for _, size in calls)
    assert sum(size for key, size in calls if key == "a") == 7 and sum(s for k, s in calls if k == "b") == 2


def test_a_failing_batch_fails_every_caller():
    def run(key, items):
        raise ValueError("draft broke")

    batcher = MicroBatcher(run, max_batch=2, window_s=0.5)
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(batcher.submit, "k", i) for i in range(2)]
        for f in futures:
            with pytest.raises(ValueError, match="draft broke"):
                f.result(timeout=5)


def test_engine_batches_concurrent_requests_and_plans_as_alone():
    engine = make_engine(make_tokenizer())
    questions = [QUESTION, "which colour is the sky?", "what jumps over the dog?", "what follows gamma?"]
    alone = [engine.generate(q, PASSAGES).plan.position_ids for q in questions]
    config = dataclasses.replace(engine.config, draft=dataclasses.replace(engine.config.draft, max_batch=4,
                                                                         batch_window_s=2.0))
    shared = SpecPrefillEngine(engine.backend, engine.draft, config)
    sizes = []
    real = engine.draft.score_batch

    def spy(ids, **kwargs):
        sizes.append(len(ids))
        return real(ids, **kwargs)

    engine.draft.score_batch = spy  # type: ignore[method-assign]
    try:
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda q: shared.generate(q, PASSAGES), questions))
    finally:
        del engine.draft.score_batch
    assert sizes == [4]
    for result, positions in zip(results, alone, strict=True):
        assert torch.equal(result.plan.position_ids, positions)


def test_batching_settings_are_validated():
    from specprefill_rag import DraftConfig

    with pytest.raises(ConfigError, match="max_batch must be >= 1"):
        DraftConfig(max_batch=0)
    with pytest.raises(ConfigError, match="batch_window_s must be >= 0"):
        DraftConfig(batch_window_s=-1.0)
    with pytest.raises(ConfigError, match=r"batch_pad_limit must be within \[0, 1\]"):
        DraftConfig(batch_pad_limit=1.5)


def test_length_buckets_group_near_equal_lengths():
    from specprefill_rag.draft.batching import length_buckets

    lengths = [2000, 500, 1900, 480, 1000]
    assert length_buckets(lengths, 0.1) == [[0, 2], [4], [1, 3]]
    assert length_buckets(lengths, 1.0) == [[0, 1, 2, 3, 4]]
    assert length_buckets([7, 5, 7, 5], 0.0) == [[0, 2], [1, 3]]
    assert length_buckets([], 0.25) == []


def test_length_buckets_cover_every_prompt_once_within_the_padding_limit():
    import random

    from specprefill_rag.draft.batching import length_buckets, padding_share

    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 4000) for _ in range(rng.randint(1, 16))]
        limit = rng.choice([0.0, 0.1, 0.25, 0.5])
        groups = length_buckets(lengths, limit)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        assert all(len(g) == 1 or padding_share([lengths[i] for i in g]) <= limit for g in groups)


def test_in_buckets_runs_once_per_bucket_and_answers_in_input_order():
    from specprefill_rag.draft.batching import in_buckets

    calls: list[list[int]] = []

    def run(group: list[int]) -> list[str]:
        calls.append(group)
        return [f"prompt {i}" for i in group]

    lengths = [2000, 500, 1900, 480, 1000]
    assert in_buckets(lengths, 0.1, run) == [f"prompt {i}" for i in range(5)]
    assert calls == [[0, 2], [4], [1, 3]]
    with pytest.raises(ValueError):  # a run that answers fewer results than its group
        in_buckets(lengths, 1.0, lambda group: group[:-1])


def test_bucketed_batches_give_each_prompt_its_own_scores_bit_for_bit():
    """Prompts of four lengths scored together run as one padded pass per bucket, and each gets
    exactly the scores it gets alone (float64 on the CPU: a padded pass and a lone one agree to
    the bit, so any mix-up between prompts or buckets shows)."""
    engine = make_engine(make_tokenizer())
    engine.draft.model.double()
    prompts = [engine.assemble(QUESTION, PASSAGES[:k]) for k in (4, 1, 3, 4, 2)]
    lengths = [p.n_tokens for p in prompts]
    assert len(set(lengths)) == 4
    alone = [engine.score(p).scores for p in prompts]
    passes: list[list[int]] = []
    real = engine.draft.score_batch

    def spy(ids, **kwargs):
        passes.append(sorted(int(i.numel()) for i in ids))
        return real(ids, **kwargs)

    engine.draft.score_batch = spy  # type: ignore[method-assign]
    try:
        tight = dataclasses.replace(engine.config.draft, batch_pad_limit=0.02, memo_entries=0)
        together = engine.score_many(prompts, draft=tight)
    finally:
        del engine.draft.score_batch
    assert sorted(map(sorted, passes)) == sorted([[lengths[0], lengths[3]], [lengths[1]], [lengths[2]], [lengths[4]]])
    for mine, own in zip(together, alone, strict=True):
        assert torch.equal(mine.scores, own)


def test_turns_are_granted_in_arrival_order():
    from specprefill_rag.draft.batching import TurnLock

    lock = TurnLock()
    order: list[int] = []
    release = threading.Event()

    def first():
        with lock.turn():
            release.wait(5)
            order.append(0)

    def later(i):
        with lock.turn():
            order.append(i)

    threads = [threading.Thread(target=first)]
    threads[0].start()
    for i in range(1, 6):  # each queued before the next arrives
        threads.append(threading.Thread(target=later, args=(i,)))
        threads[-1].start()
        deadline = time.monotonic() + 5
        while lock.waiting < i + 1 and time.monotonic() < deadline:
            time.sleep(0.001)
    release.set()
    for t in threads:
        t.join(5)
    assert order == [0, 1, 2, 3, 4, 5] and lock.waiting == 0


@pytest.mark.parametrize("in_order", [True, False])
def test_concurrent_requests_draft_passes_run_one_at_a_time(in_order):
    """Four requests at once: with passes_in_order the draft runs one pass at a
    time, so the first request's scores are ready after one pass, not after all four."""
    engine = make_engine(make_tokenizer())
    draft = dataclasses.replace(engine.config.draft, passes_in_order=in_order, memo_entries=0)
    shared = SpecPrefillEngine(engine.backend, engine.draft, dataclasses.replace(engine.config, draft=draft))
    inside, most = 0, 0
    lock = threading.Lock()
    real = engine.draft.score_batch

    def slow(ids, **kwargs):
        nonlocal inside, most
        with lock:
            inside += 1
            most = max(most, inside)
        time.sleep(0.2)
        with lock:
            inside -= 1
        return real(ids, **kwargs)

    engine.draft.score_batch = slow  # type: ignore[method-assign]
    try:
        with ThreadPoolExecutor(4) as pool:
            plans = list(pool.map(lambda q: shared.plan(shared.assemble(q, PASSAGES)), [QUESTION] * 4))
    finally:
        del engine.draft.score_batch
    assert len(plans) == 4
    assert most == 1 if in_order else most > 1
