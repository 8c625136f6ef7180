"""``bench peer_evidence``: what a compressed context keeps of the gold (answer, evidence bigrams,
both hops), the paired summary, and a tiny-model run that resumes without redoing an example."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import HAS_LINGUA, needs_data

from benchmarks.lib.datasets import Example
from benchmarks.lib.results import read_jsonl
from benchmarks.suites import peer_evidence

HOP_1 = "Ada Lovelace was born in London in 1815."
HOP_2 = "Her father was the poet Lord Byron."
OTHER = "The Analytical Engine was never built."


def _example(answers: tuple[str, ...] = ("Lord Byron",), key_share: float = 0.5) -> Example:
    first, second = f"Lovelace\n{HOP_1} {OTHER}", f"Byron\n{HOP_2}"
    spans = ((0, first.index(HOP_1), first.index(HOP_1) + len(HOP_1)), (1, second.index(HOP_2), len(second)))
    return Example("hotpotqa", "q1", "Who was the father of the woman born in London in 1815?",
                   (("Lovelace", first), ("Byron", second)), answers, evidence=spans, key=spans, key_share=key_share)


def test_a_context_that_keeps_both_sentences_keeps_all_the_evidence() -> None:
    assert peer_evidence.measure(_example(), f"{HOP_1} … {HOP_2}") == (1.0, 1.0, 1.0)


def test_a_dropped_hop_loses_its_bigrams_and_the_example_is_not_complete() -> None:
    answer, evidence, complete = peer_evidence.measure(_example(), f"{HOP_1} {OTHER}")
    assert answer == 0.0 and complete == 0.0
    # HOP_1 has 7 bigrams ("was born", ...), all kept; HOP_2 5 (articles go, as in answers), none kept.
    assert evidence == pytest.approx(7 / 12)


def test_thinned_words_count_by_the_bigrams_they_break() -> None:
    # LongLLMLingua-style: words dropped inside a sentence break the bigrams around them.
    thinned = "Ada Lovelace born London 1815. Her father was the poet Lord Byron."
    answer, evidence, complete = peer_evidence.measure(_example(), thinned)
    assert answer == 1.0
    assert evidence == pytest.approx((1 + 5) / 12)  # only "ada lovelace" survives of HOP_1
    assert complete == 0.0  # HOP_1 under half kept
    assert peer_evidence.measure(_example(key_share=0.1), thinned)[2] == 1.0


def test_one_word_spans_and_yes_no_answers() -> None:
    ex = Example("squad", "s1", "When?", (("p", "It opened in 1,815 after a delay."),), ("1815",),
                 evidence=((0, 13, 18),), key=((0, 13, 18),))
    assert peer_evidence.measure(ex, "opened in 1815") == (1.0, 1.0, 1.0)  # digit groups joined, one word found
    assert peer_evidence.measure(ex, "after a delay") == (0.0, 0.0, 0.0)
    assert peer_evidence.measure(_example(answers=("yes",)), HOP_1)[0] is None  # no context spells "yes"


def test_summary_pairs_text_mode_with_each_peer_on_the_same_examples() -> None:
    def row(i: int, text: float, lingua: float) -> dict[str, object]:
        return {"task": "squad", "id": str(i), "n_prompt": 2000, "results": {
            "text@0.1": [text, text, text, 0.1, 2.0], "llmlingua@0.1": [lingua, lingua, lingua, 0.2, 6.0]}}

    rows = [row(0, 1.0, 0.0), row(1, 1.0, 1.0), row(2, 0.0, 0.0), row(3, 1.0, 0.0)]
    by = {e["method"]: e for e in peer_evidence.summarize(rows)}
    assert by["text"]["n"] == 4 and by["text"]["evidence"] == 0.75 and by["llmlingua"]["answer"] == 0.25
    assert by["text"]["evidence_vs_llmlingua"] == pytest.approx(0.5)
    assert by["text"]["evidence_vs_ragcompress"] is None  # no ragcompress rows
    assert "evidence_vs_llmlingua" not in by["llmlingua"]
    assert by["text"]["s_per_1k"] == pytest.approx(1.0) and by["llmlingua"]["s_per_1k"] == pytest.approx(3.0)
    assert by["llmlingua"]["context_kept"] == pytest.approx(0.2)


@needs_data
def test_tiny_run_measures_every_method_and_resumes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "peer.jsonl"
    methods = ["text", "ragcompress"] + (["llmlingua"] if HAS_LINGUA else [])
    argv = ["--tiny", "--tasks", "needle", "--needle-lengths", "256", "--n-needle", "2", "--keep-rates", "0.3",
            "--methods", *methods, "--out", str(out)]
    assert peer_evidence.main(argv) == 0
    rows = read_jsonl(out)
    assert [r["task"] for r in rows] == ["needle", "needle"]
    for r in rows:
        assert set(r["results"]) == {f"{m}@0.3" for m in methods}
        for answer, evidence, complete, kept, seconds in r["results"].values():
            assert answer in (0.0, 1.0) and 0.0 <= evidence <= 1.0 and complete in (0.0, 1.0)
            assert 0.0 < kept < 1.0 and seconds > 0  # something kept, less than the whole context
    assert peer_evidence.main(argv) == 0  # a rerun resumes: nothing to redo
    assert read_jsonl(out) == rows
    capsys.readouterr()
    assert peer_evidence.main([*argv, "--summary"]) == 0
    assert "needle     text" in capsys.readouterr().out
