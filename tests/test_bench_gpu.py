"""The GPU suites (``gpu_ttft``, ``gpu_attention``) as dry runs on the CPU: the files a GPU run
will write."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.mark.full
def test_gpu_script_dry_run_on_cpu(tmp_path: Path) -> None:
    from benchmarks.suites import gpu_ttft

    out = tmp_path / "gpu.json"
    assert gpu_ttft.main(["--tiny", "--lengths", "128", "--keep-rates", "0.3", "--reps", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    (row,) = data["runs"][0]["lengths"]
    assert row["n_tokens"] == 128 and row["cells"][0]["speedup"] > 0
    # The other look-ahead side by side: greedy over full forwards beside the early-exit default.
    assert row["compared_label"] == "greedy 8, full forward" and row["cells_compared"][0]["keep_rate"] == 0.1
    # the default is not a variant of itself; the others keep its stop at the draft's end
    default = "greedy 8, early exit, upper layers read 30%, to the draft's end"
    assert data["settings"]["lookahead_label"] == default and default not in row["lookahead_scoring"]
    assert set(row["lookahead_scoring"]) >= {
        "greedy 8, full forward, to the draft's end", "greedy 8, early exit, upper layers read 15%, to the draft's end",
        "siblings, full forward", "siblings, early exit, upper layers read 15%"}
    assert "greedy 8, early exit, upper layers read 30%" in row["lookahead_scoring"]  # the same, never stopped
    # The V2 runner's rewrite is checked on a GPU with vLLM; here it says why it was not.
    assert data["vllm_v2_runner"]["status"] == "skipped" and data["vllm_v2_runner"]["why"]
    # The look-ahead's attention through SDPA and the short path: both SDPA on a CPU, so equal.
    (attn,) = data["attention"]
    assert attn["n_tokens"] == 128 and attn["same_lookahead_tokens"] and attn["max_score_diff"] == 0.0


def test_gpu_attention_dry_run_on_cpu(tmp_path: Path) -> None:
    """Every variant timed at every length; the short path's output is SDPA's within bf16 rounding."""
    from benchmarks.suites import gpu_attention

    out = tmp_path / "attention.json"
    assert gpu_attention.main(["--tiny", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["n_keys"] for r in rows] == [256, 1024]
    for r in rows:
        assert {"sdpa", "short, one values product", "short, values in blocks of 512"} <= set(r["us"])
        assert all(us > 0 for us in r["us"].values())
        assert max(r["max_diff_vs_float32"].values()) < 0.1  # outputs of magnitude ~3, bf16
