"""A draft with another tokenizer and chat template than the main model (tiny random models)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import CORPUS, PASSAGES, QUESTION, make_model, make_tokenizer

from specprefill_rag import (
    DraftConfig,
    DraftModel,
    GenerationConfig,
    InputError,
    SegmentKind,
    SelectionConfig,
    SpecPrefillConfig,
    SpecPrefillEngine,
    testing,
)
from specprefill_rag.backends.transformers import TransformersBackend
from specprefill_rag.draft import scorer as scorer_lib
from specprefill_rag.prompt import render


def make_engine(main_tok, draft_tok, *, mapping="auto", keep_rate=0.3, draft_window=2048):
    config = SpecPrefillConfig(
        draft=DraftConfig(lookahead=3, tokenizer_mapping=mapping),
        selection=SelectionConfig(keep_rate=keep_rate, min_prompt_tokens=64),
        generation=GenerationConfig(max_new_tokens=4),
    )
    draft_model = make_model("llama", len(draft_tok), seed=1)
    draft_model.config.max_position_embeddings = draft_window
    main = TransformersBackend(make_model("qwen2", len(main_tok), seed=0), main_tok)
    return SpecPrefillEngine(main, DraftModel(draft_model, draft_tok), config)


@pytest.fixture(scope="module")
def tokenizers():
    return make_tokenizer(), testing.tiny_inst_tokenizer(CORPUS)


def test_cross_family_draft_runs_and_protects_the_question(tokenizers, monkeypatch):
    main_tok, draft_tok = tokenizers
    engine = make_engine(main_tok, draft_tok)
    assert engine.maps_tokens
    seen = []
    real_score = engine.draft.score_batch
    monkeypatch.setattr(engine.draft, "score_batch", lambda ids, **kw: seen.extend(ids) or real_score(ids, **kw))

    result = engine.generate(QUESTION, PASSAGES)
    main_prompt = engine.assemble(QUESTION, PASSAGES)
    draft_prompt = render.assemble(draft_tok, main_prompt.segments)
    # The draft read its own tokens of its own rendering, not the main model's ids.
    assert len(seen) == 1 and torch.equal(seen[0], draft_prompt.token_ids)
    assert draft_prompt.n_tokens != main_prompt.n_tokens and draft_prompt.text != main_prompt.text

    plan = result.plan
    assert plan.speculated and plan.n_prompt == main_prompt.n_tokens and plan.next_position == plan.n_prompt
    assert result.prefilled_tokens < 0.5 * plan.n_prompt
    by_kind = {s.kind: s for s in plan.kept_spans}
    assert by_kind[SegmentKind.QUESTION].keep_ratio == 1.0
    assert by_kind[SegmentKind.INSTRUCTIONS].keep_ratio == 1.0
    question = [i for i, s in enumerate(main_prompt.segments) if s.kind is SegmentKind.QUESTION][0]
    q_tokens = (main_prompt.segment_index == question).nonzero().flatten().tolist()
    assert set(q_tokens) <= set(plan.position_ids.tolist())
    assert result.timings.draft_s is not None and result.timings.draft_s > 0
    assert len(result.token_ids) == 4


def test_mapped_scores_follow_the_draft(tokenizers):
    """Scores on the main tokens are the draft's scores carried over by character overlap."""
    main_tok, draft_tok = tokenizers
    engine = make_engine(main_tok, draft_tok)
    main_prompt = engine.assemble(QUESTION, PASSAGES)
    scores = engine.score(main_prompt).scores
    assert scores.shape == (main_prompt.n_tokens,) and bool(torch.isfinite(scores).all())
    content = main_prompt.segment_index >= 0
    assert bool((scores[~main_prompt.protected] > 0).all()) and bool((scores[~content] == 0).all())
    # A main token's score is one of the draft scores of the tokens over the same characters.
    draft_prompt = render.assemble(draft_tok, main_prompt.segments, protect_tail_tokens=0)
    draft_scores = engine.draft.score(
        draft_prompt.token_ids,
        question=draft_prompt.positions_of(SegmentKind.QUESTION),
        context=~draft_prompt.protected,
        config=engine.config.draft,
    ).scores
    needle = main_prompt.text.index("48213")
    m = int(((main_prompt.offsets[:, 0] <= needle) & (main_prompt.offsets[:, 1] > needle)).nonzero()[0])
    d_needle = draft_prompt.text.index("48213")
    d_hit = (draft_prompt.offsets[:, 0] < d_needle - needle + int(main_prompt.offsets[m, 1])) & (
        draft_prompt.offsets[:, 1] > d_needle - needle + int(main_prompt.offsets[m, 0])
    )
    assert torch.isclose(scores[m], draft_scores[d_hit].max())


def test_offsets_mode_on_one_tokenizer_reproduces_the_direct_scores(tokenizers):
    main_tok, _ = tokenizers
    direct = make_engine(main_tok, main_tok, mapping="auto")
    mapped = make_engine(main_tok, main_tok, mapping="offsets")
    assert not direct.maps_tokens and mapped.maps_tokens
    p = direct.assemble(QUESTION, PASSAGES)
    a, b = direct.score(p).scores, mapped.score(p).scores
    content = p.segment_index >= 0
    assert torch.allclose(a[content], b[content])


def test_same_tokenizer_does_not_map(tokenizers, monkeypatch):
    main_tok, _ = tokenizers
    engine = make_engine(main_tok, main_tok)

    def boom(*args, **kwargs):
        raise AssertionError("the same-tokenizer path must not map scores")

    monkeypatch.setattr(scorer_lib, "map_scores", boom)
    renders = []
    real_assemble = render.assemble
    monkeypatch.setattr(render, "assemble", lambda *a, **kw: renders.append(a[0]) or real_assemble(*a, **kw))
    assert not engine.maps_tokens
    assert engine.generate(QUESTION, PASSAGES).plan.speculated
    assert renders == [main_tok]  # one rendering: the draft reads the main prompt itself


def test_same_mode_rejects_another_tokenizer(tokenizers):
    main_tok, draft_tok = tokenizers
    with pytest.raises(ValueError, match=r"differs from the main model's.*tokenizer_mapping='auto'"):
        make_engine(main_tok, draft_tok, mapping="same")


def test_slow_tokenizer_is_rejected_for_mapping(tokenizers):
    main_tok, draft_tok = tokenizers

    class Slow(type(draft_tok)):
        @property
        def is_fast(self):
            return False

    slow = Slow(tokenizer_object=draft_tok.backend_tokenizer, eos_token="</s>", unk_token="<unk>")
    with pytest.raises(ValueError, match="draft tokenizer .* slow tokenizer without character offsets"):
        make_engine(main_tok, slow)


def test_draft_window_applies_to_the_drafts_own_tokens(tokenizers, caplog):
    main_tok, draft_tok = tokenizers
    engine = make_engine(main_tok, draft_tok, draft_window=128)
    p = engine.assemble(QUESTION, PASSAGES)
    n_draft = render.assemble(draft_tok, p.segments).n_tokens
    assert not engine.draft_fits(p)
    # Default (windows): its protected tokens leave too little of 128 for the context, so it is
    # prefilled whole, with a warning naming the draft's own count.
    with caplog.at_level("WARNING", logger="specprefill_rag.draft"):
        result = engine.generate(QUESTION, PASSAGES)
    assert not result.plan.speculated and result.prefilled_tokens == p.n_tokens
    assert f"prompt of {n_draft} draft tokens" in caplog.text and "window of 128" in caplog.text
    # on_overflow="raise": refused when the stream is made, before any model runs.
    strict = dataclasses.replace(
        engine.config, draft=dataclasses.replace(engine.config.draft, on_overflow="raise")
    )
    engine = SpecPrefillEngine(engine.backend, engine.draft, strict)
    with pytest.raises(InputError, match=rf"prompt of {n_draft} draft tokens .* draft model's window of 128"):
        engine.stream(QUESTION, PASSAGES)
    assert engine.generate(QUESTION, PASSAGES, mode="full").prefilled_tokens == p.n_tokens


@pytest.mark.parametrize("on_overflow, max_batch", [("full", 1), ("raise", 1), ("full", 4)])
def test_the_draft_renders_each_request_once(tokenizers, monkeypatch, on_overflow, max_batch):
    """The window check and the scoring share one rendering in the draft's template."""
    main_tok, draft_tok = tokenizers
    engine = make_engine(main_tok, draft_tok)
    config = dataclasses.replace(
        engine.config, draft=dataclasses.replace(engine.config.draft, on_overflow=on_overflow, max_batch=max_batch)
    )
    engine = SpecPrefillEngine(engine.backend, engine.draft, config)
    renders = []
    real_assemble = render.assemble
    monkeypatch.setattr(render, "assemble", lambda tok, *a, **kw: renders.append(tok) or real_assemble(tok, *a, **kw))
    result = engine.generate(QUESTION, PASSAGES)
    assert result.plan.speculated
    assert sum(tok is draft_tok for tok in renders) == 1


def test_bad_tokenizer_mapping_value():
    with pytest.raises(ValueError, match="tokenizer_mapping must be"):
        DraftConfig(tokenizer_mapping="bytes")  # type: ignore[arg-type]
