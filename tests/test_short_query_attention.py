"""Attention of a few queries over a long cache (``draft.short_query_attention``), the look-ahead's path on a GPU.

It must compute what transformers' SDPA path computes (grouped heads, bool or additive masks,
a mask shared by the batch), and a draft whose look-ahead forwards take it must score and pick
tokens exactly as with SDPA (``benchmarks.suites.gpu_attention.sdpa``). The path serves CUDA tensors
only; here it is forced on the CPU by standing ``fits`` in for ``applies``. Its speed is measured
on a GPU (``benchmarks/suites/gpu_ttft.py``).
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_model

from benchmarks.suites.gpu_attention import sdpa
from specprefill_rag.config import DraftConfig
from specprefill_rag.draft import DraftModel
from specprefill_rag.draft import short_query_attention as attention


def _inputs(batch=2, heads=8, kv_heads=2, q=7, k=300, dim=16, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    query, key, value = (torch.randn(batch, h, n, dim, generator=gen).mul(3).to(dtype)
                         for h, n in ((heads, q), (kv_heads, k), (kv_heads, k)))
    # A look-ahead's mask: each row's valid prompt columns, and its own tokens causally.
    mask = torch.zeros(batch, 1, q, k, dtype=torch.bool)
    for b in range(batch):
        mask[b, 0, :, : k - q - 40 * b] = True  # the second row's prompt is shorter (padding)
        mask[b, 0, :, k - q:] = torch.ones(q, q, dtype=torch.bool).tril()
    return query, key, value, mask


@pytest.mark.parametrize(("heads", "kv_heads", "q"), [(8, 2, 7), (8, 2, 1), (4, 4, 3), (6, 1, 16)])
@pytest.mark.parametrize(("k", "block"), [(300, 512), (300, 64), (256, 64)], ids=["one-block", "blocks+rest", "blocks"])
def test_equals_sdpa_with_a_bool_mask(heads, kv_heads, q, k, block):
    """A cache shorter than a block, blocks and a remainder, blocks only."""
    query, key, value, mask = _inputs(heads=heads, kv_heads=kv_heads, q=q, k=k)
    got = attention.attend_short_queries(query, key, value, mask, 0.25, block=block)
    torch.testing.assert_close(got, sdpa(query, key, value, mask, 0.25), atol=1e-4, rtol=1e-4)
    assert got.shape == (2, q, heads, 16) and got.is_contiguous()


def test_equals_sdpa_with_an_additive_mask_shared_by_the_batch():
    query, key, value, mask = _inputs()
    bias = torch.where(mask[:1], 0.0, torch.finfo(torch.float32).min)  # (1, 1, q, k)
    bias[..., :50] += torch.linspace(-2, 2, 50)  # a real bias, not only 0 / -inf
    got = attention.attend_short_queries(query, key, value, bias, None, block=64)  # scaling None: 1/sqrt(dim)
    torch.testing.assert_close(got, sdpa(query, key, value, bias, None), atol=1e-4, rtol=1e-4)


def test_bfloat16_stays_within_its_rounding_of_float32():
    query, key, value, mask = _inputs(dtype=torch.bfloat16)
    got = attention.attend_short_queries(query, key, value, mask, 0.25, block=64)
    want = sdpa(query.float(), key.float(), value.float(), mask, 0.25)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=2e-2)


def test_a_row_that_may_attend_to_nothing_is_finite():
    query, key, value, mask = _inputs(batch=1)
    mask[0, 0, 2] = False
    got = attention.attend_short_queries(query, key, value, mask, 0.25)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[0, 2], value[0].mean(1).repeat_interleave(4, 0))


@pytest.mark.parametrize(
    ("q", "mask", "kwargs", "fits"),
    [
        (7, True, {"dropout": 0.0, "scaling": 0.25, "position_ids": 1, "use_cache": True}, True),
        (16, True, {}, True),
        (17, True, {}, False),  # a prompt's forward: SDPA
        (7, False, {}, False),  # no mask: SDPA's own causal rule
        (7, True, {"dropout": 0.1}, False),
        (7, True, {"position_bias": torch.zeros(1)}, False),
        (7, True, {"s_aux": torch.zeros(8)}, False),  # attention sinks
        (7, True, {"s_aux": None}, True),
    ],
)
def test_which_calls_it_serves(q, mask, kwargs, fits):
    query, key, _, full = _inputs(q=q)
    assert attention.fits(query, key, full if mask else None, kwargs) is fits
    assert attention.applies(query, key, full if mask else None, kwargs) is False  # a CPU tensor: SDPA


def test_odd_head_groups_go_to_sdpa():
    query, key, _, mask = _inputs(heads=6, kv_heads=4)
    assert not attention.fits(query, key, mask, {})


@pytest.mark.parametrize("config", [
    DraftConfig(layers=(1, 2), lookahead=7, lookahead_guesses=6),  # the default on a GPU: 7 tokens per forward
    DraftConfig(layers=(1, 2), lookahead=7, lookahead_guesses=0),  # one token per forward
    DraftConfig(layers=(1, 2), lookahead=4, lookahead_tokens="siblings"),
    DraftConfig(layers=(1, 2), lookahead=4, early_exit=False),
], ids=["guesses", "steps", "siblings", "full-forward"])
def test_a_draft_on_the_short_path_scores_and_reads_as_with_sdpa(family, tokenizer, monkeypatch, config):
    """Batched prompts of three lengths (padding), every look-ahead kind: the same look-ahead
    tokens and, within float tolerance, the same scores, with the look-ahead's forwards taken
    by the short path."""
    model = make_model(family, len(tokenizer), layers=4)
    draft = DraftModel(model, tokenizer, config)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, len(tokenizer), (n,), generator=gen) for n in (90, 41, 133)]
    questions = [torch.arange(n - 9, n - 2) for n in (90, 41, 133)]
    want = draft.score_batch(prompts, questions=questions)
    taken = []

    def forced(query, key, mask, kwargs):
        taken.append(attention.fits(query, key, mask, kwargs))
        return taken[-1]

    monkeypatch.setattr(attention, "applies", forced)
    monkeypatch.setattr(attention, "VALUE_BLOCK", 32)  # blocks and a remainder at these lengths
    got = draft.score_batch(prompts, questions=questions)
    assert any(taken) and not all(taken)  # the look-ahead's forwards, not the prompts'
    for a, b in zip(want, got, strict=True):
        assert a.lookahead_token_ids == b.lookahead_token_ids
        torch.testing.assert_close(a.scores, b.scores, atol=1e-5, rtol=1e-4)
