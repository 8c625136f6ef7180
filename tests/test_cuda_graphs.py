"""The greedy look-ahead on fixed-size buffers, and its CUDA graphs (``draft.early_exit.StepLoop``,
``draft.cuda_graphs``).

A CUDA graph replays the kernels it recorded on the tensors it recorded them on, so the loop must
keep every tensor it reads or writes in place, the same size from one forward to the next. These
tests check that on the CPU, and run the whole graph path (capture at warm-up, claim, replay,
recorded rows handed to the recorder, fallback) with a stand-in for ``torch.cuda.CUDAGraph``
that replays by running the captured forward again into the captured output tensors: what a
replay does. Only the CUDA capture itself needs a GPU (``benchmarks/suites/gpu_ttft.py``).
"""

from __future__ import annotations

import pytest
import torch
from helpers import lookahead_spec, make_model

from specprefill_rag.config import DraftConfig
from specprefill_rag.draft import DraftModel, cuda_graphs
from specprefill_rag.draft.cuda_graphs import MIN_GRAPH_WIDTH, StepGraphs, graph_width
from specprefill_rag.draft.early_exit import DecoderParts, LoopShape, StepLoop
from specprefill_rag.draft.probe import ExitedPrompts, LookaheadSpec

LAYERS = [1, 2]  # of 4: layer 3 is the upper part, read over the reading set only
GREEDY = dict(layers=LAYERS, early_exit=True, tokens="greedy", upper_keep=0.3)


def _prompts(tokenizer, lengths=(70, 33, 128), seed=11):
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, len(tokenizer), (n,), generator=gen) for n in lengths]
    return prompts, [torch.arange(n - 9, n - 2) for n in lengths]


class FakeGraph:
    """What a replayed CUDA graph does, on the CPU: the captured forward runs again, and its
    results land in the tensors the capture returned (the graph's own memory)."""

    replays = 0

    def __init__(self, graphs: StepGraphs, loop: StepLoop, predict: bool) -> None:
        self.graphs, self.loop, self.predict = graphs, loop, predict
        self.take, self.rows = self._forward()

    def _forward(self):
        rows = cuda_graphs._Rows()
        with self.graphs._recording(rows):
            take = self.loop.run(self.predict)
        return take, rows.rows

    def replay(self) -> None:
        FakeGraph.replays += 1
        take, rows = self._forward()
        self.take.copy_(take)
        assert [layer for layer, _ in rows] == [layer for layer, _ in self.rows]
        for (_, held), (_, fresh) in zip(self.rows, rows, strict=True):
            held.copy_(fresh)


@pytest.fixture
def fake_cuda(monkeypatch):
    """Graphs are captured on the CPU, by ``FakeGraph``."""

    def capture_one(self, loop, predict):
        loop.reset()
        graph = FakeGraph(self, loop, predict)
        return graph, graph.take, graph.rows

    monkeypatch.setattr(StepGraphs, "_capture_one", capture_one)
    monkeypatch.setattr(DraftConfig, "graphs_on", lambda self, device_type: self.cuda_graphs)
    FakeGraph.replays = 0


def test_the_loop_keeps_every_tensor_in_place_and_leaves_the_caches_alone(tokenizer):
    """A captured graph reads and writes fixed addresses: no forward of the loop may replace a
    buffer or change its size. The caller's caches are copied once, never written."""
    from transformers import DynamicCache

    from specprefill_rag.draft.early_exit import upper_greedy

    draft = DraftModel(make_model("llama", len(tokenizer), layers=4), tokenizer)
    parts = DecoderParts.of(draft.model)
    created: list[StepLoop] = []
    original = StepLoop.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        created.append(self)

    prompt = _prompts(tokenizer, (61,))[0][0].unsqueeze(0)
    cache = DynamicCache(config=draft.model.config)
    with torch.inference_mode():
        draft.model(input_ids=prompt, past_key_values=cache, use_cache=True)
        before = [layer.keys.clone() for layer in cache.layers]
        hidden = torch.randn(1, 61, draft.model.config.hidden_size)
        upper = DynamicCache(config=draft.model.config)
        keep = torch.tensor([0, 1, 2, 3, 20, 40, 60])
        StepLoop.__init__ = spy
        try:
            tensors: list[list[tuple[int, tuple[int, ...]]]] = []
            run = StepLoop.run

            def watched(self, predict):
                out = run(self, predict)
                tensors.append([(t.data_ptr(), tuple(t.shape)) for t in _tensors(self)])
                return out

            StepLoop.run = watched
            prompts = ExitedPrompts(prompt, torch.ones(1, 61, dtype=torch.int64), cache, hidden)
            spec = LookaheadSpec(7, layers=(2,), guesses=0)  # 6 steps, upper layers from 3
            tokens, kept = upper_greedy(parts, prompts, upper, [keep], spec)
        finally:
            StepLoop.__init__, StepLoop.run = original, run
    assert len(created) == 1 and len(tensors) == 6 and tokens.shape == (1, 6) and kept.shape == (1, 6)
    assert all(seen == tensors[0] for seen in tensors)  # same storage, same sizes, every forward
    assert [layer.keys.shape[2] for layer in cache.layers[:3]] == [61] * 3
    assert all(torch.equal(a, layer.keys) for a, layer in zip(before, cache.layers, strict=True))


def _tensors(loop: StepLoop) -> list[torch.Tensor]:
    parts = (loop.lower, loop.upper)
    return [*(t for p in parts for t in (*p.keys, *p.values, p.valid, p.slots)), loop.prompt_ids, loop.n,
            loop.tokens, loop.fed, loop.limit, loop.end_ids]


def test_graph_widths_double_from_512():
    assert [graph_width(n) for n in (1, 512, 513, 1024, 5000)] == [512, 512, 1024, 1024, 8192]
    shape = LoopShape(1, 3, 4, 7, 1, 700, 90, 2, 16, torch.float32)
    key = StepGraphs.key(shape)
    assert (key.width, key.reading) == (1024, 1024) and key.steps == 7 and key.batch == 1


@pytest.mark.parametrize(("guesses", "stop"), [(0, False), (6, False), (0, True), (6, True)])
def test_replayed_graphs_give_the_eager_tokens_and_queries(family, tokenizer, fake_cuda, guesses, stop):
    """Warm-up captures a loop per (batch, width up to graph_max_tokens); requests of any length
    up to it replay one (their prompt padded into the wider buffers) and get the eager loop's
    tokens and recorded queries, batched or alone, one step per token or with guesses, and with
    the look-ahead stopping at an end token (the same captured graphs)."""
    model = make_model(family, len(tokenizer), layers=4)
    config = DraftConfig(layers=tuple(LAYERS), lookahead=7, lookahead_guesses=guesses, graph_max_tokens=1000,
                         lookahead_stop_at_eos=stop)
    plain = DraftModel(model, tokenizer, config)
    prompts, questions = _prompts(tokenizer)
    if stop:  # an end token the first prompt's answer writes third
        end = plain.capture(prompts[0], questions[0],
                            spec=lookahead_spec(plain, 7, stop_at_eos=False, **GREEDY)).lookahead_token_ids[2]
        plain.end_ids = frozenset({end})
    eager = [plain.capture(p, q, spec=lookahead_spec(plain, 7, **GREEDY))
             for p, q in zip(prompts, questions, strict=True)]
    eager_batch = plain.capture_batch(prompts, questions, spec=lookahead_spec(plain, 7, **GREEDY))
    graphed = DraftModel(model, tokenizer, config)
    graphed.end_ids = plain.end_ids
    assert graphed.capture_graphs(batches=(1, 3)) == 4  # widths 512 and 1024, batches 1 and 3
    assert graphed.capture_graphs(batches=(1, 3)) == 0  # once
    replayed = [graphed.capture(p, q, spec=lookahead_spec(graphed, 7, **GREEDY))
                for p, q in zip(prompts, questions, strict=True)]
    assert FakeGraph.replays >= 3 * (6 if guesses == 0 else 1) - (4 if stop else 0)
    batched = graphed.capture_batch(prompts, questions, spec=lookahead_spec(graphed, 7, **GREEDY))
    assert len(eager[0].lookahead_token_ids) == (2 if stop else 6)
    for want, got in [*zip(eager, replayed, strict=True), *zip(eager_batch, batched, strict=True)]:
        assert got.lookahead_token_ids == want.lookahead_token_ids
        for a, b in zip(want.queries, got.queries, strict=True):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_a_request_finding_its_graph_busy_runs_eagerly(tokenizer, fake_cuda):
    """One request at a time holds a captured loop (its buffers are shared); another request of
    the same shape meanwhile runs the eager loop and gets the same capture."""
    model = make_model("llama", len(tokenizer), layers=4)
    draft = DraftModel(model, tokenizer, DraftConfig(layers=tuple(LAYERS), graph_max_tokens=512))
    assert draft.capture_graphs() == 1 and draft.graphs is not None
    prompts, questions = _prompts(tokenizer, (90,))
    alone = draft.capture(prompts[0], questions[0], spec=lookahead_spec(draft, 7, **GREEDY))
    replays = FakeGraph.replays
    shape = next(iter(draft.graphs._captured))
    with draft.graphs.claim(shape) as held:
        assert held is not None
        with draft.graphs.claim(shape) as other:
            assert other is None
        beside = draft.capture(prompts[0], questions[0], spec=lookahead_spec(draft, 7, **GREEDY))
    assert FakeGraph.replays == replays  # the second request did not touch the graph
    assert beside.lookahead_token_ids == alone.lookahead_token_ids
    for a, b in zip(alone.queries, beside.queries, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_longer_prompts_than_captured_run_eagerly(tokenizer, fake_cuda):
    draft = DraftModel(make_model("llama", len(tokenizer), layers=4), tokenizer,
                       DraftConfig(layers=tuple(LAYERS), graph_max_tokens=100))
    assert draft.capture_graphs() == 1  # width 512 only
    prompts, questions = _prompts(tokenizer, (600,))
    draft.capture(prompts[0], questions[0], spec=lookahead_spec(draft, 7, **GREEDY))
    assert FakeGraph.replays == 0


def test_a_config_with_graphs_off_runs_eagerly(tokenizer, fake_cuda):
    """``DraftConfig.cuda_graphs=False`` on a call: captured graphs stay unused (what the GPU
    benchmark compares the replayed loop with)."""
    draft = DraftModel(make_model("llama", len(tokenizer), layers=4), tokenizer,
                       DraftConfig(layers=tuple(LAYERS), graph_max_tokens=512))
    assert draft.capture_graphs() == 1
    prompts, questions = _prompts(tokenizer, (90,))
    context = torch.ones(90, dtype=torch.bool)
    eager = draft.score(prompts[0], question=questions[0], context=context,
                        config=DraftConfig(layers=tuple(LAYERS), cuda_graphs=False))
    assert FakeGraph.replays == 0
    replayed = draft.score(prompts[0], question=questions[0], context=context, config=draft.config)
    assert FakeGraph.replays == 7  # 7 look-ahead tokens fed one per forward (no guesses: on the CPU)
    torch.testing.assert_close(eager.scores, replayed.scores, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "config",
    [DraftConfig(), DraftConfig(cuda_graphs=False), DraftConfig(lookahead_tokens="siblings"),
     DraftConfig(early_exit=False), DraftConfig(lookahead=1), DraftConfig(layers="upper_half")],
)
def test_nothing_is_captured_without_a_graph_to_replay(tokenizer, monkeypatch, config):
    """A CPU draft (the default here), graphs off, siblings, full forwards, no look-ahead, no
    layer above the aggregated ones: no capture, no graphs object, nothing allocated."""
    if config != DraftConfig():  # these would capture on CUDA: pretend to be there
        monkeypatch.setattr(DraftConfig, "graphs_on", lambda self, device_type: self.cuda_graphs)
    draft = DraftModel(make_model("llama", len(tokenizer), layers=4), tokenizer)
    assert draft.capture_graphs(config) == 0 and draft.graphs is None


def test_a_failed_capture_is_logged_and_the_draft_serves_eagerly(tokenizer, fake_cuda, monkeypatch, caplog):
    """The CUDA capture has not run on every GPU and kernel: one that fails must not stop the
    engine from starting. The widths captured before it replay; the rest run eagerly."""
    original = StepGraphs._capture_one

    def capture_one(self, loop, predict):
        if loop.shape.width > 512:
            raise RuntimeError("operation not permitted when stream is capturing")
        return original(self, loop, predict)

    monkeypatch.setattr(StepGraphs, "_capture_one", capture_one)
    draft = DraftModel(make_model("llama", len(tokenizer), layers=4), tokenizer,
                       DraftConfig(layers=tuple(LAYERS), graph_max_tokens=2000))
    with caplog.at_level("WARNING", logger="specprefill_rag.draft"):
        assert draft.capture_graphs() == 1  # width 512; 1024 failed, 2048 not tried
    assert "width 1024" in caplog.text and "operation not permitted" in caplog.text
    prompts, questions = _prompts(tokenizer, (600,))
    spec = lookahead_spec(draft, 7, **GREEDY)
    eager = DraftModel(draft.model, tokenizer, draft.config).capture(prompts[0], questions[0], spec=spec)
    got = draft.capture(prompts[0], questions[0], spec=spec)
    assert FakeGraph.replays == 0 and got.lookahead_token_ids == eager.lookahead_token_ids


def test_warm_up_captures_for_single_requests_and_full_batches(tokenizer, monkeypatch):
    import dataclasses

    from helpers import make_engine

    from specprefill_rag.engine import SpecPrefillEngine

    made = make_engine(tokenizer)
    config = dataclasses.replace(made.config, draft=DraftConfig(lookahead=3, max_batch=4))
    engine = SpecPrefillEngine(made.backend, made.draft, config)
    calls = []
    monkeypatch.setattr(DraftModel, "capture_graphs", lambda self, config, batches: calls.append(batches) or 0)
    engine.warm_up()
    assert calls == [(1, 4)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [(dict(cuda_graphs=None), "cuda_graphs must be True or False"), (dict(graph_max_tokens=0), "graph_max_tokens")],
)
def test_graph_fields_are_checked(kwargs, message):
    from specprefill_rag.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        DraftConfig(**kwargs)
    assert DraftConfig().rule == DraftConfig(cuda_graphs=False, graph_max_tokens=64).rule
    assert MIN_GRAPH_WIDTH == 512


def test_the_gpu_bench_captures_the_graphs_of_every_variant_it_labels_graphed(tokenizer, fake_cuda):
    """``benchmarks/suites/gpu_ttft.py`` times look-ahead variants labelled "CUDA graphs"; one with another
    loop shape than the default's (one token per forward) must have its graphs captured too, or
    it runs eagerly under that label."""
    import argparse
    import dataclasses

    from benchmarks.lib.lookahead import lookahead_variants
    from benchmarks.suites import gpu_ttft

    draft = DraftModel(make_model("llama", len(tokenizer), layers=4), tokenizer,
                       DraftConfig(layers=tuple(LAYERS), lookahead=7))
    args = argparse.Namespace(lengths=[600], concurrency=0)
    assert gpu_ttft.capture_graphs(draft, args)["shapes"] == 2  # widths 512 and 1024
    assert gpu_ttft.capture_variant_graphs(draft, args) >= 2  # each other loop shape, at both widths
    steps = next(cfg for label, cfg in lookahead_variants("cuda").items()
                 if "CUDA graphs" in label and cfg.lookahead_guesses == 0)
    prompts, questions = _prompts(tokenizer, (300,))
    before = FakeGraph.replays
    draft.score(prompts[0], question=questions[0], config=dataclasses.replace(steps, memo_entries=0))
    assert FakeGraph.replays >= before + 7  # one replay per forward, not an eager loop
