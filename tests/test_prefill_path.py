"""The transformers backend's prefill at non-contiguous positions: which attention call it makes,
what it computes, and that it never waits for the device.

On a GPU the main model's pruned prefill cost 46–54 ms whether it prefilled 512 or 1,728 tokens
(issue 47, item 3). What a forward does beyond its kernels is visible on the CPU: the SDPA call
it makes (spied), the logits (against a reference), and every operation that would make the
host wait for a GPU (counted). ``benchmarks/suites/gpu_ttft.py --profile`` measures the rest on a GPU.
"""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import make_model
from torch.utils._python_dispatch import TorchDispatchMode

from specprefill_rag.backends.transformers import MASK_FREE, TransformersBackend
from specprefill_rag.draft import CAPTURE_ATTENTION, DraftModel
from specprefill_rag.types import PrefillPlan

KEPT = [0, 1, 2, 10, 11, 12, 13, 40, 41, 77, 78, 79]  # gaps: what a SpecPrefill plan looks like
N_PROMPT = 80


def plan_of(ids: torch.Tensor, kept: list[int], n_prompt: int = N_PROMPT) -> PrefillPlan:
    return PrefillPlan(token_ids=ids[kept], position_ids=torch.tensor(kept), next_position=n_prompt,
                       n_prompt=n_prompt, kept_spans=(), speculated=True)


def prompt(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 300, (N_PROMPT,), generator=torch.Generator().manual_seed(seed))


# -- host synchronisations -------------------------------------------------------------------

# Operations that make the host wait for a CUDA device: a scalar read (``item``, ``bool``,
# ``int``, ``float`` all reach ``_local_scalar_dense``; ``is_nonzero`` is ``bool`` of one
# element) and operations whose output size depends on the data (``index`` with a boolean mask
# runs ``nonzero`` on a GPU, not on a CPU: counted apart).
_SYNCING_OPS = frozenset({"_local_scalar_dense", "is_nonzero", "item", "nonzero", "masked_select", "unique",
                          "_unique", "_unique2", "unique_consecutive", "repeat_interleave", "equal"})
_SYNCING_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class _Syncs(TorchDispatchMode):
    """Counts the syncing operations that pass through the dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name in _SYNCING_OPS:
            self.seen[f"aten.{name}"] += 1
        elif name in ("index", "index_put", "index_put_") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None):
            self.seen[f"aten.{name} with a boolean mask"] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def host_syncs() -> Iterator[Counter[str]]:
    """Counts, inside the block, every call that would make the host wait for a CUDA device:
    the syncing tensor methods (spied on ``torch.Tensor``, where ``tolist`` and ``cpu`` of a CPU
    tensor never reach the dispatcher) and the syncing aten operations (a dispatch mode)."""
    counted: Counter[str] = Counter()
    saved = {name: getattr(torch.Tensor, name) for name in _SYNCING_METHODS}

    def spy(name: str) -> Any:
        original = saved[name]

        def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            counted[f"Tensor.{name}"] += 1
            return original(self, *args, **kwargs)

        return method

    for name in _SYNCING_METHODS:
        setattr(torch.Tensor, name, spy(name))
    mode = _Syncs()
    try:
        with mode:
            yield counted
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)
        counted.update(mode.seen)


def test_the_counter_sees_what_a_gpu_would_wait_for():
    x = torch.arange(4.0)
    with host_syncs() as seen:
        bool(x.sum() > 1)
        x.max().item()
        x.tolist()
        x[x > 1]
        x.nonzero()
    assert seen["Tensor.__bool__"] == 1 and seen["Tensor.item"] == 1 and seen["Tensor.tolist"] == 1
    assert seen["aten._local_scalar_dense"] == 2 and seen["aten.nonzero"] == 1
    assert seen["aten.index with a boolean mask"] == 1


@pytest.fixture
def backend(family, tokenizer):
    return TransformersBackend(make_model(family, len(tokenizer)), tokenizer)


def test_a_pruned_prefill_never_waits_for_the_device(backend):
    """No scalar read, no data-dependent shape, no ``.cpu()`` inside ``prefill``: on a GPU the host
    queues the whole forward and waits only for the first token (``int(argmax)``, outside)."""
    plan = plan_of(prompt(1), KEPT)
    backend.prefill(plan)  # lazy initialisation out of the way
    with host_syncs() as seen:
        state = backend.prefill(plan)
    assert sum(seen.values()) == 0, seen
    with host_syncs() as seen:
        backend.decode_step(state, 7)
    assert sum(seen.values()) == 0, seen


def test_the_all_ones_mask_cost_a_host_sync_per_forward(backend):
    """What the backend passed before: transformers tests the 2-D mask for all ones with a
    ``bool()`` of a device tensor, once per forward (and gets no 4-D mask out of it)."""
    plan = plan_of(prompt(1), KEPT)
    ids, positions = plan.token_ids.reshape(1, -1), plan.position_ids.reshape(1, -1)
    with host_syncs() as seen, torch.inference_mode():
        backend.model(input_ids=ids, position_ids=positions, attention_mask=torch.ones_like(ids), use_cache=True,
                      logits_to_keep=1)
    assert seen["aten.is_nonzero"] == 1


# -- the attention call ----------------------------------------------------------------------


@contextlib.contextmanager
def sdpa_calls() -> Iterator[list[dict[str, Any]]]:
    """Every ``scaled_dot_product_attention`` call inside the block: its mask's shape (None: no
    mask), ``is_causal`` and the query/key lengths."""
    calls: list[dict[str, Any]] = []
    original = torch.nn.functional.scaled_dot_product_attention

    def spy(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None, *args: Any,
            **kwargs: Any) -> torch.Tensor:
        calls.append({"mask": None if attn_mask is None else tuple(attn_mask.shape),
                      "is_causal": bool(kwargs.get("is_causal", False)), "q": query.shape[2], "k": key.shape[2]})
        return original(query, key, value, attn_mask, *args, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = spy
    try:
        yield calls
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def test_a_pruned_prefill_makes_the_unpruned_prefills_attention_call(backend):
    """Gaps in the positions change nothing in the attention call: no 4-D mask is built, SDPA runs
    ``is_causal`` over the kept tokens, exactly as for a prefill at contiguous positions; a decode
    step attends to the whole cache without a mask."""
    ids = prompt(2)
    with sdpa_calls() as pruned:
        state = backend.prefill(plan_of(ids, KEPT))
    with sdpa_calls() as unpruned:
        backend.prefill(plan_of(ids, list(range(len(KEPT))), len(KEPT)))
    layers = backend.model.config.num_hidden_layers
    assert pruned == unpruned == [{"mask": None, "is_causal": True, "q": len(KEPT), "k": len(KEPT)}] * layers
    with sdpa_calls() as decode:
        backend.decode_step(state, 5)
    assert decode == [{"mask": None, "is_causal": False, "q": 1, "k": len(KEPT) + 1}] * layers


# -- what it computes ------------------------------------------------------------------------


def full_attention_reference(model: Any, ids: list[int], positions: list[int]) -> torch.Tensor:
    """Last-token logits of an eager, uncached forward under an explicit 4-D causal mask: every
    kept token attends to every earlier kept token, each at its own position."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    n = len(ids)
    causal = torch.full((n, n), torch.finfo(torch.float32).min).triu(1).reshape(1, 1, n, n)
    with torch.no_grad():
        out = eager(input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions]), attention_mask=causal,
                    use_cache=False)
    return out.logits[0, -1]


def ones_mask_logits(model: Any, ids: torch.Tensor, positions: torch.Tensor, cache: Any = None,
                     n_cached: int = 0) -> tuple[torch.Tensor, Any]:
    """The path this backend took before: an explicit all-ones 2-D mask."""
    with torch.inference_mode():
        out = model(input_ids=ids.reshape(1, -1), position_ids=positions.reshape(1, -1),
                    attention_mask=torch.ones(1, n_cached + ids.numel(), dtype=torch.int64), past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
    return out.logits[0, -1].float(), out.past_key_values


@pytest.mark.parametrize("attention", ["sdpa", "eager", CAPTURE_ATTENTION])
def test_logits_equal_the_references_at_original_positions(family, tokenizer, attention):
    model = make_model(family, len(tokenizer))
    if attention == CAPTURE_ATTENTION:
        DraftModel(model, tokenizer)  # a self-drafting main model runs on the draft's capture wrapper
    else:
        model.set_attn_implementation(attention)
    backend = TransformersBackend(model, tokenizer)
    assert backend.mask_free
    ids = prompt(3)
    plan = plan_of(ids, KEPT)
    state = backend.prefill(plan)
    before, cache = ones_mask_logits(model, plan.token_ids, plan.position_ids)
    torch.testing.assert_close(state.logits, before, atol=1e-5, rtol=1e-5)  # same kernels, same numbers
    torch.testing.assert_close(state.logits, full_attention_reference(model, ids[KEPT].tolist(), KEPT),
                               atol=1e-4, rtol=1e-4)
    stepped = backend.decode_step(state, 9)
    before, _ = ones_mask_logits(model, torch.tensor([9]), torch.tensor([N_PROMPT]), cache, len(KEPT))
    torch.testing.assert_close(stepped.logits, before, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stepped.logits, full_attention_reference(model, ids[KEPT].tolist() + [9],
                                                                        KEPT + [N_PROMPT]), atol=1e-4, rtol=1e-4)


def test_without_a_cache_and_a_mask_gaps_would_read_as_packed_sequences(backend):
    """Why every forward passes a cache: without one (and without a mask) transformers takes the
    gaps for boundaries of packed sequences and masks across them (docs: MODELS.md, "Silent
    wrong results"). If a transformers release ever did that with a cache too, the equality
    tests above would fail."""
    ids = prompt(4)
    plan = plan_of(ids, KEPT)
    with torch.inference_mode():
        packed = backend.model(input_ids=plan.token_ids.reshape(1, -1), position_ids=plan.position_ids.reshape(1, -1),
                               use_cache=False, logits_to_keep=1).logits[0, -1]
    assert (packed - backend.prefill(plan).logits).abs().max() > 1e-2


def test_other_attention_implementations_keep_the_explicit_mask(backend, monkeypatch):
    """An implementation not checked for it (flash attention reads ``position_ids`` for packed
    sequences when it has no mask) gets the all-ones mask, as before."""
    assert {"sdpa", "eager", CAPTURE_ATTENTION} == MASK_FREE
    seen: list[Any] = []
    forward = backend.model.forward

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("attention_mask"))
        return forward(*args, **kwargs)

    monkeypatch.setattr(backend.model, "forward", spy)
    backend.prefill(plan_of(prompt(5), KEPT))
    assert seen == [None]
    monkeypatch.setattr(type(backend), "mask_free", property(lambda self: False))
    state = backend.prefill(plan_of(prompt(5), KEPT))
    backend.decode_step(state, 3)
    assert [tuple(m.shape) for m in seen[1:]] == [(1, len(KEPT)), (1, len(KEPT) + 1)]
    assert all(bool(m.all()) for m in seen[1:])
