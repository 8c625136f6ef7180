"""``bench gateway_load``: its summary, its report section, both sides' precision."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_gateway_load_summary_and_report_section() -> None:
    from benchmarks import report
    from benchmarks.suites import gateway_load

    assert gateway_load.percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert gateway_load.percentile([5.0], 0.95) == 5.0
    rows = [{"mode": "direct", "status": 200, "ttft_s": t} for t in (2.0, 4.0, 6.0)]
    rows += [{"mode": "gateway", "status": 200, "ttft_s": t, "same_as_alone": True} for t in (1.0, 2.0)]
    rows += [{"mode": "gateway", "status": 429, "ttft_s": None}, {"mode": "gateway", "status": 502, "ttft_s": None}]
    summary = gateway_load.summarise(rows)
    assert summary["direct"]["p50_ttft_s"] == 4.0 and summary["gateway"]["p50_ttft_s"] == 1.5
    assert summary["gateway"]["refused_429"] == 1 and summary["gateway"]["other_errors"] == 1
    assert summary["gateway"]["answered"] == 2 and summary["p50_speedup"] == pytest.approx(4.0 / 1.5)
    summary.update(gateway_same_as_alone=2, gateway_answered=2)
    data = {"summary": summary, "settings": {"clients": 3, "rounds": 1, "top_k": 8, "keep_rate": 0.2, "max_tokens": 8},
            "models": {"main": "m", "draft": "d"}, "machine": {}, "command": "c"}
    text = "\n".join(report.gateway_section(data))
    assert "| gateway, SpecPrefill | 4 | 2 | 1 | 1 | 1.50 s |" in text and "p50 2.67×" in text
    assert "(precisions not recorded; **unverified baseline" in text  # a file from before the record
    fair = {**data, "dtypes": {"main": "bfloat16", "draft": "bfloat16"}, "machine": {"cpu_native_bf16": True}}
    assert "× (draft bf16, main bf16). Gateway answers" in "\n".join(report.gateway_section(fair))
    unfair = {**fair, "dtypes": {"main": "float32", "draft": "bfloat16"}}
    assert "**unfair baseline (main fp32, draft bf16)**" in "\n".join(report.gateway_section(unfair))


def test_gateway_load_records_both_sides_precision(tmp_path: Path) -> None:
    """vLLM's main model as the server it started logs it, the draft as the gateway resolves --dtype."""
    from types import SimpleNamespace

    from benchmarks.lib.machine import resolved_dtype
    from benchmarks.suites import gateway_load

    log = tmp_path / "vllm.log"
    log.write_text("INFO ... Initializing a V1 LLM engine (v0.32.0) with config: model='m', dtype=torch.bfloat16, x\n")
    args = gateway_load.parse_args(["--dtype", "bfloat16"])
    assert gateway_load.served_dtypes(args, SimpleNamespace(log_path=log, dtype="float32")) == \
        {"draft": "bfloat16", "main": "bfloat16"}  # what vLLM ran, not what it was asked
    args = gateway_load.parse_args([])
    assert gateway_load.served_dtypes(args, SimpleNamespace(log_path=None, dtype="float32"))["main"] == "float32"
    assert gateway_load.served_dtypes(args, None) == {"draft": resolved_dtype("auto")}  # --vllm-url: unknown
    args = gateway_load.parse_args(["--vllm-url", "http://h:1", "--server-dtype", "bf16"])
    assert gateway_load.served_dtypes(args, None)["main"] == "bfloat16"
