"""The benchmark page's at-a-glance figures (benchmarks/figures.py) on small synthetic result dicts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib")

from benchmarks import figures  # noqa: E402


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def _run(dtypes: dict[str, str], speedups: dict[float, list[float]], lengths: tuple[int, ...] = (2048, 4096)
         ) -> dict[str, Any]:
    rows = [{"n_tokens": n, "cells": [{"keep_rate": k, "speedup": s[i], "ideal": 1 / (0.3 + k)}
                                      for k, s in speedups.items()]} for i, n in enumerate(lengths)]
    return {"backend": "transformers", "status": "ok", "dtypes": dtypes, "lengths": rows}


def _ttft(run: dict[str, Any], device: str = "cpu") -> dict[str, Any]:
    return {"models": {"main": "main-1.5b", "draft": "draft-0.5b"}, "machine": {"cpu": "AMD EPYC", "cpu_count": 2},
            "settings": {"device": device, "best_dtype": "bfloat16"}, "runs": [run]}


BF16 = {"main": "bfloat16", "draft": "bfloat16"}


def test_speedup_figure_draws_fair_runs_only_with_their_ideal(tmp_path: Path) -> None:
    from benchmarks.report import unfair_baseline

    fair = _ttft(_run(BF16, {0.1: [2.4, 2.2], 0.3: [1.5, 1.7]}))
    slow_main = _ttft(_run({"main": "float32", "draft": "bfloat16"}, {0.1: [5.0, 6.0], 0.3: [3.0, 3.5]}))
    gpu = _ttft(_run(BF16, {0.1: [1.0, 2.9], 0.3: [1.1, 2.0]}, lengths=(4096, 32768)), device="cuda")
    gpu["runs"].append({"backend": "vllm_server", "status": "skipped", "reason": "no server"})
    path = tmp_path / "speedup.png"
    shown = figures.speedup_vs_length([("ttft_fair", fair), ("ttft_fp32-main", slow_main)], gpu, path,
                                      unfair=unfair_baseline)
    assert [(s.panel, s.label) for s in shown if s.kind == "measured"] == [
        ("CPU", "keep 10%"), ("CPU", "keep 30%"), ("GPU", "keep 10%"), ("GPU", "keep 30%")]
    assert [s.y for s in shown if s.kind == "measured"][0] == (2.4, 2.2)  # the fair file's, not the fp32 main's
    ideal = [s for s in shown if s.kind == "ideal"]
    assert len(ideal) == 4 and ideal[0].y == pytest.approx((1 / 0.4, 1 / 0.4))
    assert sum(s.kind == "reference" for s in shown) == 2  # the 1× line in each panel
    width, height = _png_size(path)
    assert 700 <= width <= 1000 and 400 <= height <= 650
    assert "CPU: 2 lengths (2k, 4k tokens); GPU: 2 lengths (4k, 32k tokens)" in figures.speedup_caption(shown)


def test_speedup_figure_writes_nothing_without_a_fair_run(tmp_path: Path) -> None:
    path = tmp_path / "speedup.png"
    unfair = _ttft(_run({"main": "float32", "draft": "float32"}, {0.1: [2.0, 2.0]}))
    assert figures.speedup_vs_length([("ttft", unfair)], None, path, unfair=lambda d, r: "unfair") == []
    assert not path.exists()


def _quality(task_rows: dict[str, tuple[int, list[tuple[float, float, float]]]]) -> dict[str, Any]:
    """A quality file: per task (prompt tokens, [(keep, retention, n)]), its summary and rows."""
    summary, rows = [], []
    for task, (tokens, points) in task_rows.items():
        rows.append({"task": task, "method": "full", "keep_rate": None, "n_prompt": tokens})
        for keep, retention, n in points:
            summary.append({"task": task, "method": "specprefill", "keep_rate": keep, "n": int(n), "metric": "acc",
                            "retention_vs_full": retention, "retention_ci": [retention - 0.1, retention + 0.1]})
            rows.append({"task": task, "method": "specprefill", "keep_rate": keep, "n_prompt": tokens})
        summary.append({"task": task, "method": "llmlingua", "keep_rate": 0.1, "n": 5, "metric": "acc",
                        "retention_vs_full": 0.2, "retention_ci": [0.1, 0.3]})
    return {"summary": summary, "rows": rows}


def test_quality_figure_plots_each_task_against_its_length(tmp_path: Path) -> None:
    short = _quality({"needle": (1700, [(0.1, 1.0, 60), (0.3, 1.0, 60)]), "squad": (1200, [(0.1, 1.05, 60)])})
    long = _quality({"needle_8k": (8800, [(0.1, 0.95, 30)]), "needle_16k": (17500, [(0.1, float("nan"), 30)])})
    path = tmp_path / "quality.png"
    shown = figures.quality_vs_length([("quality", short), ("quality_long_bf16", long)], path, title="t")
    measured = {s.label: (s.x, s.y, s.n) for s in shown if s.kind == "measured"}
    # The long needle joins the short one; a NaN retention and other methods are left out.
    assert measured == {"needle, keep 10%": ((1700.0, 8800.0), (1.0, 0.95), (60, 30)),
                        "needle, keep 30%": ((1700.0,), (1.0,), (60,)),
                        "squad, keep 10%": ((1200.0,), (1.05,), (60,))}
    assert [s.label for s in shown if s.kind == "reference"] == ["full prompt (= 1)"]
    width, height = _png_size(path)
    assert 700 <= width <= 1000 and 400 <= height <= 700
    caption = figures.quality_caption(shown, ["quality", "quality_long_bf16"])
    assert "needle at 2 lengths: 1.7k (10%, 30%), 8.6k (10%)" in caption and "squad at 1 length" in caption
    assert figures.quality_vs_length([("quality", {"summary": [], "rows": []})], tmp_path / "none.png") == []
