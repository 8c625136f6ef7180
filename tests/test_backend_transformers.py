"""Transformers backend: exact positions, reference equality, decoding controls."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import make_model

from specprefill_rag.backends import available_backends, create_backend
from specprefill_rag.backends.transformers import TransformersBackend, sample_token
from specprefill_rag.config import GenerationConfig
from specprefill_rag.types import PrefillPlan


def reference_logits(model, ids: list[int], positions: list[int]) -> torch.Tensor:
    """Last-token logits of one uncached eager forward with an explicit 4D causal mask."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    n = len(ids)
    causal = torch.full((n, n), torch.finfo(torch.float32).min).triu(1).reshape(1, 1, n, n)
    with torch.no_grad():
        out = eager(
            input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions]),
            attention_mask=causal, use_cache=False,
        )
    return out.logits[0, -1]


def make_plan(ids: torch.Tensor, kept: list[int], n_prompt: int) -> PrefillPlan:
    return PrefillPlan(
        token_ids=ids[kept], position_ids=torch.tensor(kept), next_position=n_prompt,
        n_prompt=n_prompt, kept_spans=(), speculated=True,
    )


@pytest.fixture
def backend(family, tokenizer):
    return TransformersBackend(make_model(family, len(tokenizer)), tokenizer)


def test_plan_logits_equal_reference_at_original_positions(backend):
    ids = torch.randint(0, 300, (80,), generator=torch.Generator().manual_seed(0))
    kept = [0, 1, 2, 10, 11, 12, 13, 40, 41, 77, 78, 79]
    state = backend.prefill(make_plan(ids, kept, 80))
    ref = reference_logits(backend.model, ids[kept].tolist(), kept)
    torch.testing.assert_close(state.logits, ref, atol=1e-4, rtol=1e-4)
    # Contiguous re-indexing is a different computation: the positions really reach RoPE.
    contiguous = reference_logits(backend.model, ids[kept].tolist(), list(range(len(kept))))
    assert (state.logits - contiguous).abs().max() > 1e-2


def test_decode_continues_at_original_length(backend):
    ids = torch.randint(0, 300, (60,), generator=torch.Generator().manual_seed(1))
    kept = list(range(0, 60, 3))
    state = backend.prefill(make_plan(ids, kept, 60))
    state = backend.decode_step(state, 7)
    state = backend.decode_step(state, 9)
    assert state.next_position == 62 and state.n_cached == len(kept) + 2
    ref = reference_logits(backend.model, ids[kept].tolist() + [7, 9], kept + [60, 61])
    torch.testing.assert_close(state.logits, ref, atol=1e-4, rtol=1e-4)
    wrong = reference_logits(backend.model, ids[kept].tolist() + [7, 9], kept + [len(kept), len(kept) + 1])
    assert (state.logits - wrong).abs().max() > 1e-2


def test_full_plan_reproduces_generate_token_for_token(backend):
    ids = torch.randint(0, 300, (50,), generator=torch.Generator().manual_seed(2))
    plan = make_plan(ids, list(range(50)), 50)
    ours = list(backend.stream_tokens(plan, GenerationConfig(max_new_tokens=12)))
    theirs = backend.model.generate(
        ids.reshape(1, -1), attention_mask=torch.ones(1, 50, dtype=torch.int64),
        max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0,
    )[0, 50:].tolist()
    assert ours == theirs


def test_stops_at_eos(family, tokenizer):
    model = make_model(family, len(tokenizer))
    ids = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(3))
    plan = make_plan(ids, list(range(20)), 20)
    greedy = list(TransformersBackend(model, tokenizer).stream_tokens(plan, GenerationConfig(max_new_tokens=5)))
    model.generation_config.eos_token_id = greedy[2]
    stopped = list(TransformersBackend(model, tokenizer).stream_tokens(plan, GenerationConfig(max_new_tokens=5)))
    assert stopped == greedy[: greedy.index(greedy[2])]


def test_window_limits_generation(tokenizer):
    backend = TransformersBackend(make_model("llama", len(tokenizer)), tokenizer)
    ids = torch.randint(0, 300, (10,))
    plan = PrefillPlan(ids, torch.arange(2038, 2048), 2048, 2048, (), True)
    with pytest.raises(ValueError, match="beyond the main model's window"):
        backend.prefill(PrefillPlan(ids, torch.arange(2039, 2049), 2049, 2049, (), True))
    assert list(backend.stream_tokens(plan, GenerationConfig(max_new_tokens=5))) == []


def test_sampling_is_seeded_and_filters():
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0])
    gen = GenerationConfig(temperature=1.0, seed=0)
    draws = [sample_token(logits, gen, torch.Generator().manual_seed(s)) for s in range(40)]
    assert set(draws) <= {0, 1, 2, 3} and len(set(draws)) > 1
    assert draws == [sample_token(logits, gen, torch.Generator().manual_seed(s)) for s in range(40)]
    top2 = GenerationConfig(temperature=1.0, top_k=2)
    assert {sample_token(logits, top2, torch.Generator().manual_seed(s)) for s in range(40)} == {1, 2}
    nucleus = GenerationConfig(temperature=1.0, top_p=0.4)
    assert {sample_token(logits, nucleus, torch.Generator().manual_seed(s)) for s in range(40)} == {1}
    assert sample_token(logits, GenerationConfig(), None) == 1
    # A top_p float32 reads as 0 (the gateway's fuzzer sent 1e-300: a 500 before) keeps the likeliest.
    tiny = GenerationConfig(temperature=1.0, top_p=1e-300)
    assert {sample_token(logits, tiny, torch.Generator().manual_seed(s)) for s in range(10)} == {1}


def test_seeded_sampling_reproduces(backend):
    ids = torch.randint(0, 300, (30,), generator=torch.Generator().manual_seed(4))
    plan = make_plan(ids, list(range(30)), 30)
    gen = GenerationConfig(max_new_tokens=8, temperature=1.5, seed=123)
    assert list(backend.stream_tokens(plan, gen)) == list(backend.stream_tokens(plan, gen))


def test_registry():
    assert "transformers" in available_backends()
    with pytest.raises(ValueError, match="unknown backend 'nope'; available: transformers, vllm_offline, vllm_server"):
        create_backend("nope")


@pytest.mark.parametrize(
    "kwargs, message",
    [({"max_new_tokens": 0}, "max_new_tokens"), ({"temperature": -1}, "temperature"),
     ({"top_p": 0}, "top_p"), ({"stop": ("",)}, "stop")],
)
def test_generation_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GenerationConfig(**kwargs)
