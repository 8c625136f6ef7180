"""Selection: chunks, budgets, protected spans, plans."""

from __future__ import annotations

import pytest
import torch

from specprefill_rag.config import SelectionConfig
from specprefill_rag.selection import full_plan, plan_from_indices, select, unit_bounds, unit_ranks
from specprefill_rag.types import AssembledPrompt, Segment, SegmentKind


def layout(*parts: tuple[int, int, bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """(segment index, length, protected) parts → segment_index, protected tensors."""
    seg = torch.cat([torch.full((n,), s, dtype=torch.int64) for s, n, _ in parts])
    prot = torch.cat([torch.full((n,), p, dtype=torch.bool) for _, n, p in parts])
    return seg, prot


def test_unit_bounds_without_sentences_cut_at_size_segments_and_protected_tokens():
    seg, prot = layout((-1, 3, True), (0, 70, False), (1, 10, False), (-1, 2, True), (2, 5, False))
    bounds = unit_bounds(seg, ~prot, 32).tolist()
    assert bounds == [[3, 35], [35, 67], [67, 73], [73, 83], [85, 90]]


def test_unit_bounds_empty_when_nothing_prunable():
    seg, prot = layout((-1, 10, True))
    assert unit_bounds(seg, ~prot, 4).shape == (0, 2)


def test_select_keeps_protected_and_best_chunks_within_budget():
    seg, prot = layout((-1, 4, True), (0, 64, False), (1, 64, False), (2, 4, True))
    scores = torch.zeros(136)
    scores[4 + 32 : 4 + 64] = 1.0  # second chunk of passage 0
    scores[68:100] = 0.5  # first chunk of passage 1
    config = SelectionConfig(keep_rate=0.25, min_prompt_tokens=0)  # budget 34: 8 protected + 1 chunk
    kept = select(scores, prot, seg, config)
    expected = list(range(4)) + list(range(36, 68)) + list(range(132, 136))
    assert kept.tolist() == expected
    # A larger budget takes the next best chunk whole (rounding up to chunks).
    kept = select(scores, prot, seg, SelectionConfig(keep_rate=0.35, min_prompt_tokens=0))
    assert kept.tolist() == list(range(4)) + list(range(36, 100)) + list(range(132, 136))


def test_protected_tokens_come_on_top_of_the_context_budget():
    seg, prot = layout((0, 50, False), (1, 40, True))
    config = SelectionConfig(token_budget=10, chunk_size=10, unit="chunk", min_prompt_tokens=0)
    kept = select(torch.rand(90), prot, seg, config)
    assert set(range(50, 90)) <= set(kept.tolist())
    assert len(kept) == 40 + 10  # all 40 protected plus the 10-token context budget


def test_token_budget_and_clamps():
    seg, prot = layout((0, 208, False))
    scores = torch.arange(208, dtype=torch.float32)  # later chunks score higher
    kept = select(scores, prot, seg, SelectionConfig(token_budget=64, chunk_size=16, min_prompt_tokens=0))
    assert kept.tolist() == list(range(144, 208))
    config = SelectionConfig(keep_rate=0.01, min_keep_tokens=32, chunk_size=16, min_prompt_tokens=0)
    kept = select(scores, prot, seg, config)
    assert kept.tolist() == list(range(176, 208))
    config = SelectionConfig(keep_rate=0.9, max_keep_tokens=16, chunk_size=16, min_prompt_tokens=0)
    kept = select(scores, prot, seg, config)
    assert kept.tolist() == list(range(192, 208))


def test_short_prompts_are_kept_whole():
    seg, prot = layout((0, 100, False))
    kept = select(torch.rand(100), prot, seg, SelectionConfig(keep_rate=0.1, min_prompt_tokens=101))
    assert kept.tolist() == list(range(100))


def test_ties_prefer_earlier_chunks():
    seg, prot = layout((0, 64, False))
    kept = select(torch.ones(64), prot, seg, SelectionConfig(token_budget=32, min_prompt_tokens=0))
    assert kept.tolist() == list(range(32))


def test_select_rejects_mismatched_lengths():
    seg, prot = layout((0, 10, False))
    with pytest.raises(ValueError, match="one entry per prompt token"):
        select(torch.rand(9), prot, seg, SelectionConfig())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"keep_rate": 0.0}, "keep_rate must be in"),
        ({"keep_rate": 1.5}, "keep_rate must be in"),
        ({"keep_rate": float("nan")}, "keep_rate must be in"),
        ({"token_budget": 0}, "token_budget"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"positions": "shifted"}, "positions"),
        ({"min_keep_tokens": 10, "max_keep_tokens": 5}, "max_keep_tokens"),
    ],
)
def test_selection_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SelectionConfig(**kwargs)


def make_prompt() -> AssembledPrompt:
    segments = (
        Segment(SegmentKind.PASSAGE, "a", "p1"),
        Segment(SegmentKind.PASSAGE, "b", "p2"),
        Segment(SegmentKind.QUESTION, "q"),
    )
    seg = torch.tensor([-1, 0, 0, 0, 0, 1, 1, 1, -1, 2, 2, -1])
    return AssembledPrompt(
        text="", token_ids=torch.arange(100, 112), segment_index=seg,
        protected=(seg < 0) | (seg == 2), offsets=torch.zeros(12, 2, dtype=torch.int64), segments=segments,
    )


def test_plan_keeps_original_positions_and_reports_spans():
    prompt = make_prompt()
    kept = torch.tensor([0, 2, 3, 7, 8, 9, 10, 11])
    plan = plan_from_indices(prompt, kept)
    assert plan.token_ids.tolist() == [100, 102, 103, 107, 108, 109, 110, 111]
    assert plan.position_ids.tolist() == kept.tolist()
    assert plan.next_position == 12 and plan.n_prompt == 12 and plan.speculated
    assert plan.keep_ratio == pytest.approx(8 / 12)
    p1, p2, q = plan.kept_spans
    assert (p1.id, p1.n_tokens, p1.n_kept, p1.ranges) == ("p1", 4, 2, ((2, 4),))
    assert (p2.n_kept, p2.ranges, p2.keep_ratio) == (1, ((7, 8),), pytest.approx(1 / 3))
    assert q.kind is SegmentKind.QUESTION and q.keep_ratio == 1.0


def test_contiguous_positions_ablation():
    plan = plan_from_indices(make_prompt(), torch.tensor([0, 5, 9, 10, 11]), contiguous_positions=True)
    assert plan.position_ids.tolist() == [0, 1, 2, 3, 4]
    assert plan.next_position == 5


def test_full_plan_and_bad_indices():
    plan = full_plan(make_prompt())
    assert plan.position_ids.tolist() == list(range(12)) and not plan.speculated
    with pytest.raises(ValueError, match="strictly increasing"):
        plan_from_indices(make_prompt(), torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="lie in"):
        plan_from_indices(make_prompt(), torch.tensor([5, 12]))
    with pytest.raises(ValueError, match="at least one"):
        plan_from_indices(make_prompt(), torch.tensor([], dtype=torch.int64))


def test_sentence_units_keep_the_relevant_sentence_whole():
    # Passage 0: sentences of 12, 20 and 9 tokens; passage 1: one sentence of 30 tokens.
    seg, prot = layout((-1, 3, True), (0, 41, False), (1, 30, False), (-1, 3, True))
    starts = torch.zeros(77, dtype=torch.bool)
    starts[[3, 15, 35, 44]] = True
    scores = torch.full((77,), 0.1)
    scores[20:24] = 1.0  # a few high tokens inside the second sentence
    config = SelectionConfig(token_budget=10, min_prompt_tokens=0)  # unit="sentence" by default
    kept = select(scores, prot, seg, config, starts)
    assert kept.tolist() == [0, 1, 2, *range(15, 35), 74, 75, 76]  # the whole 20-token sentence
    # Fixed chunks cut the same context at 8-token marks instead.
    chunked = select(scores, prot, seg, SelectionConfig(token_budget=10, unit="chunk", chunk_size=8,
                                                        min_prompt_tokens=0), starts)
    assert chunked.tolist() == [0, 1, 2, *range(3, 11), *range(19, 27), 74, 75, 76]  # best chunk, then earliest tie


def test_units_never_cross_passages_and_long_sentences_are_cut():
    seg, prot = layout((0, 10, False), (1, 100, False))
    starts = torch.zeros(110, dtype=torch.bool)  # no sentence end anywhere: one run per passage
    bounds = unit_bounds(seg, ~prot, 64, starts).tolist()
    assert bounds == [[0, 10], [10, 74], [74, 110]]
    for a, b in bounds:
        assert len(set(seg[a:b].tolist())) == 1


def test_context_budget_is_never_zero():
    config = SelectionConfig(keep_rate=0.001, min_prompt_tokens=0)
    assert config.budget(40) == 1 and config.budget(0) == 0
    seg, prot = layout((-1, 200, True), (0, 40, False))
    kept = select(torch.rand(240), prot, seg, config)
    assert int((~prot[kept]).sum()) >= 1


def test_keep_rate_is_a_fraction_of_the_context():
    seg, prot = layout((-1, 100, True), (0, 100, False))  # half the prompt is protected
    kept = select(torch.rand(200), prot, seg, SelectionConfig(keep_rate=0.3, unit="chunk", chunk_size=10,
                                                              min_prompt_tokens=0))
    assert len(kept) == 100 + 30


def test_passage_weight_lifts_sentences_of_the_broadly_read_passage():
    seg, prot = layout((0, 20, False), (0, 20, False), (1, 20, False), (1, 20, False))
    starts = torch.zeros(80, dtype=torch.bool)
    starts[[0, 20, 40, 60]] = True
    scores = torch.cat([torch.full((20,), 0.50), torch.full((20,), 0.45), torch.full((20,), 0.52),
                        torch.full((20,), 0.01)])
    plain = select(scores, prot, seg, SelectionConfig(token_budget=40, min_prompt_tokens=0), starts)
    assert plain.tolist() == [*range(0, 20), *range(40, 60)]  # the two best sentences
    blended = select(scores, prot, seg, SelectionConfig(token_budget=40, passage_weight=0.5, min_prompt_tokens=0),
                     starts)
    assert blended.tolist() == list(range(0, 40))  # passage 0 as a whole is read more


def test_keep_mass_stops_once_the_mass_is_held():
    seg, prot = layout((0, 100, False))
    scores = torch.full((100,), 0.001)
    scores[:10] = 1.0  # 10 tokens hold ~99% of the mass
    config = SelectionConfig(keep_rate=0.5, keep_mass=0.9, unit="chunk", chunk_size=10, min_prompt_tokens=0)
    assert select(scores, prot, seg, config).tolist() == list(range(10))
    capped = SelectionConfig(keep_rate=0.05, keep_mass=0.99, unit="chunk", chunk_size=5, min_prompt_tokens=0)
    assert select(scores, prot, seg, capped).tolist() == list(range(5))  # keep_rate is the ceiling


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"chunk_size": 2.5}, TypeError),
        ({"keep_rate": True}, TypeError),
        ({"token_budget": "10"}, TypeError),
        ({"unit": "paragraph"}, ValueError),
        ({"passage_weight": 1.5}, ValueError),
        ({"keep_mass": 0.0}, ValueError),
        ({"protect_instructions": "no"}, ValueError),
    ],
)
def test_selection_config_rejects_wrong_types_and_values(kwargs, error):
    with pytest.raises(error):
        SelectionConfig(**kwargs)


def test_retriever_prior_lifts_the_passage_the_retriever_ranks_first():
    # Three 20-token passages (segments 0, 1, 2), then a protected question (segment 3).
    segment = torch.tensor([0] * 20 + [1] * 20 + [2] * 20 + [3] * 4)
    protected = segment == 3
    scores = torch.ones(64)
    scores[:20] = 1.2  # the draft mildly prefers passage 0
    prior = torch.tensor([0.1, 0.9, float("nan"), float("nan")])  # the retriever prefers passage 1
    base = SelectionConfig(keep_rate=20 / 60, unit="chunk", chunk_size=20, min_prompt_tokens=0, retriever_weight=0.0)
    drafted = select(scores, protected, segment, base, passage_prior=prior)
    assert drafted[:20].tolist() == list(range(20))  # weight 0: the prior is ignored
    weighted = SelectionConfig(**{**base.__dict__, "retriever_weight": 0.5})
    kept = select(scores, protected, segment, weighted, passage_prior=prior)
    assert kept[:20].tolist() == list(range(20, 40))
    # A passage without a score sits in the middle of the known range: between 0 and 1.
    ranks = unit_ranks(scores, torch.tensor([[0, 20], [20, 40], [40, 60]]), segment, prior=prior, prior_weight=1.0)
    assert ranks.tolist() == pytest.approx([0.0, 1.0, 0.5])
    with pytest.raises(ValueError, match="retriever_weight must be in"):
        SelectionConfig(retriever_weight=1.5)


def test_retriever_scores_come_from_passage_metadata():
    from specprefill_rag.prompt import build_segments
    from specprefill_rag.selection import retriever_scores
    from specprefill_rag.types import Passage

    segs = build_segments("q?", [Passage("a", metadata={"score": 0.7}), Passage("b"), "c"])
    prior = retriever_scores(segs)
    assert prior is not None and prior[0].item() == pytest.approx(0.7)  # no instructions: passage a first
    assert torch.isnan(prior[1:]).all()  # b, c and the question have no score
    assert retriever_scores(build_segments("q?", ["a", Passage("b", metadata={"score": True})])) is None


def bounds_of(levels: list[int], max_tokens: int) -> list[list[int]]:
    n = len(levels)
    return unit_bounds(torch.zeros(n, dtype=torch.int64), torch.ones(n, dtype=torch.bool), max_tokens,
                       cuts=torch.tensor(levels, dtype=torch.int8)).tolist()


def test_long_units_are_cut_at_word_starts_never_inside_a_word():
    # a word of 5 tokens (0..4), then words at 5 and 9: the limit of 4 falls inside the first word
    assert bounds_of([1, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0], 4) == [[0, 5], [5, 9], [9, 12]]
    # without cut levels: exactly after max_tokens, wherever that falls
    n = 12
    exact = unit_bounds(torch.zeros(n, dtype=torch.int64), torch.ones(n, dtype=torch.bool), 4).tolist()
    assert exact == [[0, 4], [4, 8], [8, 12]]


def test_a_clause_start_in_the_second_half_wins_over_a_later_word_start():
    assert bounds_of([1, 1, 2, 1, 1, 1, 1, 1], 4) == [[0, 2], [2, 6], [6, 8]]
    assert bounds_of([1, 2, 1, 1, 1, 1], 4) == [[0, 4], [4, 6]]  # a clause at 1 is too early: latest word start


def test_a_run_without_word_starts_is_cut_after_long_run_limits():
    from specprefill_rag.selection import LONG_RUN

    levels = [1] + [0] * 40
    assert bounds_of(levels, 4) == [[0, 4 * LONG_RUN], [4 * LONG_RUN, 8 * LONG_RUN], [8 * LONG_RUN, 41]]


def test_select_checks_the_cut_levels_length():
    config = SelectionConfig(keep_rate=0.5, min_prompt_tokens=0)
    with pytest.raises(Exception, match=r"cut_level \(3\) must have one entry per prompt token \(4\)"):
        select(torch.rand(4), torch.zeros(4, dtype=torch.bool), torch.zeros(4, dtype=torch.int64), config,
               cut_level=torch.ones(3, dtype=torch.int8))
