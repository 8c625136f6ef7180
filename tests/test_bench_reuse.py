"""bench reuse on tiny random models: every reading of every question is timed and recorded, warm
follow-ups are served by the stores they name, the indexed corpus is read ahead, and a rerun resumes."""

from __future__ import annotations

from benchmarks.lib.results import read_jsonl
from benchmarks.suites import reuse


def test_the_workloads_record_each_reading_and_what_served_it(tmp_path, monkeypatch):
    monkeypatch.setattr(reuse, "RESULTS_DIR", tmp_path)
    args = ["--tiny", "--lengths", "384", "--questions", "2", "--out", "reuse.jsonl"]
    assert reuse.main(args) == 0
    rows = read_jsonl(tmp_path / "reuse.jsonl")
    assert [(r["workload"], r["question"]) for r in rows] == [("follow_up", 0), ("follow_up", 1),
                                                              ("indexed", 0), ("indexed", 1)]
    cold, warm = rows[0], rows[1]
    assert cold["prefix"]["draft_cached_tokens"] == 0 and cold["apart"]["passages_read"] > 0
    assert warm["prefix"]["draft_cached_tokens"] > 0  # the follow-up's start: read by the first question
    assert warm["joint"]["draft_cached_tokens"] == 0 and warm["joint"]["passages_cached"] == 0
    for row in rows[2:]:  # the corpus was read ahead: every passage of every question found
        assert row["apart"]["passages_read"] == 0 and row["apart"]["passages_cached"] > 0
        assert row["read_ahead_s"] > 0 and row["read"] == row["corpus"]
    summary = reuse.summarize(rows)
    assert {(e["workload"], e["warm"], e["reading"]) for e in summary} == {
        (w, s, r) for w, s in (("follow_up", False), ("follow_up", True), ("indexed", True)) for r in reuse.READINGS}
    assert all(e["speedup"] > 0 and e["r"] > 0 for e in summary)
    assert reuse.main(args) == 0  # a rerun finds every cell done
    assert len(read_jsonl(tmp_path / "reuse.jsonl")) == 4


def test_a_resumed_follow_up_finds_the_stores_warm(tmp_path, monkeypatch):
    """Cut after the first question (one row kept), a rerun measures the second as warm as an
    unbroken run does: the first question is read again, untimed, by the readings with stores."""
    monkeypatch.setattr(reuse, "RESULTS_DIR", tmp_path)
    args = ["--tiny", "--lengths", "384", "--questions", "2", "--workloads", "follow_up", "--out", "reuse.jsonl"]
    assert reuse.main(args) == 0
    path = tmp_path / "reuse.jsonl"
    first = path.read_text().splitlines()[0]
    path.write_text(first + "\n")
    assert reuse.main(args) == 0
    rows = read_jsonl(path)
    assert [r["question"] for r in rows] == [0, 1]
    assert rows[1]["prefix"]["draft_cached_tokens"] > 0 and rows[1]["apart"]["draft_cached_tokens"] > 0
