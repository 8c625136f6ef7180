"""The look-ahead without sequential decode steps: sibling tokens in one forward, early exit.

Siblings are the L − 1 likeliest next tokens, all at position n, each seeing the prompt and
itself (a tree attention mask). Their queries must equal a brute-force reference (the prompt plus
that one token, run alone); the draft must run at most two forwards; early exit must leave the
rows of the aggregated layers exactly as the full forward makes them.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import ForwardCounter, lookahead_spec, make_model

from specprefill_rag.config import DraftConfig
from specprefill_rag.draft import DraftModel
from specprefill_rag.draft.early_exit import DecoderParts, reading_set, upper_logits

LAYERS = [1, 2]  # of 4: the top recorded layer is 2, so layer 3 (and the LM head) may be skipped


def _prompt(tokenizer, n: int = 61, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, len(tokenizer), (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("early_exit", [False, True])
def test_sibling_queries_equal_a_brute_force_reference(family, tokenizer, early_exit):
    """Sibling j's query at every recorded layer is the query the prompt plus token j alone gives
    its last position: the tree mask lets each see exactly the prompt and itself."""
    draft = DraftModel(make_model(family, len(tokenizer), layers=4), tokenizer)
    ids = _prompt(tokenizer)
    question = torch.arange(50, 58)
    cap = draft.capture(ids, question,
                        spec=lookahead_spec(draft, 5, layers=LAYERS, early_exit=early_exit, tokens="siblings"))
    assert len(cap.lookahead_token_ids) == 4 and len(set(cap.lookahead_token_ids)) == 4
    assert cap.positions.tolist() == question.tolist() + [60] * 5  # every look-ahead query sees the prompt
    for j, token in enumerate(cap.lookahead_token_ids):
        alone = draft.capture(torch.cat([ids, torch.tensor([token])]), spec=lookahead_spec(draft, 1, layers=LAYERS))
        for layer in range(len(LAYERS)):
            got = cap.queries[layer][:, cap.n_question + 1 + j]  # after the question's and the last token's
            torch.testing.assert_close(got, alone.queries[layer][:, -1], atol=1e-5, rtol=1e-4)


def test_sibling_tokens_are_the_likeliest_next_tokens(family, tokenizer):
    """Without early exit, the full forward's top-k. With it, the upper layers read a share of the
    prompt: reading all of it (upper_keep=1) gives the full forward's top-k again."""
    model = make_model(family, len(tokenizer), layers=4)
    draft = DraftModel(model, tokenizer)
    ids = _prompt(tokenizer)
    with torch.no_grad():
        top3 = model(input_ids=ids.reshape(1, -1)).logits[0, -1].topk(3).indices.tolist()
    siblings = dict(layers=LAYERS, tokens="siblings")
    assert list(draft.capture(ids, spec=lookahead_spec(draft, 4, **siblings)).lookahead_token_ids) == top3
    every = draft.capture(ids, spec=lookahead_spec(draft, 4, early_exit=True, upper_keep=1.0, **siblings))
    assert list(every.lookahead_token_ids) == top3
    some = draft.capture(ids, spec=lookahead_spec(draft, 4, early_exit=True, upper_keep=0.2, **siblings))
    assert len(set(some.lookahead_token_ids)) == 3


def test_upper_layers_over_a_reading_set_equal_the_model_on_those_tokens(family, tokenizer):
    """``upper_logits`` from the embeddings (start 0) over kept tokens at their positions is the
    model's own forward over just those tokens, with those position ids."""
    model = make_model(family, len(tokenizer), layers=3)
    parts = DecoderParts.of(model)
    assert parts is not None
    ids = _prompt(tokenizer)
    keep = torch.tensor([0, 1, 2, 3, 10, 11, 30, 31, 32, 55, 58, 59, 60])
    with torch.no_grad():
        embeddings = model.get_input_embeddings()(ids)
        expected = model(input_ids=ids[keep].reshape(1, -1), position_ids=keep.reshape(1, -1)).logits[0, -1]
    torch.testing.assert_close(upper_logits(parts, embeddings, keep, 0), expected, atol=1e-4, rtol=1e-4)


def test_reading_set_holds_the_best_the_question_and_both_ends():
    scores = torch.zeros(100)
    scores[[40, 41, 70]] = torch.tensor([3.0, 2.0, 1.0])
    got = reading_set(scores, torch.tensor([90, 91]), share=0.03)
    assert got.tolist() == [0, 1, 2, 3, 40, 41, 70, *range(84, 100)]  # 3 best, sinks, question, tail


@pytest.mark.parametrize("n", [40, 300])
def test_siblings_run_at_most_two_forwards(tokenizer, n):
    """Prompt forward + one sibling forward, whatever the prompt's length; the default, the
    reference's greedy look-ahead of 8, runs 1 + 7 steps. Under early exit the layers above the
    aggregated ones run only on the reading set (``upper_keep`` of the prompt and its question
    and ends) and on the greedy steps' tokens, never over the prompt; the sibling forward and
    the last greedy step stop after the top aggregated layer."""
    model = make_model("qwen2", len(tokenizer), layers=8)
    draft = DraftModel(model, tokenizer)
    ids = _prompt(tokenizer, n)
    config = DraftConfig(lookahead_tokens="siblings")
    top = max(config.layer_indices(8))
    reading = math.ceil(config.upper_keep * n) + 8 + 4 + 16  # at most: the best, question, sinks, tail
    counter = ForwardCounter(model)
    try:
        draft.score(ids, question=torch.arange(n - 10, n - 2), config=config)
        prompt, siblings = counter.layers
        assert [i for i, _ in prompt] == list(range(8))
        assert all(tokens == n for i, tokens in prompt if i <= top)
        assert all(tokens <= min(n, reading) for i, tokens in prompt if i > top)
        assert siblings == [(i, config.lookahead - 1) for i in range(top + 1)]
        counter.forwards, counter.layers = 0, []
        draft.score(ids, question=torch.arange(n - 10, n - 2), config=DraftConfig(early_exit=False))
        assert counter.forwards == 8
        assert [i for i, _ in counter.layers[-1]] == list(range(top + 1))  # the last step's logits go unused
        draft.score(ids, question=torch.arange(n - 10, n - 2), config=DraftConfig())  # greedy, early exit
        check, _ = counter.layers[-2:]  # the first such call checks the embeddings: one token, no layer run
        assert check == [(0, 1)]
        lower, upper = list(range(top + 1)), list(range(top + 1, 8))
        for guesses in (0, 6):  # one token per step; the next token and 6 guesses per forward
            counter.forwards, counter.layers = 0, []
            draft.score(ids, question=torch.arange(n - 10, n - 2), config=DraftConfig(lookahead_guesses=guesses))
            (ran,) = counter.layers  # one model forward (the prompt's); the steps run the layers by hand
            assert all(tokens == n for _, tokens in ran[: top + 1])  # the aggregated layers read the whole prompt
            assert all(tokens <= min(n, reading) for _, tokens in ran[top + 1 : 8])  # the upper ones its reading set
            assert all(tokens == 1 + guesses for _, tokens in ran[8:])
            # A random model's guesses all fail: 7 forwards, the last one's logits unused.
            assert [i for i, _ in ran] == lower + upper + (lower + upper) * 6 + lower
    finally:
        counter.remove()


def test_early_exit_keeps_the_aggregated_rows_exactly(family, tokenizer):
    """The prompt's keys and the question's and last token's queries are those of the full
    forward, bit for bit; with a look-ahead of 1 (nothing read off the exit layer) so are the scores."""
    draft = DraftModel(make_model(family, len(tokenizer), layers=4), tokenizer)
    ids, question = _prompt(tokenizer), torch.arange(50, 58)
    full = draft.capture(ids, question, spec=lookahead_spec(draft, 4, layers=LAYERS, tokens="siblings"))
    early = draft.capture(ids, question,
                          spec=lookahead_spec(draft, 4, layers=LAYERS, early_exit=True, tokens="siblings"))
    lead = full.n_question + 1
    for a, b, qa, qb in zip(full.keys, early.keys, full.queries, early.queries, strict=True):
        assert torch.equal(a, b) and torch.equal(qa[:, :lead], qb[:, :lead])
    one = DraftConfig(lookahead=1, layers=(1, 2))
    context = torch.arange(61) < 50
    scores = [
        draft.score(ids, question=question, context=context, config=DraftConfig(lookahead=1, layers=(1, 2),
                                                                                early_exit=e)).scores
        for e in (False, True)
    ]
    assert one.early_exit and torch.equal(scores[0], scores[1])


@pytest.mark.parametrize("early_exit", [False, True])
def test_batched_siblings_equal_one_by_one(tokenizer, early_exit):
    """Right-padded prompts of different lengths: each row's siblings and queries are its own."""
    draft = DraftModel(make_model("llama", len(tokenizer), layers=4), tokenizer)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, len(tokenizer), (n,), generator=gen) for n in (70, 33, 128)]
    spec = lookahead_spec(draft, 4, layers=LAYERS, early_exit=early_exit, tokens="siblings")
    batched = draft.capture_batch(prompts, spec=spec)
    for ids, got in zip(prompts, batched, strict=True):
        alone = draft.capture(ids, spec=spec)
        assert got.lookahead_token_ids == alone.lookahead_token_ids
        for a, b in zip(got.queries, alone.queries, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_siblings_need_one_position_past_the_prompt(tokenizer):
    model = make_model("llama", len(tokenizer), layers=2)
    model.config.max_position_embeddings = 62
    draft = DraftModel(model, tokenizer)
    ids = _prompt(tokenizer)  # 61 tokens
    siblings = draft.capture(ids, spec=lookahead_spec(draft, 8, tokens="siblings"))
    assert len(siblings.lookahead_token_ids) == 7  # 61 + 1 <= 62
    with pytest.raises(ValueError, match="prompt of 61 tokens plus 7 look-ahead positions exceeds"):
        draft.capture(ids, spec=lookahead_spec(draft, 8, tokens="greedy"))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"upper_keep": 0.0}, r"upper_keep must be in \(0, 1\], got 0.0"),
        ({"upper_keep": 1.5}, r"upper_keep must be in \(0, 1\], got 1.5"),
        ({"lookahead_tokens": "jacobi"}, "lookahead_tokens must be 'siblings' or 'greedy', got 'jacobi'"),
        ({"lookahead_guesses": -1}, r"lookahead_guesses must be >= 0 or None \(auto\), got -1"),
        ({"lookahead_guesses": 2.0}, r"lookahead_guesses must be an int, got 2.0"),
    ],
)
def test_lookahead_fields_are_checked(kwargs, message) -> None:
    from specprefill_rag.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        DraftConfig(**kwargs)


def test_extra_positions_count_what_the_lookahead_occupies() -> None:
    siblings, greedy = DraftConfig(lookahead_tokens="siblings"), DraftConfig(lookahead_tokens="greedy")
    assert siblings.extra_positions(8) == 1  # the siblings share position n
    assert greedy.extra_positions(8) == 7
    assert siblings.extra_positions(1) == 0 == greedy.extra_positions(1)


def test_greedy_early_exit_reading_everything_is_the_full_greedy_decode(family, tokenizer):
    """Early exit with greedy steps: the layers above the aggregated ones read a reading set in
    the prompt's forward and in every step. A reading set of the whole prompt (upper_keep=1)
    is the full decode again: the same tokens, the same recorded queries and keys."""
    draft = DraftModel(make_model(family, len(tokenizer), layers=4), tokenizer)
    ids, question = _prompt(tokenizer), torch.arange(50, 58)
    full = draft.capture(ids, question, spec=lookahead_spec(draft, 6, layers=LAYERS, tokens="greedy"))
    early = dict(layers=LAYERS, early_exit=True)
    every = draft.capture(ids, question, spec=lookahead_spec(draft, 6, tokens="greedy", upper_keep=1.0, **early))
    assert len(full.lookahead_token_ids) == 5 and every.lookahead_token_ids == full.lookahead_token_ids
    for a, b, qa, qb in zip(full.keys, every.keys, full.queries, every.queries, strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(qa, qb, atol=1e-5, rtol=1e-4)
    some = draft.capture(ids, question, spec=lookahead_spec(draft, 6, tokens="greedy", upper_keep=0.2, **early))
    lead = full.n_question + 1
    for qa, qb in zip(full.queries, some.queries, strict=True):  # the prompt's rows stay exact
        assert torch.equal(qa[:, :lead], qb[:, :lead])
    # Its first token is the likeliest by the upper layers over the same reading set as siblings use.
    sibling = draft.capture(ids, question, spec=lookahead_spec(draft, 2, tokens="siblings", upper_keep=0.2, **early))
    assert some.lookahead_token_ids[0] == sibling.lookahead_token_ids[0]


@pytest.mark.parametrize("upper_keep", [1.0, 0.2])
def test_batched_greedy_early_exit_equals_one_by_one(tokenizer, upper_keep):
    """Right-padded prompts with reading sets of different sizes: each row's tokens and queries are its own."""
    draft = DraftModel(make_model("qwen2", len(tokenizer), layers=4), tokenizer)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, len(tokenizer), (n,), generator=gen) for n in (70, 33, 128)]
    questions = [torch.arange(n - 9, n - 2) for n in (70, 33, 128)]
    kwargs = dict(layers=LAYERS, early_exit=True, tokens="greedy", upper_keep=upper_keep)
    batched = draft.capture_batch(prompts, questions, spec=lookahead_spec(draft, 5, **kwargs))
    for ids, question, got in zip(prompts, questions, batched, strict=True):
        alone = draft.capture(ids, question, spec=lookahead_spec(draft, 5, **kwargs))
        assert got.lookahead_token_ids == alone.lookahead_token_ids
        for a, b in zip(got.queries, alone.queries, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_greedy_early_exit_needs_plain_embeddings(tokenizer):
    """A model whose forward scales its embeddings (as Gemma's does) cannot have its steps run
    layer by hand from ``get_input_embeddings``: it decodes with full forwards instead."""
    model = make_model("llama", len(tokenizer), layers=4)
    draft = DraftModel(model, tokenizer)
    ids, question = _prompt(tokenizer), torch.arange(50, 58)
    full = draft.capture(ids, question, spec=lookahead_spec(draft, 4, layers=LAYERS, tokens="greedy"))
    assert draft._plain_embedding is None  # not checked without early exit
    draft.capture(ids, question, spec=lookahead_spec(draft, 4, layers=LAYERS, early_exit=True, tokens="greedy"))
    assert draft._plain_embedding is True
    scaled = DraftModel(model, tokenizer)
    handle = model.get_decoder().layers[0].register_forward_pre_hook(lambda module, args: (args[0] * 2.0, *args[1:]))
    try:
        spec = lookahead_spec(scaled, 4, layers=LAYERS, early_exit=True, tokens="greedy", upper_keep=0.2)
        got = scaled.capture(ids, question, spec=spec)
        reference = scaled.capture(ids, question, spec=lookahead_spec(scaled, 4, layers=LAYERS, tokens="greedy"))
    finally:
        handle.remove()
    assert scaled._plain_embedding is False
    assert got.lookahead_token_ids == reference.lookahead_token_ids
    assert full.lookahead_token_ids  # the unscaled model decoded too


def _steps(draft, prompts, questions, **kwargs):
    """Each prompt's capture with one decode step per look-ahead token (the reference for guesses)."""
    return [draft.capture(ids, q, spec=lookahead_spec(draft, 6, guesses=0, **kwargs))
            for ids, q in zip(prompts, questions, strict=True)]


def _oracle(reference: torch.Tensor, right: list[int]):
    """A ``prompt_lookup`` stand-in whose guesses are row b's true tokens below index ``right[b]``
    and a wrong token from there on."""
    def guess(prompt_ids, n, tokens, known, count):
        at = known.unsqueeze(1) + torch.arange(count)
        true = reference.gather(1, at.clamp(max=reference.shape[1] - 1))
        return torch.where(at < torch.tensor(right).unsqueeze(1), true, (true + 1) % 50)
    return guess


@pytest.mark.parametrize("upper_keep", [1.0, 0.2])
def test_verified_guesses_give_the_steps_tokens_and_queries(family, tokenizer, monkeypatch, upper_keep):
    """Guessed tokens are kept only where the draft's argmax confirms them, so whatever the
    guesses (all right, right up to some token, all wrong, different per row of a batch), the
    tokens and every recorded query are those of one decode step per token; all-right guesses
    need one forward after the prompt's, all-wrong ones as many as the steps."""
    from specprefill_rag.draft import early_exit as lookahead

    model = make_model(family, len(tokenizer), layers=4)
    draft = DraftModel(model, tokenizer)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, len(tokenizer), (n,), generator=gen) for n in (70, 33, 128)]
    questions = [torch.arange(n - 9, n - 2) for n in (70, 33, 128)]
    kwargs = dict(layers=LAYERS, early_exit=True, tokens="greedy", upper_keep=upper_keep)
    steps = _steps(draft, prompts, questions, **kwargs)
    reference = torch.tensor([s.lookahead_token_ids for s in steps])
    # Row b's guesses are right up to token right[b]: the first forward keeps right[b] - 1 of
    # them, every later one the next token alone, so the slowest row sets the count.
    for right, forwards in (([5, 5, 5], 1), ([2, 3, 5], 4), ([0, 4, 1], 5)):
        monkeypatch.setattr(lookahead, "prompt_lookup", _oracle(reference, right))
        counter = ForwardCounter(model)
        try:
            got = draft.capture_batch(prompts, questions, spec=lookahead_spec(draft, 6, guesses=6, **kwargs))
        finally:
            counter.remove()
        (ran,) = counter.layers
        assert sum(1 for i, _ in ran[4:] if i == 0) == forwards, right  # layer 0 runs once per forward
        for alone, batched in zip(steps, got, strict=True):
            assert batched.lookahead_token_ids == alone.lookahead_token_ids
            for a, b in zip(alone.queries, batched.queries, strict=True):
                assert a.shape == b.shape
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_prompt_lookup_continues_the_latest_match():
    """Guesses: what followed the last two known tokens' latest earlier occurrence, else the
    last token's; rows of a right-padded batch each search their own prompt and tokens."""
    from specprefill_rag.draft.early_exit import prompt_lookup

    prompts = torch.tensor([[10, 11, 12, 20, 11, 13, 30], [40, 41, 42, 41, 0, 0, 0]])
    n = torch.tensor([7, 4])
    tokens = torch.tensor([[10, 11, 0, 0], [41, 0, 0, 0]])
    got = prompt_lookup(prompts, n, tokens, torch.tensor([2, 1]), 3)
    # Row 0: "10 11" occurred at the start, so "12 20 11" (the later "11" alone would give "13 30").
    # Row 1: "41 41" never occurred; the latest "41" before the end is at 3, followed by the token itself.
    assert got[0].tolist() == [12, 20, 11]
    assert got[1, 0].item() == 41


def test_guesses_are_verified_on_cuda_only_unless_asked(tokenizer, monkeypatch):
    """Auto (None): every remaining token guessed where the draft runs on CUDA, none on a CPU,
    where a forward of several tokens costs several steps; an explicit count is kept anywhere."""
    draft = DraftModel(make_model("llama", len(tokenizer), layers=4), tokenizer)
    assert draft._guesses(None, 8) == 0 and draft._guesses(3, 8) == 3
    monkeypatch.setattr(DraftModel, "device", property(lambda self: torch.device("cuda")))
    assert draft._guesses(None, 8) == 6 and draft._guesses(None, 1) == 0 and draft._guesses(0, 8) == 0


def test_another_threads_early_exit_leaves_this_threads_forwards_alone(tokenizer):
    """The gateway scores concurrent requests in threads of one process, and a module's hooks are
    shared by every thread. While another thread's capture holds its stop-after-a-layer hook (and
    the plain-embedding check's pre-hook) open, this thread's captures must run exactly as alone:
    before the hooks were context-local, its forward stopped at the other capture's layer (a 500
    from the gateway while its warm-up ran beside the first request)."""
    import threading

    from specprefill_rag.draft.capture import hooked, leaving

    draft = DraftModel(make_model("llama", len(tokenizer), layers=4), tokenizer)
    ids, question = _prompt(tokenizer), torch.arange(50, 58)
    configs = [dict(tokens="greedy"), dict(tokens="greedy", early_exit=True, upper_keep=0.2),
               dict(tokens="siblings", early_exit=True, upper_keep=0.2)]
    alone = [draft.capture(ids, question, spec=lookahead_spec(draft, 6, layers=LAYERS, **config)) for config in configs]
    opened, done = threading.Event(), threading.Event()
    seen: list[object] = []

    def other() -> None:
        layers = draft.model.get_decoder().layers
        with leaving(layers[0]) as left, hooked(layers[1], lambda *args, **kwargs: seen.append(args), pre=True):
            opened.set()
            done.wait(60)
        seen.extend(left)

    thread = threading.Thread(target=other)
    thread.start()
    try:
        assert opened.wait(60)
        beside = [draft.capture(ids, question, spec=lookahead_spec(draft, 6, layers=LAYERS, **config))
                  for config in configs]
    finally:
        done.set()
        thread.join()
    assert seen == []  # the other thread's hooks saw none of this thread's forwards
    for a, b in zip(alone, beside, strict=True):
        assert a.lookahead_token_ids == b.lookahead_token_ids
        for qa, qb, ka, kb in zip(a.queries, b.queries, a.keys, b.keys, strict=True):
            assert torch.equal(qa, qb) and torch.equal(ka, kb)


def test_auto_guesses_follow_what_a_forward_costs_on_the_device():
    """Verified guesses where a 7-token forward costs what a 1-token one does (reading weights:
    CUDA, a CPU in bf16/fp16), one step per token where it costs several (a CPU in fp32)."""
    auto = DraftConfig()
    assert auto.guesses_on("cuda", 8) == 6
    assert auto.guesses_on("cpu", 8, torch.bfloat16) == 6 and auto.guesses_on("cpu", 8, torch.float16) == 6
    assert auto.guesses_on("cpu", 8, torch.float32) == 0 and auto.guesses_on("cpu", 8) == 0
    assert auto.guesses_on("cpu", 4, torch.bfloat16) == 2
    assert DraftConfig(lookahead_guesses=2).guesses_on("cpu", 8, torch.float32) == 2
