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
from specprefill_rag.draft import MicroBatcher


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
