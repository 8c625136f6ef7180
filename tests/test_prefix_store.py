"""The draft's prefix store: a prompt that begins with tokens the draft read before (a shared
system prompt, a chat's earlier turns, the same passages under a follow-up question) is read from
where they end, and its scores equal a whole read's. A head runs up to the prompt's question; any
start a prompt shares with a stored head serves. Counted with hooks on the decoder layers: the
warm prompt's forwards run over the tokens after the shared start only."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import make_model

from specprefill_rag import DraftConfig, Passage, Segment, SegmentKind
from specprefill_rag.draft import DraftModel
from specprefill_rag.draft.prefix_store import MIN_PREFIX_TOKENS, PrefixEntry, PrefixStore
from specprefill_rag.testing import tiny_engine

CONFIGS = {
    "greedy, early exit": DraftConfig(),
    "greedy, full forwards": DraftConfig(early_exit=False),
    "siblings, early exit": DraftConfig(lookahead_tokens="siblings"),
    "siblings, full forwards": DraftConfig(lookahead_tokens="siblings", early_exit=False),
    "look-ahead 1": DraftConfig(lookahead=1),
    "verified guesses": DraftConfig(lookahead_guesses=6),
}


class LayerTokens:
    """The tokens layer 0 ran on, per call (one entry per prompt forward, head read or step)."""

    def __init__(self, model) -> None:
        self.seen: list[int] = []
        layer = model.get_decoder().layers[0]
        self.hook = layer.register_forward_pre_hook(
            lambda module, args, kwargs: self.seen.append((args[0] if args else kwargs["hidden_states"]).shape[1]),
            with_kwargs=True,
        )


def _ids(tokenizer, n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, len(tokenizer), (n,), generator=torch.Generator().manual_seed(seed))


def _score(draft, ids, head, config, question=None):
    n = ids.numel()
    question = torch.arange(n - 12, n - 3) if question is None else question
    return draft.score(ids, question=question, context=torch.arange(n) >= head, config=config)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_stored_head_gives_a_whole_reads_scores_and_the_forward_skips_it(family, tokenizer, name):
    config = CONFIGS[name]
    draft = DraftModel(make_model(family, len(tokenizer), layers=8), tokenizer)
    system = _ids(tokenizer, 100, seed=1)
    first = torch.cat([system, _ids(tokenizer, 150, seed=2)])
    second = torch.cat([system, _ids(tokenizer, 180, seed=3)])  # the same head, other passages
    whole = _score(draft, second, 100, dataclasses.replace(config, prefix_cache_entries=0))
    assert whole.cached_tokens == 0 and len(draft.prefixes) == 0
    cold = _score(draft, first, 100, config)
    assert cold.cached_tokens == 0 and len(draft.prefixes) == 1  # nothing held before; its head stored
    counter = LayerTokens(draft.model)
    warm = _score(draft, second, 100, config)
    n = second.numel()
    assert warm.cached_tokens == 100  # the system prompt both begin with
    assert counter.seen[:2] == [n - 12 - 100, 12]  # the head read on from there, then the question and tail
    assert warm.lookahead_token_ids == whole.lookahead_token_ids
    torch.testing.assert_close(warm.scores, whole.scores, atol=1e-6, rtol=1e-5)
    counter.seen.clear()
    follow_up = _score(draft, second, 100, config, question=torch.arange(n - 12, n - 5))
    assert follow_up.cached_tokens == n - 12 and counter.seen[0] == 12  # the same context: its question only


def test_a_chat_turn_extends_the_previous_turns_head(tokenizer):
    """Turn k + 1 begins with what turn k's head begins with: only the rest is read, once."""
    draft = DraftModel(make_model("qwen2", len(tokenizer), layers=6), tokenizer)
    turns = _ids(tokenizer, 220, seed=4)  # system prompt and earlier turns
    passages = _ids(tokenizer, 120, seed=5)
    _score(draft, torch.cat([turns[:90], passages]), 90, DraftConfig())  # stores 90 + 108 tokens
    counter = LayerTokens(draft.model)
    later = torch.cat([turns, passages])
    got = _score(draft, later, 220, DraftConfig())
    assert counter.seen[:2] == [340 - 12 - 90, 12]  # the head from token 90 on, then the question and tail
    assert got.cached_tokens == 90 and len(draft.prefixes) == 2
    whole = _score(draft, later, 220, DraftConfig(prefix_cache_entries=0))
    torch.testing.assert_close(got.scores, whole.scores, atol=1e-6, rtol=1e-5)


def test_a_batch_shares_a_head_only_when_every_prompt_begins_with_it(tokenizer):
    draft = DraftModel(make_model("llama", len(tokenizer), layers=4), tokenizer)
    system = _ids(tokenizer, 64, seed=6)
    prompts = [torch.cat([system, _ids(tokenizer, n, seed=n)]) for n in (90, 40, 130)]
    questions = [torch.arange(p.numel() - 8, p.numel() - 2) for p in prompts]
    contexts = [torch.arange(p.numel()) >= 64 for p in prompts]
    batched = draft.score_batch(prompts, questions=questions, contexts=contexts)
    assert [s.cached_tokens for s in batched] == [0, 0, 0]  # the start they share, read now and stored
    again = draft.score_batch(prompts, questions=questions, contexts=contexts)
    assert [s.cached_tokens for s in again] == [64, 64, 64]
    off = DraftConfig(prefix_cache_entries=0)
    for ids, question, context, got in zip(prompts, questions, contexts, batched, strict=True):
        alone = draft.score(ids, question=question, context=context, config=off)
        torch.testing.assert_close(got.scores, alone.scores, atol=1e-5, rtol=1e-4)
    mixed = [prompts[0], torch.cat([_ids(tokenizer, 64, seed=9), prompts[1][64:]])]
    scored = draft.score_batch(mixed, questions=questions[:2], contexts=contexts[:2])
    assert [s.cached_tokens for s in scored] == [0, 0]


def test_the_head_stops_before_the_question_and_short_heads_are_read_whole(tokenizer):
    draft = DraftModel(make_model("llama", len(tokenizer), layers=4), tokenizer)
    ids = _ids(tokenizer, 200, seed=7)
    # A question inside the context: its queries are recorded, so the head ends before it.
    _score(draft, ids, 150, DraftConfig(), question=torch.arange(120, 130))
    assert [entry.n_tokens for _, entry in draft.prefixes._snapshot()] == [120]
    assert _score(draft, ids, 150, DraftConfig(), question=torch.arange(120, 130)).cached_tokens == 120
    _score(draft, _ids(tokenizer, 200, seed=8), 10, DraftConfig(), question=torch.arange(MIN_PREFIX_TOKENS - 1, 40))
    assert len(draft.prefixes) == 1  # a head under MIN_PREFIX_TOKENS is read with the rest, not stored
    unmarked = draft.score(ids, question=torch.arange(190, 195))  # no context mask: no head
    assert unmarked.cached_tokens == 0


def _entry(p: int, exit_layer: int = 1, width: int = 10) -> PrefixEntry:
    kv = tuple(torch.zeros(1, 1, p, width) for _ in range(exit_layer + 1))
    return PrefixEntry(torch.arange(p), exit_layer, kv, kv, torch.zeros(1, p, width))


def test_the_store_finds_the_longest_head_and_keeps_its_bounds():
    store = PrefixStore(entries=2, max_bytes=10**6)
    store.add(_entry(40))
    store.add(_entry(60))
    assert store.longest(torch.arange(100), 1).n_tokens == 60
    part = store.longest(torch.arange(50), 1)  # the first 50 tokens of the 60 one
    assert part.n_tokens == 50 and part.keys[0].shape[2] == 50 and part.hidden.shape[1] == 50
    assert store.longest(torch.cat([torch.arange(45), torch.zeros(55, dtype=torch.int64)]), 1).n_tokens == 45
    assert store.longest(torch.arange(100), 2) is None  # another exit layer: other tensors
    assert store.longest(torch.cat([torch.arange(30), torch.zeros(70, dtype=torch.int64)]), 1) is None  # too short
    store.longest(torch.arange(40), 1)  # 40 (whole) is now the most recent
    store.add(_entry(80))  # evicts 60
    assert [e.n_tokens for e in (store.longest(torch.arange(100), 1),)] == [80] and len(store) == 2
    store.resize(entries=2, max_bytes=_entry(80).nbytes)  # only the newest fits
    assert len(store) == 1 and store.nbytes == _entry(80).nbytes
    store.add(_entry(200))  # larger than the whole store: not kept, nothing evicted
    assert len(store) == 1 and store.longest(torch.arange(300), 1).n_tokens == 80
    off = PrefixStore(entries=0, max_bytes=10**6)
    off.add(_entry(40))
    assert len(off) == 0 and off.longest(torch.arange(100), 1) is None


SYSTEM = "You answer from the passages only. " * 12


def test_the_engine_reads_a_shared_system_prompt_once_and_plans_as_before():
    """Requests with one system prompt and other passages: from the second on the draft reads
    only what follows it; the plans equal those of an engine without the store."""
    engine = tiny_engine()
    plain = tiny_engine(dataclasses.replace(engine.config, draft=DraftConfig(lookahead=2, prefix_cache_entries=0)))
    for i in range(3):
        passages = [Passage(f"Passage {i}.{j} says river {j} is {100 + i * j} metres wide.") for j in range(8)]
        got = engine.generate(f"How wide is river {i}?", passages, instructions=SYSTEM)
        ref = plain.generate(f"How wide is river {i}?", passages, instructions=SYSTEM)
        assert torch.equal(got.plan.position_ids, ref.plan.position_ids) and got.token_ids == ref.token_ids
        head = int(got.prompt.protected.to(torch.int8).argmin())  # the first prunable token
        # From the second request on: the system prompt (and the first words the passages share)
        assert (got.draft_cached_tokens == 0 if i == 0 else head <= got.draft_cached_tokens < head + 12)
        assert ref.draft_cached_tokens == 0
        assert head > MIN_PREFIX_TOKENS and got.to_dict()["draft_cached_tokens"] == got.draft_cached_tokens
    assert len(engine.draft.prefixes) == 3  # each request's head; the system prompt they share served
    again = engine.generate("And the widest?", passages, instructions=SYSTEM)  # a follow-up: the same passages
    question = int(again.prompt.positions_of(SegmentKind.QUESTION)[0])
    assert question - 8 <= again.draft_cached_tokens <= question  # all but the question's own line


def test_chat_history_is_read_once_per_turn_through_the_engine():
    engine = tiny_engine()
    history = [Segment(SegmentKind.INSTRUCTIONS, SYSTEM)]
    for turn in range(3):
        segments = [*history, *(Segment(SegmentKind.CONTEXT, f"Passage {turn}.{j}: lake {j} is {j * 7 + turn} m deep.")
                                for j in range(6)), Segment(SegmentKind.QUESTION, f"How deep is lake {turn}?")]
        result = engine.generate(segments)
        start = int(result.prompt.protected.to(torch.int8).argmin())  # the first prunable token
        assert (result.draft_cached_tokens == 0) if turn == 0 else (MIN_PREFIX_TOKENS < result.draft_cached_tokens
                                                                     < start)
        history += [Segment(SegmentKind.HISTORY, f"How deep is lake {turn}?", role="user"),
                    Segment(SegmentKind.HISTORY, result.text or "I do not know.", role="assistant")]
    assert len(engine.draft.prefixes) == 3  # each turn's head


def test_cross_family_drafts_use_the_store_too():
    engine = tiny_engine(cross_family=True)
    passages = [[Passage(f"Passage {i}.{j}: tower {j} is {30 + i + j} m tall.") for j in range(8)] for i in range(2)]
    results = [engine.generate(f"How tall is tower {i}?", p, instructions=SYSTEM) for i, p in enumerate(passages)]
    assert results[1].draft_cached_tokens > MIN_PREFIX_TOKENS and len(engine.draft.prefixes) == 2


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"prefix_cache_entries": -1}, "prefix_cache_entries must be >= 0, got -1"),
    ({"prefix_cache_bytes": -5}, "prefix_cache_bytes must be >= 0, got -5"),
    ({"prefix_cache_entries": 2.5}, "prefix_cache_entries must be an int, got 2.5"),
])
def test_prefix_cache_fields_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DraftConfig(**kwargs)


def test_a_call_with_the_store_off_neither_reads_nor_empties_it(tokenizer):
    """Engines may share a draft: one scoring with ``prefix_cache_entries=0`` leaves the others' store."""
    draft = DraftModel(make_model("llama", len(tokenizer), layers=4), tokenizer)
    ids = _ids(tokenizer, 200, seed=10)
    _score(draft, ids, 100, DraftConfig())
    off = _score(draft, ids, 100, DraftConfig(prefix_cache_entries=0))
    assert off.cached_tokens == 0 and len(draft.prefixes) == 1
    assert _score(draft, ids, 100, DraftConfig()).cached_tokens == 200 - 12
