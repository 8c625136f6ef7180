"""``bench report``'s two pages: benchmarks/REPORT.md holds every table, docs/benchmarks.md its
summary (the fair TTFT sections, quality and serving cut to their lead, the rest listed with
links), both exactly what the repository's result files give."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import report
from benchmarks.report import summary

PAGE = [
    "# Benchmarks", "",
    "## Headline", "", "| a | b |", "|---|---|", "| 1 | 2 |", "",
    "## How these runs are made", "", "Side by side.", "",
    "## Time to first token: d → m (CPU, `ttft.json`)", "", "### Backend `transformers` — unfair baseline (x)", "",
    "| prompt | speedup |", "|---|---|", "| 2048 | **9.0×** |", "",
    "## Time to first token: d → m (CPU, `ttft_fair.json`)", "", "- command: `bench ttft`", "",
    "### Backend `transformers`", "", "| prompt | speedup |", "|---|---|", "| 2048 | **2.4×** |", "",
    "Efficiency target ≥ 0.85.", "", "| second | table |", "|---|---|", "| 3 | 4 |", "",
    "![TTFT](images/bench_ttft.png)", "",
    "## Evidence recall (draft only)", "", "| task | recall |", "|---|---|", "| hotpotqa | 0.8 |", "",
    "## Install and reproduce", "", "pip install", "",
]


def test_the_summary_keeps_the_fair_sections_lead_and_lists_the_rest():
    full = "../benchmarks/REPORT.md"
    text = "\n".join(summary.summary(PAGE, full))
    assert "**2.4×**" in text and "Efficiency target ≥ 0.85." in text and "![TTFT](images/bench_ttft.png)" in text
    assert "| second | table |" not in text  # past the lead: in the full report only
    assert "**9.0×**" not in text and "| hotpotqa | 0.8 |" not in text  # an unfair run, an unkept section
    assert f"The rest of this section: [the full report]({full}#time-to-first-token-d--m-cpu-ttft_fairjson)" in text
    assert f"- [Evidence recall (draft only)]({full}#evidence-recall-draft-only)" in text
    assert f"- [Time to first token: d → m (CPU, `ttft.json`)]({full}#time-to-first-token-d--m-cpu-ttftjson)" in text
    assert summary.label("Time to first token: d → m (CPU, `benchmarks/results/ttft_x.json`)") == (
        "Time to first token, `ttft_x.json`")
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings == ["## Headline", "## How these runs are made",
                        "## Time to first token: d → m (CPU, `ttft_fair.json`)",
                        f"## Every other table ([the full report]({full}))", "## Install and reproduce"]


def test_relink_repoints_relative_links_to_the_same_files(tmp_path):
    lines = ["![a](images/x.png) see [findings](findings.md), [web](https://example.com/a.md), [t](#reading)"]
    docs, moved = tmp_path / "docs", tmp_path / "benchmarks"
    assert summary.relink(lines, docs, moved) == ["![a](../docs/images/x.png) see [findings](../docs/findings.md), "
                                                  "[web](https://example.com/a.md), [t](#reading)"]
    assert summary.relink(lines, docs, docs) == lines


@pytest.mark.full  # renders every figure again (~1 min on 2 cores)
def test_the_committed_pages_are_what_the_current_files_give(tmp_path: Path):
    """Both pages are generated (``bench report``): rendered again from the repository's result
    files they are the committed ones, and the summary stays a page a person reads."""
    docs = tmp_path / "docs"
    full = tmp_path / "benchmarks" / "REPORT.md"
    report.render(report.RESULTS_DIR, docs / "benchmarks.md", docs / "images", None, full=full)
    assert full.read_text() == report.FULL.read_text()
    assert (docs / "benchmarks.md").read_text() == report.DOC.read_text()
    assert len(report.DOC.read_text().split()) <= 5000
