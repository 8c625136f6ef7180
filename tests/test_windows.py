"""A prompt longer than the draft's window is read in windows (``DraftConfig.on_overflow="windows"``).

Each window holds every protected token (template, instructions, question) and one run of the
context; the runs cover the context exactly once. Scores: a context token gets its window's score
(equal to scoring that window alone), a protected token its highest; a prompt that fits is read
in one pass, as before; the engine plans such a prompt instead of prefilling it whole.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from helpers import PASSAGES, QUESTION, Calls, make_engine, make_model

from specprefill_rag import DraftConfig, SpecPrefillEngine
from specprefill_rag.draft import DraftModel
from specprefill_rag.draft.windows import MIN_WINDOW_CONTEXT
from specprefill_rag.errors import InputError

CFG = DraftConfig(lookahead=4, layers=(1, 2), upper_keep=0.3, memo_entries=0, prefix_cache_entries=0)


def _prompt(tokenizer, n: int = 300, protected: tuple[int, int] = (12, 20), seed: int = 3):
    """Token ids, a context mask (a protected head and tail) and the question (in the tail)."""
    ids = torch.randint(0, len(tokenizer), (n,), generator=torch.Generator().manual_seed(seed))
    context = torch.ones(n, dtype=torch.bool)
    head, tail = protected
    context[:head] = False
    context[n - tail:] = False
    return ids, context, torch.arange(n - tail + 2, n - 4)


def _draft(tokenizer, window: int) -> DraftModel:
    model = make_model("llama", len(tokenizer), layers=4)
    model.config.max_position_embeddings = window
    return DraftModel(model, tokenizer)


def test_windows_hold_the_protected_tokens_and_cover_the_context_once(tokenizer):
    draft = _draft(tokenizer, 128)
    ids, context, _ = _prompt(tokenizer)
    assert draft.windows(120, context[:120], 3) is None  # fits: one pass
    windows = draft.windows(300, context, 3)
    assert windows is not None and len(windows) == 3  # 268 context tokens, 128 - 3 - 32 = 93 per window
    protected = (~context).nonzero().flatten().tolist()
    runs = []
    for index in windows:
        assert draft.fits(int(index.numel()), 3) and torch.equal(index, index.sort().values)
        assert set(protected) <= set(index.tolist())
        runs.append([i for i in index.tolist() if context[i]])
    assert sorted(i for run in runs for i in run) == context.nonzero().flatten().tolist()
    assert max(map(len, runs)) - min(map(len, runs)) <= 1  # equal runs: no tiny last window
    assert all(run == list(range(run[0], run[-1] + 1)) for run in runs)  # consecutive tokens
    with pytest.raises(InputError, match=rf"leave 4 of the draft model's window of 128 for the context "
                                         rf"\(at least {MIN_WINDOW_CONTEXT} needed"):
        draft.windows(300, torch.cat([torch.zeros(101, dtype=torch.bool), context[101:]]), 3)  # 121 protected
    with pytest.raises(InputError, match="no prunable context"):
        draft.windows(300, None, 3)


def test_windowed_scores_are_each_windows_own(tokenizer):
    """Each context token's score is what scoring its window alone gives it; a protected token
    gets the highest of its windows'; the question keeps its tokens in every window."""
    draft = _draft(tokenizer, 128)
    ids, context, question = _prompt(tokenizer)
    got = draft.score(ids, question=question, context=context, config=CFG)
    windows = draft.windows(300, context, CFG.extra_positions(CFG.lookahead))
    assert windows is not None and len(windows) == 3
    assert got.windows == 3 and torch.isfinite(got.scores).all()
    best = torch.full((300,), -torch.inf)
    for index in windows:
        local = torch.searchsorted(index, question)
        alone = draft.score(ids[index], question=local, context=context[index], config=CFG).scores
        mine = context[index]
        torch.testing.assert_close(got.scores[index][mine], alone[mine], atol=1e-6, rtol=1e-5)
        best[index] = torch.maximum(best[index], alone)
    torch.testing.assert_close(got.scores, best, atol=1e-6, rtol=1e-5)


def test_one_window_is_the_single_pass(tokenizer):
    """A prompt that fits is read in one pass; the windowed path over one window of the whole
    prompt gives exactly that pass's scores."""
    draft = _draft(tokenizer, 512)
    ids, context, question = _prompt(tokenizer)
    whole = draft.score(ids, question=question, context=context, config=CFG)
    assert whole.windows == 1
    (one,) = draft._score_windowed([ids], [question], [context], [[torch.arange(300)]], CFG)
    torch.testing.assert_close(one.scores, whole.scores, atol=0, rtol=0)


def test_batches_mix_prompts_that_fit_and_prompts_in_windows(tokenizer):
    draft = _draft(tokenizer, 128)
    long_ids, long_context, long_question = _prompt(tokenizer)
    short_ids, short_context, short_question = _prompt(tokenizer, n=100, seed=4)
    batch = draft.score_batch([short_ids, long_ids], questions=[short_question, long_question],
                              contexts=[short_context, long_context], config=CFG)
    assert [s.windows for s in batch] == [1, 3]
    torch.testing.assert_close(batch[0].scores, draft.score(short_ids, question=short_question,
                                                            context=short_context, config=CFG).scores)
    torch.testing.assert_close(batch[1].scores, draft.score(long_ids, question=long_question,
                                                            context=long_context, config=CFG).scores)


def test_the_engine_plans_a_prompt_longer_than_the_drafts_window(tokenizer, caplog):
    """Default ``on_overflow="windows"``: planned, not prefilled whole; ``"full"`` keeps the
    old fall-back; windows that cannot hold the context fall back with the reason."""
    engine = make_engine(tokenizer)
    prompt = engine.assemble(QUESTION, PASSAGES)
    n_protected = int(prompt.protected.sum())
    extra = engine.config.draft.extra_positions(engine.config.draft.lookahead)
    engine.draft.model.config.max_position_embeddings = n_protected + extra + 2 * MIN_WINDOW_CONTEXT
    assert not engine.draft_fits(prompt) and engine.config.draft.on_overflow == "windows"
    assert engine.draft_reads(prompt)
    with caplog.at_level(logging.INFO, logger="specprefill_rag.draft"):
        result = engine.generate(QUESTION, PASSAGES)
    assert result.plan.speculated and result.prefilled_tokens < prompt.n_tokens
    assert result.draft_windows >= 2 and result.to_dict()["draft_windows"] == result.draft_windows
    assert "the draft reads it in" in caplog.text and "windows" in caplog.text
    assert engine.score(prompt).windows >= 2
    full = SpecPrefillEngine(engine.backend, engine.draft, dataclasses.replace(
        engine.config, draft=dataclasses.replace(engine.config.draft, on_overflow="full")))
    whole = full.generate(QUESTION, PASSAGES)
    assert not whole.plan.speculated and whole.draft_windows == 0 and not full.draft_reads(prompt)
    engine.draft.model.config.max_position_embeddings = n_protected + extra + MIN_WINDOW_CONTEXT - 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specprefill_rag.draft"):
        assert not engine.generate(QUESTION, PASSAGES).plan.speculated
    assert not engine.draft_reads(prompt)
    assert "cannot be read in windows" in caplog.text and "prefilling the whole prompt" in caplog.text
    assert make_engine(tokenizer).generate(QUESTION, PASSAGES).draft_windows == 1  # its own window: one pass


def test_the_windows_are_decided_once_per_request(tokenizer):
    """``DraftScorer.reading`` decides the windows; the draft's run reads them as decided (before,
    the engine decided whether windows could hold the prompt and ``score_batch`` decided again)."""
    engine = make_engine(tokenizer)
    prompt = engine.assemble(QUESTION, PASSAGES)
    extra = engine.config.draft.extra_positions(engine.config.draft.lookahead)
    engine.draft.model.config.max_position_embeddings = int(prompt.protected.sum()) + extra + 2 * MIN_WINDOW_CONTEXT
    decided = Calls(engine.draft, "windows")
    result = engine.generate(QUESTION, PASSAGES)
    assert result.draft_windows >= 2 and decided.runs == 1
