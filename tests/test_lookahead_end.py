"""The greedy look-ahead stops where the draft's answer ends (``DraftConfig.lookahead_stop_at_eos``).

With the stop, a prompt's look-ahead feeds the tokens before the first end id and no more: its
tokens and recorded queries must be a prefix of the unstopped look-ahead's (the same forwards,
cut), on every greedy path (full forwards, early exit with one step per token, verified
guesses), alone and in a batch whose rows end at different tokens; the loop must run no forward
past the last row's end; and the scores must equal those of a look-ahead exactly as long.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import ForwardCounter, lookahead_spec, make_model

from specprefill_rag.config import DraftConfig
from specprefill_rag.draft import DraftModel
from specprefill_rag.errors import ConfigError

LAYERS = [1, 2]  # of 4: the top recorded layer is 2, so layer 3 (and the LM head) may be skipped

PATHS = {
    "full forwards": dict(early_exit=False),
    "early exit, one step per token": dict(early_exit=True, upper_keep=0.2, guesses=0),
    "early exit, verified guesses": dict(early_exit=True, upper_keep=0.2, guesses=6),
}


def _prompts(tokenizer, lengths=(70, 33, 128), seed: int = 11):
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, len(tokenizer), (n,), generator=gen) for n in lengths]
    return prompts, [torch.arange(n - 9, n - 2) for n in lengths]


def _cut(tokens, end_ids) -> int:
    return next((i for i, t in enumerate(tokens) if t in end_ids), len(tokens))


@pytest.mark.parametrize("path", PATHS)
def test_the_lookahead_is_the_unstopped_one_cut_before_the_answers_end(family, tokenizer, path):
    """End ids chosen among the tokens the draft writes: each row's tokens and query rows are the
    unstopped run's up to its first end token, alone and batched, rows ending at different tokens
    (one at its first token: no look-ahead row at all) or never."""
    draft = DraftModel(make_model(family, len(tokenizer), layers=4), tokenizer)
    prompts, questions = _prompts(tokenizer)
    kwargs = dict(layers=LAYERS, tokens="greedy", **PATHS[path])
    full = [draft.capture(p, q, spec=lookahead_spec(draft, 8, stop_at_eos=False, **kwargs))
            for p, q in zip(prompts, questions, strict=True)]
    runs = [list(c.lookahead_token_ids) for c in full]
    assert all(len(r) == 7 for r in runs)
    for ends in ({runs[0][3]}, {runs[1][0], runs[2][5]}, {runs[0][6], runs[1][2]}, set()):
        draft.end_ids = frozenset(ends)
        batched = draft.capture_batch(prompts, questions, spec=lookahead_spec(draft, 8, stop_at_eos=True, **kwargs))
        for b, (ids, q, reference) in enumerate(zip(prompts, questions, full, strict=True)):
            cut = _cut(runs[b], ends)
            for got in (batched[b], draft.capture(ids, q, spec=lookahead_spec(draft, 8, stop_at_eos=True, **kwargs))):
                assert list(got.lookahead_token_ids) == runs[b][:cut], (ends, b)
                rows = reference.n_question + 1 + cut
                assert got.positions.tolist() == reference.positions[:rows].tolist()
                for mine, theirs in zip(got.queries, reference.queries, strict=True):
                    assert mine.shape[1] == rows
                    torch.testing.assert_close(mine, theirs[:, :rows], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("guesses", "end_at"), [(0, 3), (0, 0), (0, 6), (6, 3)])
def test_no_forward_runs_past_the_end(tokenizer, guesses, end_at):
    """With early exit, a token that ends the answer at index e leaves e look-ahead forwards (the
    one feeding token e − 1 predicts the end): 3 instead of 7 for an end at 3, none when the first
    token ends it. With verified guesses, no more than one step per token would run."""
    model = make_model("qwen2", len(tokenizer), layers=4)
    draft = DraftModel(model, tokenizer)
    (ids,), (question,) = _prompts(tokenizer, (90,))
    kwargs = dict(layers=LAYERS, tokens="greedy", early_exit=True, upper_keep=0.2, guesses=guesses)
    tokens = list(draft.capture(ids, question,
                                spec=lookahead_spec(draft, 8, stop_at_eos=False, **kwargs)).lookahead_token_ids)
    draft.end_ids = frozenset({tokens[end_at]})
    counter = ForwardCounter(model)
    try:
        got = draft.capture(ids, question, spec=lookahead_spec(draft, 8, stop_at_eos=True, **kwargs))
    finally:
        counter.remove()
    cut = _cut(tokens, draft.end_ids)
    assert list(got.lookahead_token_ids) == tokens[:cut]
    (ran,) = counter.layers  # one model forward; the loop runs its layers by hand after it
    loop_forwards = sum(1 for i, _ in ran[4:] if i == 0)  # prompt: layers 0-2, reading set: layer 3
    assert cut <= end_at and (loop_forwards == cut if guesses == 0 else loop_forwards <= cut)


def test_scores_equal_a_lookahead_exactly_as_long(tokenizer):
    """``score`` with the stop equals ``score`` with a look-ahead of the answer's length and no
    stop: the same query rows, and the look-ahead group's weight spread over them."""
    draft = DraftModel(make_model("llama", len(tokenizer), layers=4), tokenizer)
    (ids,), (question,) = _prompts(tokenizer, (80,))
    cfg = DraftConfig(layers=(1, 2), upper_keep=0.2, memo_entries=0, prefix_cache_entries=0,
                      lookahead_stop_at_eos=False)
    tokens = list(draft.score(ids, question=question, config=cfg).lookahead_token_ids)
    for end_at in (0, 2, 5):
        draft.end_ids = frozenset({tokens[end_at]})
        cut = _cut(tokens, draft.end_ids)
        stopped = draft.score(ids, question=question, config=dataclasses.replace(cfg, lookahead_stop_at_eos=True))
        same_length = draft.score(ids, question=question, config=dataclasses.replace(cfg, lookahead=cut + 1))
        assert list(stopped.lookahead_token_ids) == tokens[:cut]
        torch.testing.assert_close(stopped.scores, same_length.scores, atol=1e-6, rtol=1e-5)


def test_end_ids_are_the_generation_configs_and_the_tokenizers(tokenizer):
    model = make_model("qwen2", len(tokenizer), layers=2)
    model.generation_config.eos_token_id = [7, 9]
    assert DraftModel(model, tokenizer).end_ids == frozenset({7, 9, tokenizer.eos_token_id} - {None})


def test_the_field_is_checked():
    with pytest.raises(ConfigError, match="lookahead_stop_at_eos must be True or False, got 'yes'"):
        DraftConfig(lookahead_stop_at_eos="yes")  # type: ignore[arg-type]
