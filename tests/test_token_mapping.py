"""Draft → main score mapping through character offsets, on hand-made offset tables."""

from __future__ import annotations

import time

import pytest
import torch

from specprefill_rag.draft.token_mapping import content_intervals, map_scores, overlap_max
from specprefill_rag.types import AssembledPrompt, Segment, SegmentKind


def t(rows):
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 2)


def prompt(text, offsets, segments, spans):
    """An AssembledPrompt from an offset table; a token's segment is the span that contains it."""
    offsets = t(offsets)
    index = torch.full((offsets.shape[0],), -1, dtype=torch.int64)
    for s, a, b in spans:
        inside = (offsets[:, 0] >= a) & (offsets[:, 1] <= b) & (offsets[:, 1] > offsets[:, 0])
        index[inside] = s
    return AssembledPrompt(
        text=text, token_ids=torch.arange(offsets.shape[0]), segment_index=index,
        protected=index < 0, offsets=offsets, segments=tuple(segments),
        segment_spans=tuple(spans),
    )


def test_overlap_max_identity_and_straddling():
    src = t([[0, 2], [2, 5], [5, 6], [6, 9]])
    scores = torch.tensor([1.0, 4.0, 2.0, 3.0])
    assert overlap_max(src, scores, src).tolist() == [1.0, 4.0, 2.0, 3.0]
    # A main token over two draft tokens takes the larger; one draft token over two main tokens feeds both.
    assert overlap_max(src, scores, t([[0, 5], [5, 9]])).tolist() == [4.0, 3.0]
    assert overlap_max(src, scores, t([[2, 3], [3, 5], [0, 9]])).tolist() == [4.0, 4.0, 4.0]


def test_overlap_max_nearest_when_nothing_overlaps():
    # Draft spans leave whitespace out (e.g. a Whitespace pre-tokenizer); main tokens cover it.
    src = t([[0, 5], [6, 11], [15, 20]])
    scores = torch.tensor([1.0, 2.0, 3.0])
    dst = t([[5, 6], [11, 13], [13, 15], [12, 14], [20, 22], [30, 31]])
    # tie (gap 0 both sides) → higher; nearer left; nearer right; tie → higher; past the end → last.
    assert overlap_max(src, scores, dst).tolist() == [2.0, 2.0, 3.0, 3.0, 3.0, 3.0]
    assert overlap_max(src, scores, t([[-3, -1]])).tolist() == [1.0]


def test_overlap_max_long_ranges_match_brute_force():
    g = torch.Generator().manual_seed(0)
    widths = torch.randint(1, 4, (500,), generator=g)
    ends = widths.cumsum(0)
    src = torch.stack([ends - widths, ends], dim=1)
    scores = torch.rand(500, generator=g)
    a = torch.randint(0, int(ends[-1]) - 1, (300,), generator=g)
    b = a + torch.randint(1, 200, (300,), generator=g)
    got = overlap_max(src, scores, torch.stack([a, b], dim=1))
    for q in range(300):
        hit = (src[:, 0] < b[q]) & (src[:, 1] > a[q])
        assert hit.any()
        assert got[q] == scores[hit].max()


def test_multibyte_characters_share_their_span():
    # "a ☕ b": a byte-level draft splits ☕ into three pieces with the same character span.
    text = "a ☕ b"
    segs = [Segment(SegmentKind.PASSAGE, text)]
    draft = prompt(text, [[0, 1], [1, 3], [2, 3], [2, 3], [3, 5]], segs, [(0, 0, 5)])
    main = prompt(text, [[0, 1], [1, 2], [2, 3], [3, 5]], segs, [(0, 0, 5)])
    scores = torch.tensor([0.1, 0.2, 0.9, 0.3, 0.4])
    mapped = map_scores(scores, draft, main)
    assert torch.allclose(mapped, torch.tensor([0.1, 0.2, 0.9, 0.4]))


def test_segments_map_by_relative_offsets_and_template_gets_zero():
    # Different chat templates put the same segment texts at different places.
    passage, question = "red green blue", "which?"
    segs = [Segment(SegmentKind.PASSAGE, passage), Segment(SegmentKind.QUESTION, question)]
    d_text = f"<s>[INST] {passage}\n{question} [/INST]"
    d_spans = [(0, 10, 24), (1, 25, 31)]
    draft = prompt(
        d_text,
        [[0, 0], [0, 3], [3, 9], [10, 13], [13, 19], [19, 24], [24, 25], [25, 31], [31, 38]],
        segs, d_spans,
    )
    m_text = f"<|im_start|>user\n{passage}\n\n{question}<|im_end|>"
    m_spans = [(0, 17, 31), (1, 33, 39)]
    main = prompt(m_text, [[0, 12], [12, 16], [16, 17], [17, 20], [20, 31], [31, 33], [33, 39], [39, 49]],
                  segs, m_spans)
    d_scores = torch.tensor([9.0, 9.0, 9.0, 0.1, 0.2, 0.3, 9.0, 0.5, 9.0])
    mapped = map_scores(d_scores, draft, main)
    # " green blue" (one main token) overlaps " green" and " blue": max 0.3. Template → 0.
    assert mapped.tolist() == pytest.approx([0.0, 0.0, 0.0, 0.1, 0.3, 0.0, 0.5, 0.0])


def test_draft_token_crossing_a_segment_boundary_is_clipped():
    segs = [Segment(SegmentKind.QUESTION, "what")]
    text = "Q: what?"
    spans = [(0, 3, 7)]
    draft = prompt(text, [[0, 2], [2, 7], [7, 8]], segs, spans)  # " what" starts in the template
    main = prompt(text, [[0, 1], [1, 2], [2, 3], [3, 5], [5, 7], [7, 8]], segs, spans)
    assert int(draft.segment_index[1]) == -1  # the draft itself counts it as template
    mapped = map_scores(torch.tensor([5.0, 0.7, 5.0]), draft, main)
    assert mapped.tolist() == pytest.approx([0.0, 0.0, 0.0, 0.7, 0.7, 0.0])


def test_whitespace_merges_fall_back_to_the_nearest_draft_token():
    text = "one  two\n\nthree"
    segs = [Segment(SegmentKind.CONTEXT, text)]
    spans = [(0, 0, len(text))]
    draft = prompt(text, [[0, 3], [5, 8], [10, 15]], segs, spans)  # words only
    main = prompt(text, [[0, 3], [3, 5], [5, 8], [8, 10], [10, 15]], segs, spans)
    mapped = map_scores(torch.tensor([0.2, 0.5, 0.1]), draft, main)
    # "  " touches both neighbours (gap 0) → the higher; "\n\n" likewise.
    assert mapped.tolist() == pytest.approx([0.2, 0.5, 0.5, 0.5, 0.1])


def test_a_segment_without_draft_tokens_borrows_from_the_nearest_segment():
    segs = [Segment(SegmentKind.PASSAGE, "ab"), Segment(SegmentKind.PASSAGE, "cd")]
    text = "ab|cd"
    spans = [(0, 0, 2), (1, 3, 5)]
    draft = prompt(text, [[0, 2], [2, 3]], segs, spans)  # nothing over "cd"
    main = prompt(text, [[0, 2], [2, 3], [3, 5]], segs, spans)
    mapped = map_scores(torch.tensor([0.4, 9.0]), draft, main)
    assert mapped.tolist() == pytest.approx([0.4, 0.0, 0.4])


def test_empty_segment_and_special_tokens():
    segs = [Segment(SegmentKind.PASSAGE, ""), Segment(SegmentKind.QUESTION, "hi there")]
    text = "<bos>hi there<eos>"
    spans = [(0, 5, 5), (1, 5, 13)]
    # Added special tokens outside the text have (0, 0) offsets and are never mapped.
    draft = prompt(text, [[0, 0], [0, 5], [5, 7], [7, 13], [13, 18], [0, 0]], segs, spans)
    main = prompt(text, [[0, 5], [5, 13], [13, 18]], segs, spans)
    mapped = map_scores(torch.tensor([9.0, 9.0, 0.3, 0.6, 9.0, 9.0]), draft, main)
    assert mapped.tolist() == pytest.approx([0.0, 0.6, 0.0])


def test_content_intervals_clip_and_sort():
    offsets = t([[0, 4], [4, 9], [9, 12]])
    intervals, owner = content_intervals(offsets, [(1, 6, 12), (0, 0, 6)], {0: 0, 1: 100})
    assert intervals.tolist() == [[0, 4], [4, 6], [100, 103], [103, 106]]
    assert owner.tolist() == [0, 1, 1, 2]


def test_misaligned_texts_are_rejected():
    segs = [Segment(SegmentKind.PASSAGE, "abc")]
    draft = prompt("abc", [[0, 3]], segs, [(0, 0, 3)])
    main = prompt("ABC", [[0, 3]], segs, [(0, 0, 3)])
    with pytest.raises(ValueError, match="cannot align.*segment 0 reads differently"):
        map_scores(torch.ones(1), draft, main)
    with pytest.raises(ValueError, match=r"cannot align.*segments \[\]"):
        map_scores(torch.ones(1), prompt("abc", [[0, 3]], segs, []), main)
    with pytest.raises(ValueError, match="2 draft scores"):
        map_scores(torch.ones(2), draft, main)


def test_mapping_30k_tokens_is_vectorised():
    n = 30_000
    text = "x" * (4 * n)
    segs = [Segment(SegmentKind.CONTEXT, text)]
    spans = [(0, 0, len(text))]
    d_ends = torch.arange(1, n + 1) * 4
    m_ends = torch.arange(1, n * 4 // 3 + 1) * 3
    draft = prompt(text, torch.stack([d_ends - 4, d_ends], 1).tolist(), segs, spans)
    main = prompt(text, torch.stack([m_ends - 3, m_ends], 1).tolist(), segs, spans)
    scores = torch.rand(n)
    start = time.perf_counter()
    mapped = map_scores(scores, draft, main)
    assert time.perf_counter() - start < 3.0  # a Python loop over tokens would take far longer
    assert mapped.shape == (main.n_tokens,)
    # Main token [3i, 3i+3) overlaps draft tokens 3i // 4 .. (3i + 2) // 4.
    i = torch.arange(main.n_tokens)
    expected = torch.maximum(scores[(3 * i) // 4], scores[(3 * i + 2) // 4])
    assert torch.equal(mapped, expected)
