"""``bench reading``: each passage-local reading scored by the library beside joint reading on the
same prompt, the readings that share a reading of the passages read it once, and the paired table."""

from __future__ import annotations

from helpers import make_model

from benchmarks.lib.datasets import Example
from benchmarks.suites import reading


def _example() -> Example:
    passages = (("a", "The grass is green. The sky is blue. " * 5), ("b", "The passkey is 48213. Remember it."),
                ("c", "The quick brown fox jumps over the lazy dog. " * 4))
    start = passages[1][1].index("The passkey")
    return Example("hotpotqa", "x1", "what is the passkey?", passages, ("48213",),
                   evidence=((1, start, start + 21),), key=((1, start, start + 21),))


def test_each_reading_is_scored_and_the_passages_are_read_once(tokenizer) -> None:
    from specprefill_rag.draft import DraftModel

    draft = DraftModel(make_model("qwen2", len(tokenizer), layers=8), tokenizer)
    row = reading.score_example(draft, tokenizer, _example(), ["joint", "none", "dev30", "all"], [0.1, 0.5])
    assert row["units"] == 3 and set(row["sec"]) == {"joint", "none", "dev30", "all"}
    assert set(row["res"]) == {f"{r}@{k}" for r in ("joint", "none", "dev30", "all") for k in ("0.1", "0.5")}
    assert all(len(cells) == 3 and 0 <= cells[0] <= 1 for cells in row["res"].values())
    # none and dev30 share one reading of the passages; "all" keeps fewer layers: a reading of its own.
    assert draft.passages.counts.misses == 2 * 3 and draft.passages.counts.hits == 3
    assert len(row["look"]["joint"]) <= 7


def test_the_paired_table_compares_each_reading_with_joint() -> None:
    rows = [{"task": "hotpotqa", "id": str(i), "res": {"joint@0.1": [0.5, 1, 0.1], "none@0.1": [0.5 - 0.1 * i, 0, 0.1]},
             "look": {"joint": [1], "none": [1] if i else [2]}} for i in range(3)]
    (entry,) = reading.paired(rows)
    assert entry["reading"] == "none" and entry["n"] == 3 and abs(entry["diff"] + 0.1) < 1e-9
    assert entry["complete"] == 0 and entry["joint_complete"] == 1 and abs(entry["same_lookahead"] - 2 / 3) < 1e-9
