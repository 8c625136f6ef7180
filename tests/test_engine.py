"""Engine end to end on tiny random models: modes, streaming, async, bad input."""

from __future__ import annotations

import pytest
import torch
from helpers import PASSAGES, QUESTION, make_engine, make_model, make_tokenizer

from specprefill_rag import (
    DraftConfig,
    DraftModel,
    GenerationConfig,
    SegmentKind,
    SelectionConfig,
    SpecPrefillConfig,
    SpecPrefillEngine,
    testing,
)
from specprefill_rag.backends.transformers import TransformersBackend
from specprefill_rag.detokenize import IncrementalDecoder
from specprefill_rag.types import Segment


@pytest.fixture(scope="module")
def engine():
    return make_engine(make_tokenizer())


def test_full_keep_rate_reproduces_plain_generate(engine):
    result = engine.generate(QUESTION, PASSAGES, keep_rate=1.0)
    prompt = engine.assemble(QUESTION, PASSAGES)
    expected = engine.backend.model.generate(
        prompt.token_ids.reshape(1, -1), attention_mask=torch.ones(1, prompt.n_tokens, dtype=torch.int64),
        max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0,
    )[0, prompt.n_tokens :].tolist()
    assert list(result.token_ids) == expected
    assert not result.plan.speculated and result.timings.draft_s is None
    assert result.prefilled_tokens == result.prompt_tokens == prompt.n_tokens


def test_specprefill_plan_keeps_question_and_budget(engine):
    result = engine.generate(QUESTION, PASSAGES)
    plan = result.plan
    n = result.prompt_tokens
    assert plan.speculated and plan.next_position == n
    assert result.prefilled_tokens < 0.5 * n
    assert result.prefilled_tokens >= int(0.3 * n)
    by_kind = {s.kind: s for s in plan.kept_spans}
    assert by_kind[SegmentKind.QUESTION].keep_ratio == 1.0
    assert by_kind[SegmentKind.INSTRUCTIONS].keep_ratio == 1.0
    assert [s.id for s in plan.kept_spans if s.kind is SegmentKind.PASSAGE] == ["colors", "greek", "needle", "fox"]
    # Original positions: strictly increasing, taken from the prompt, ending at the last token.
    assert bool((plan.position_ids[1:] > plan.position_ids[:-1]).all()) and int(plan.position_ids[-1]) == n - 1
    t = result.timings
    assert t.draft_s is not None and t.draft_s > 0 and t.selection_s is not None and t.selection_s >= 0
    assert 0 < t.prefill_s <= t.ttft_s <= t.total_s
    assert len(result.token_ids) == 6 and result.finish_reason == "length"


def test_full_mode_is_the_baseline(engine):
    result = engine.generate(QUESTION, PASSAGES, mode="full")
    assert result.prefilled_tokens == result.prompt_tokens and result.keep_ratio == 1.0
    with pytest.raises(ValueError, match="mode must be"):
        engine.generate(QUESTION, PASSAGES, mode="fast")


def test_stream_deltas_make_the_text(engine):
    stream = engine.stream(QUESTION, PASSAGES)
    deltas, so_far = [], []
    for delta in stream:
        deltas.append(delta)
        so_far.append(stream.text)
    assert stream.result is not None
    assert "".join(deltas) == stream.result.text == stream.text
    assert so_far == ["".join(deltas[: i + 1]) for i in range(len(deltas))]  # .text is the prefix so far
    assert stream.result.token_ids == engine.generate(QUESTION, PASSAGES).token_ids


async def test_async_variants_match_sync(engine):
    sync = engine.generate(QUESTION, PASSAGES)
    result = await engine.agenerate(QUESTION, PASSAGES)
    assert result.token_ids == sync.token_ids
    stream = await engine.astream(QUESTION, PASSAGES)
    deltas = [d async for d in stream]
    assert "".join(deltas) == sync.text == stream.text and stream.result.token_ids == sync.token_ids
    with pytest.raises(TypeError, match="keep_ratio"):  # the typed keywords are stream's, checked there
        await engine.agenerate(QUESTION, PASSAGES, keep_ratio=0.5)


async def test_async_does_not_block_the_loop(engine):
    async with testing.counting_loop_ticks() as ticks:
        await engine.agenerate(QUESTION, PASSAGES)
    assert ticks.count > 5


def test_contiguous_positions_ablation_changes_only_positions(engine):
    original = engine.generate(QUESTION, PASSAGES)
    contiguous = SelectionConfig(keep_rate=0.3, min_prompt_tokens=64, positions="contiguous")
    ablation = engine.generate(QUESTION, PASSAGES, selection=contiguous)
    assert torch.equal(ablation.plan.token_ids, original.plan.token_ids)
    assert ablation.plan.position_ids.tolist() == list(range(ablation.plan.n_kept))
    assert ablation.plan.next_position == ablation.plan.n_kept


def test_segments_input_protects_tail_only(engine):
    text = " ".join(p.text for p in PASSAGES)
    result = engine.generate([Segment(SegmentKind.CONTEXT, text)])
    assert result.plan.speculated
    assert result.plan.kept_spans[0].n_kept < result.plan.kept_spans[0].n_tokens
    with pytest.raises(ValueError, match="either segments"):
        engine.generate([Segment(SegmentKind.CONTEXT, text)], PASSAGES)


def test_stop_strings_cut_the_text(engine):
    free = engine.generate(QUESTION, PASSAGES, generation=GenerationConfig(max_new_tokens=8))
    assert len(free.text) > 2
    stop = free.text[1:3]
    result = engine.generate(QUESTION, PASSAGES, generation=GenerationConfig(max_new_tokens=8, stop=(stop,)))
    assert result.text == free.text[: free.text.find(stop)]
    assert result.finish_reason == "stop"


@pytest.mark.parametrize("keep_rate", [0.0, -0.1, 1.01, float("nan")])
def test_bad_keep_rate(engine, keep_rate):
    with pytest.raises(ValueError, match="keep_rate must be in"):
        engine.generate(QUESTION, PASSAGES, keep_rate=keep_rate)


def test_bad_question_and_context(engine):
    with pytest.raises(ValueError, match="question is empty"):
        engine.generate("", PASSAGES)
    with pytest.raises(ValueError, match="context is empty"):
        engine.generate(QUESTION, [])


def test_prompt_longer_than_window(tokenizer):
    engine = make_engine(tokenizer, window=128)
    with pytest.raises(ValueError, match=r"the prompt has \d+ tokens but the main model's window is 128"):
        engine.generate(QUESTION, PASSAGES)


def test_engine_without_draft_serves_full_mode_only(tokenizer):
    engine = make_engine(tokenizer, draft=False)
    assert engine.generate(QUESTION, PASSAGES, mode="full").prefilled_tokens > 0
    with pytest.raises(ValueError, match="no draft model"):
        engine.generate(QUESTION, PASSAGES)


def _word_level_draft():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    other = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    other.pre_tokenizer = pre_tokenizers.Whitespace()
    other.train_from_iterator(["a b c d"], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    other_tok = PreTrainedTokenizerFast(tokenizer_object=other)
    return DraftModel(make_model("llama", len(other_tok)), other_tok)


def test_mismatched_tokenizers_are_rejected_in_same_mode(tokenizer):
    main = TransformersBackend(make_model("qwen2", len(tokenizer)), tokenizer)
    config = SpecPrefillConfig(draft=DraftConfig(tokenizer_mapping="same"))
    with pytest.raises(ValueError, match="draft must share the main model's tokenizer"):
        SpecPrefillEngine(main, _word_level_draft(), config)


def test_mismatched_tokenizers_are_mapped_in_auto_mode(tokenizer):
    main = TransformersBackend(make_model("qwen2", len(tokenizer)), tokenizer)
    config = SpecPrefillConfig(
        draft=DraftConfig(lookahead=2),
        selection=SelectionConfig(keep_rate=0.3, min_prompt_tokens=64),
        generation=GenerationConfig(max_new_tokens=2),
    )
    engine = SpecPrefillEngine(main, _word_level_draft(), config)
    assert engine.maps_tokens
    result = engine.generate(QUESTION, PASSAGES)
    assert result.plan.speculated and result.prefilled_tokens < 0.5 * result.prompt_tokens
    assert {s.kind: s for s in result.kept_spans}[SegmentKind.QUESTION].keep_ratio == 1.0


def test_incremental_decoder_holds_back_partial_stop(tokenizer):
    ids = tokenizer("The sky is blue. The sun", add_special_tokens=False)["input_ids"]
    decoder = IncrementalDecoder(tokenizer, stop=("blue. The s",))
    shown = "".join(decoder.push(i) for i in ids) + decoder.finish()
    assert shown == "The sky is " and decoder.stopped
    decoder = IncrementalDecoder(tokenizer, stop=("green",))
    shown = "".join(decoder.push(i) for i in ids) + decoder.finish()
    assert shown == "The sky is blue. The sun" and not decoder.stopped


def test_score_many_plans_like_one_by_one(engine):
    prompts = [
        engine.assemble(QUESTION, PASSAGES),
        engine.assemble("which colour is the sky?", PASSAGES[:2]),
        engine.assemble(QUESTION, PASSAGES[2:]),
    ]
    for p, scores in zip(prompts, engine.score_many(prompts), strict=True):
        alone = engine.score(p)
        torch.testing.assert_close(scores.scores, alone.scores, atol=1e-6, rtol=1e-4)
        batched, own = engine.plan(p, scores=scores).plan, engine.plan(p, scores=alone).plan
        assert torch.equal(batched.position_ids, own.position_ids)


def test_execute_runs_a_plan_you_built_and_results_carry_their_prompt(engine):
    prompt = engine.assemble(QUESTION, PASSAGES)
    planned = engine.plan(prompt)
    plan, scores = planned.plan, planned.scores
    assert planned.prompt is prompt and planned.selection_s is not None and planned.selection_s >= 0
    result = engine.execute(prompt, plan, scores=scores).wait()
    assert result.prompt is prompt and result.plan is plan
    assert result.timings.draft_s == scores.seconds
    assert result.text == engine.generate(QUESTION, PASSAGES).text  # same plan, same greedy answer
    assert engine.generate(QUESTION, PASSAGES).prompt.token_ids.equal(prompt.token_ids)


def test_generation_overrides_skip_unset_values():
    base = GenerationConfig(max_new_tokens=9, stop=("\n",))
    assert base.with_overrides(max_new_tokens=None, temperature=None) == base
    changed = base.with_overrides(max_new_tokens=3, stop=["x", ""], timeout=2.0)
    assert (changed.max_new_tokens, changed.stop, changed.timeout) == (3, ("x",), 2.0)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        base.with_overrides(max_new_tokens=0)


def test_warm_up_runs_the_draft_and_the_main_model(monkeypatch):
    engine = make_engine(make_tokenizer())
    drafted, prefilled = [], []
    score, stream = engine.draft.score_batch, engine.backend.stream_tokens
    monkeypatch.setattr(engine.draft, "score_batch", lambda ids, **kw: drafted.append(len(ids)) or score(ids, **kw))
    monkeypatch.setattr(engine.backend, "stream_tokens", lambda plan, gen: prefilled.append(plan) or stream(plan, gen))
    engine.warm_up()
    assert drafted == [1] and len(prefilled) == 1 and prefilled[0].speculated
    no_draft = make_engine(make_tokenizer(), draft=False)
    no_draft.warm_up()  # full prefill only
