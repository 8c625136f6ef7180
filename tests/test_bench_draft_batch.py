"""``bench draft_batch``: the draft's throughput when concurrent requests share passes, a tiny run."""

from __future__ import annotations

import json

from benchmarks.suites import draft_batch


def test_batch_lengths_stay_within_the_spread_and_are_seeded():
    lengths = draft_batch.batch_lengths(1000, 16, 0.25, seed=3)
    assert lengths == draft_batch.batch_lengths(1000, 16, 0.25, seed=3)
    assert all(750 <= n <= 1250 for n in lengths) and len(set(lengths)) > 8
    assert draft_batch.batch_lengths(1000, 4, 0.0, seed=3) == [1000] * 4


def test_a_tiny_run_times_each_way_and_scores_as_alone(tmp_path):
    out = tmp_path / "db.json"
    assert draft_batch.main(["--tiny", "--batches", "1", "3", "--spreads", "0", "0.5", "--reps", "1",
                             "--pad-limit", "0.05", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["benchmark"] == "draft_batch" and data["pad_limit"] == 0.05
    rows = {(r["batch"], r["spread"]): r for r in data["rows"]}
    assert set(rows) == {(1, 0.0), (3, 0.0), (1, 0.5), (3, 0.5)}
    for r in rows.values():
        assert set(r["prompts_per_s"]) == {"alone", "padded", "buckets"} and r["vs_alone"]["alone"] == 1.0
        assert r["max_score_diff"]["padded"] < 0.05 and r["max_score_diff"]["buckets"] < 0.05  # bf16 rounding
    assert rows[(3, 0.0)]["padding_share"] == 0.0 and rows[(3, 0.5)]["padding_share"] > 0.05
