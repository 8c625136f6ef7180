"""Draft capture and scoring against an eager-attention reference."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from helpers import lookahead_spec, make_model

from specprefill_rag.config import DraftConfig
from specprefill_rag.draft import DraftModel, scoring
from specprefill_rag.draft.probe import LookaheadSpec, Recorder


def eager_reference_rows(model, ids: torch.Tensor, lookahead_ids: tuple[int, ...]) -> list[torch.Tensor]:
    """Per layer (heads, L, n): eager attention of the last prompt token and the look-ahead
    tokens, restricted to prompt keys and renormalised (= softmax over prompt keys only)."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    n = ids.numel()
    full = torch.cat([ids, torch.tensor(lookahead_ids, dtype=torch.int64)]).reshape(1, -1)
    with torch.no_grad():
        out = eager(input_ids=full, output_attentions=True)
    rows = []
    for attn in out.attentions:  # (1, heads, total, total)
        a = attn[0, :, n - 1 :, :n].double()
        rows.append((a / a.sum(-1, keepdim=True)).float())
    return rows


@pytest.mark.parametrize("lookahead", [1, 4])
def test_captured_rows_match_eager_reference(family, tokenizer, lookahead):
    model = make_model(family, len(tokenizer))
    # The reference's greedy look-ahead: a causal chain the eager forward reproduces.
    draft = DraftModel(model, tokenizer, DraftConfig(lookahead=lookahead, lookahead_tokens="greedy"))
    ids = torch.randint(0, len(tokenizer), (57,), generator=torch.Generator().manual_seed(1))
    cap = draft.capture(ids)
    assert len(cap.lookahead_token_ids) == lookahead - 1
    reference = eager_reference_rows(model, ids, cap.lookahead_token_ids)
    assert len(cap.queries) == len(reference) == model.config.num_hidden_layers
    for layer, ref in enumerate(reference):
        q, k = cap.queries[layer], cap.keys[layer]
        assert q.shape == (4, lookahead, 16) and k.shape == (2, 57, 16)  # GQA: 4 query, 2 kv heads
        rows = scoring.attention_rows(q, k, cap.scaling[layer])
        assert rows.shape == (4, lookahead, 57)
        torch.testing.assert_close(rows, ref, atol=1e-4, rtol=0)


def test_capture_leaves_model_outputs_unchanged(family, tokenizer):
    model = make_model(family, len(tokenizer))
    ids = torch.randint(0, len(tokenizer), (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = model(ids).logits
    draft = DraftModel(model, tokenizer)
    draft.capture(ids[0])
    with torch.no_grad():
        after = model(ids).logits
    torch.testing.assert_close(after, before, atol=1e-5, rtol=0)


def test_lookahead_tokens_are_greedy_continuation(tokenizer):
    model = make_model("llama", len(tokenizer))
    ids = torch.randint(0, len(tokenizer), (30,), generator=torch.Generator().manual_seed(3))
    cap = DraftModel(model, tokenizer, DraftConfig(lookahead=5, lookahead_tokens="greedy")).capture(ids)
    expected = model.generate(ids.reshape(1, -1), max_new_tokens=4, do_sample=False,
                              attention_mask=torch.ones(1, 30, dtype=torch.int64))[0, 30:]
    assert list(cap.lookahead_token_ids) == expected.tolist()


def test_attention_rows_gqa_equals_repeated_keys():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, 3, 8, generator=g)
    k = torch.randn(2, 11, 8, generator=g)
    rows = scoring.attention_rows(q, k, 0.35)
    k_rep = k.repeat_interleave(3, dim=0)  # head h uses kv head h // 3
    ref = torch.softmax(torch.einsum("hld,hnd->hln", q, k_rep) * 0.35, dim=-1)
    torch.testing.assert_close(rows, ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(rows.sum(-1), torch.ones(6, 3))


def test_attention_rows_rejects_mismatched_heads():
    with pytest.raises(ValueError, match="do not fit"):
        scoring.attention_rows(torch.randn(5, 1, 8), torch.randn(2, 4, 8), 1.0)


def test_pool_rows_is_centered_moving_average():
    rows = torch.zeros(1, 1, 20)
    rows[0, 0, 10] = 13.0
    pooled = scoring.pool_rows(rows, 13)
    assert pooled.shape == rows.shape
    assert torch.allclose(pooled[0, 0, 4:17], torch.ones(13))
    assert pooled[0, 0, :4].abs().sum() == 0 and pooled[0, 0, 17:].abs().sum() == 0
    assert torch.equal(scoring.pool_rows(rows, 1), rows)


def test_importance_is_mean_over_lookahead_of_max_over_layers():
    per_layer = torch.tensor(
        [[[0.1, 0.9, 0.0], [0.3, 0.1, 0.6]],
         [[0.5, 0.2, 0.3], [0.2, 0.2, 0.6]]]
    )  # (layers=2, lookahead=2, n=3)
    expected = torch.tensor([(0.5 + 0.3) / 2, (0.9 + 0.2) / 2, (0.3 + 0.6) / 2])
    torch.testing.assert_close(scoring.importance(per_layer), expected)
    with pytest.raises(ValueError, match="layers, lookahead, n_prompt"):
        scoring.importance(torch.zeros(0, 1, 3))


def test_score_uses_chosen_layers(tokenizer):
    model = make_model("qwen2", len(tokenizer), layers=4)
    ids = torch.randint(0, len(tokenizer), (64,), generator=torch.Generator().manual_seed(4))
    all_layers = DraftModel(model, tokenizer, DraftConfig(lookahead=2, layers="all")).score(ids)
    # Both layer choices end at the top layer: siblings read off its input, as the capture's.
    cap = DraftModel(model, tokenizer, DraftConfig(lookahead=2)).capture(ids, spec=LookaheadSpec(2, early_exit=True))
    upper = DraftModel(model, tokenizer, DraftConfig(lookahead=2, layers="upper_half")).score(ids)
    per_layer = torch.stack([scoring.layer_rows(cap.queries[i], cap.keys[i], cap.scaling[i], 13) for i in range(4)])
    torch.testing.assert_close(all_layers.scores, scoring.importance(per_layer))
    torch.testing.assert_close(upper.scores, scoring.importance(per_layer[2:]))
    assert all_layers.scores.shape == (64,) and all_layers.scores.dtype == torch.float32
    with pytest.raises(ValueError, match="do not exist"):
        DraftModel(model, tokenizer, DraftConfig(layers=(7,))).score(ids)


def test_draft_rejects_empty_and_too_long_prompts(tokenizer):
    draft = DraftModel(make_model("llama", len(tokenizer)), tokenizer)
    with pytest.raises(ValueError, match="empty prompt"):
        draft.score(torch.tensor([], dtype=torch.int64))
    # prompt + the look-ahead's positions (siblings: one) > the window
    one_over = 2048 - draft.config.extra_positions(draft.config.lookahead) + 1
    with pytest.raises(ValueError, match="window of 2048"):
        draft.score(torch.zeros(one_over, dtype=torch.int64))
    assert draft.score(torch.zeros(one_over - 1, dtype=torch.int64)).scores.numel() == one_over - 1


def test_recorder_keeps_only_the_query_rows_it_needs():
    # A view of the last row would pin the whole prefill query (heads × n × dim per layer)
    # in memory through the look-ahead; the recorder must hold a copy of one row.
    module = SimpleNamespace(layer_idx=0, scaling=0.125)
    recorder = Recorder([300], [None])
    query, key = torch.randn(1, 4, 300, 16), torch.randn(1, 2, 300, 16)
    recorder.record(module, query, key, None)
    recorder.record(module, torch.randn(1, 4, 1, 16), torch.randn(1, 2, 301, 16), None)
    kept = recorder.queries[0][0]
    assert [q.shape for q in kept] == [(4, 1, 16), (4, 1, 16)]
    assert kept[0].untyped_storage().nbytes() == 4 * 16 * query.element_size()
    assert torch.equal(kept[0], query[0, :, -1:])
    assert recorder.keys[0][0].shape == (2, 300, 16) and recorder.scaling[0] == 0.125


def test_question_queries_match_eager_rows_at_their_positions(tokenizer):
    """Question-token queries see keys 0..p only: the rows equal eager attention at row p."""
    model = make_model("qwen2", len(tokenizer))
    ids = torch.randint(0, len(tokenizer), (48,), generator=torch.Generator().manual_seed(5))
    question = torch.tensor([40, 41, 44])
    cap = DraftModel(model, tokenizer).capture(ids, question, spec=LookaheadSpec(3))
    assert cap.n_question == 3 and cap.positions.tolist() == [40, 41, 44, 47, 47, 47]
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        out = eager(input_ids=ids.reshape(1, -1), output_attentions=True)
    for layer, attn in enumerate(out.attentions):  # (1, heads, 48, 48)
        rows = scoring.attention_rows(cap.queries[layer], cap.keys[layer], cap.scaling[layer], cap.positions)
        torch.testing.assert_close(rows[:, :3], attn[0, :, question].float(), atol=1e-4, rtol=0)
        assert rows[:, 0, 41:].abs().max() == 0  # no future keys for the query at 40


def test_query_weights_split_the_vote_between_groups():
    w = scoring.query_weights(4, 2, 0.5)
    torch.testing.assert_close(w, torch.tensor([0.125] * 4 + [0.25] * 2))
    torch.testing.assert_close(scoring.query_weights(3, 1, 0.0), torch.tensor([1 / 3] * 3 + [0.0]))
    torch.testing.assert_close(scoring.query_weights(0, 4, 0.0), torch.full((4,), 0.25))  # no question
    with pytest.raises(ValueError, match="lookahead_weight"):
        scoring.query_weights(2, 2, 1.5)


def test_normalized_rows_rank_context_tokens_only():
    rows = torch.tensor([[[0.90, 0.02, 0.06, 0.02]], [[0.10, 0.40, 0.10, 0.40]]])  # 2 heads, 1 query
    context = torch.tensor([False, True, True, True])
    out = scoring.normalize_rows(rows, context)
    torch.testing.assert_close(out[0, 0], torch.tensor([0.0, 0.2, 0.6, 0.2]))
    torch.testing.assert_close(out.sum(-1), torch.ones(2, 1))


def test_score_with_question_uses_both_query_groups(tokenizer):
    model = make_model("llama", len(tokenizer), layers=4)
    ids = torch.randint(0, len(tokenizer), (60,), generator=torch.Generator().manual_seed(6))
    question = torch.arange(50, 56)
    draft = DraftModel(model, tokenizer)
    cfg = DraftConfig(lookahead=3, lookahead_weight=0.25, layers="middle_half")
    got = draft.score(ids, question=question, config=cfg).scores
    cap = draft.capture(ids, question, spec=lookahead_spec(draft, 3, layers=[1, 2], early_exit=True))
    per_layer = torch.stack(
        [scoring.layer_rows(cap.queries[i], cap.keys[i], cap.scaling[i], 13, positions=cap.positions) for i in (0, 1)]
    )
    expected = 0.75 * per_layer[:, :6].amax(0).mean(0) + 0.25 * per_layer[:, 6:].amax(0).mean(0)
    torch.testing.assert_close(got, expected)
    # With no vote for the look-ahead, the draft decodes nothing.
    only_question = draft.score(ids, question=question, config=DraftConfig(lookahead_weight=0.0))
    assert only_question.lookahead_token_ids == ()


def test_shared_draft_keeps_its_config_across_engines():
    from specprefill_rag import SpecPrefillConfig, SpecPrefillEngine
    from specprefill_rag.backends.transformers import TransformersBackend
    from specprefill_rag.testing import tiny_model, tiny_tokenizer

    tok = tiny_tokenizer()
    model = tiny_model("llama", len(tok), seed=0, layers=2)
    draft = DraftModel(model, tok, DraftConfig(lookahead=2))
    backend = TransformersBackend(model, tok, name="tiny")
    SpecPrefillEngine(backend, draft, SpecPrefillConfig(draft=DraftConfig(lookahead=5, layers="all")))
    assert draft.config == DraftConfig(lookahead=2)


@pytest.mark.parametrize("layers", ["middle_half", "lower_half", (0, 2)])
def test_early_exit_scores_equal_the_full_forward(tokenizer, layers):
    """Look-ahead 1: the prefill stops after the highest aggregated layer, scores unchanged."""
    model = make_model("qwen2", len(tokenizer), layers=8)
    ids = torch.randint(0, len(tokenizer), (96,), generator=torch.Generator().manual_seed(7))
    question = torch.arange(80, 90)
    draft = DraftModel(model, tokenizer)
    ran: list[int] = []
    hooks = [
        layer.register_forward_pre_hook(lambda module, args, i=i: ran.append(i))
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        scores = {}
        for early in (False, True):
            ran.clear()
            config = DraftConfig(lookahead_weight=0.0, layers=layers, early_exit=early)
            scores[early] = draft.score(ids, question=question, config=config).scores
            top = max(config.layer_indices(8))
            assert ran == (list(range(top + 1)) if early else list(range(8)))
    finally:
        for hook in hooks:
            hook.remove()
    assert torch.equal(scores[True], scores[False])


def test_capture_of_a_layer_subset_equals_the_full_capture(tokenizer):
    model = make_model("llama", len(tokenizer), layers=4)
    ids = torch.randint(0, len(tokenizer), (64,), generator=torch.Generator().manual_seed(3))
    draft = DraftModel(model, tokenizer)
    full = draft.capture(ids, spec=lookahead_spec(draft, 3, tokens="greedy"))
    part = draft.capture(ids, spec=lookahead_spec(draft, 3, layers=[1, 2], tokens="greedy"))
    assert full.layer_ids == (0, 1, 2, 3) and part.layer_ids == (1, 2)
    for j, layer in enumerate(part.layer_ids):
        assert torch.equal(part.queries[j], full.queries[layer]) and torch.equal(part.keys[j], full.keys[layer])
    # Early exit with greedy steps: the layers above the top recorded one read a reading set;
    # reading the whole prompt, the steps are the full decode's.
    early = draft.capture(ids,
                          spec=lookahead_spec(draft, 3, layers=[0], early_exit=True, tokens="greedy", upper_keep=1.0))
    assert early.lookahead_token_ids == full.lookahead_token_ids


@pytest.mark.parametrize("config", [DraftConfig(lookahead=4), DraftConfig(lookahead_weight=0.0), DraftConfig()])
def test_batched_scoring_equals_one_by_one(tokenizer, config):
    """Prompts of different lengths scored in one padded batch score as they do alone."""
    model = make_model("qwen2", len(tokenizer), layers=4)
    draft = DraftModel(model, tokenizer)
    gen = torch.Generator().manual_seed(11)
    lengths = (70, 128, 33)
    prompts = [torch.randint(0, len(tokenizer), (n,), generator=gen) for n in lengths]
    questions = [torch.arange(n - 12, n - 4) for n in lengths[:2]] + [None]  # the last has no question
    contexts = [torch.arange(n) < n - 12 for n in lengths]
    batched = draft.score_batch(prompts, questions=questions, contexts=contexts, config=config)
    for ids, q, ctx, got in zip(prompts, questions, contexts, batched, strict=True):
        alone = draft.score(ids, question=q, context=ctx, config=config)
        assert got.lookahead_token_ids == alone.lookahead_token_ids
        torch.testing.assert_close(got.scores, alone.scores, atol=1e-6, rtol=1e-4)
    one = draft.score_batch(prompts[:1], questions=questions[:1], config=config)[0]
    assert torch.equal(one.scores, draft.score(prompts[0], question=questions[0], config=config).scores)
