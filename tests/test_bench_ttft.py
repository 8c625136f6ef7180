"""``bench ttft``: a tiny-model smoke run, the memory child, the plain draft forward, the
precisions a file records, and every repeated request scored whole."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pytest
import torch
from helpers import needs_data

from benchmarks import report
from benchmarks.suites import quality


@pytest.mark.full
@needs_data
def test_ttft_bench_tiny_smoke(tmp_path: Path) -> None:
    from benchmarks.suites import ttft

    out = tmp_path / "ttft.json"
    assert (
        ttft.main(
            [
                "--tiny",
                "--lengths",
                "192",
                "--keep-rates",
                "0.3",
                "--reps",
                "1",
                "--no-memory",
                "--backend",
                "transformers",
                "vllm_server",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    ok, server = data["runs"]
    (row,) = ok["lengths"]
    (cell,) = row["cells"]
    # The ideal uses what was prefilled: the context keep rate plus the protected tokens.
    assert cell["keep_ratio"] > 0.3 and cell["ideal"] == pytest.approx(1 / (row["r"] + cell["keep_ratio"]))
    assert cell["efficiency"] == pytest.approx(cell["speedup"] / cell["ideal"])
    assert server["status"] == "skipped" and server["reason"]  # no --server-url: said so, not crashed
    # Each run records the dtypes its models ran in, and the report's settings line names them.
    assert ok["dtypes"] == {"main": "float32", "draft": "float32"}
    assert "draft fp32, main fp32 on cpu" in "\n".join(report.ttft_section(data, "TTFT"))
    old = {**data, "runs": [{k: v for k, v in ok.items() if k != "dtypes"}], "settings": {"dtype": "float32"}}
    assert ", fp32 on None" in "\n".join(report.ttft_section(old, "TTFT"))  # files from before the record
    # The file records what the report needs to tell a fair baseline: the machine's best precision.
    from benchmarks.lib.machine import best_dtype
    from specprefill_rag.loading import cpu_runs_bf16

    assert data["settings"]["best_dtype"] == best_dtype("cpu") and data["settings"]["dtype_asked"] == "auto"
    assert data["machine"]["cpu_native_bf16"] is cpu_runs_bf16()
    pinned = report.HeadlineRow(out.name, row["n_tokens"], 0.3)  # a headline row naming this file's cell
    for best, headlined in (("float32", True), ("bfloat16", False)):  # the tiny models run in fp32
        out.write_text(json.dumps({**data, "settings": {**data["settings"], "best_dtype": best}}))
        if headlined:
            assert "both fp32 (`ttft.json`)" in report.headline_table(tmp_path, [pinned])[2]
        else:
            with pytest.raises(ValueError, match="unfair baseline"):
                report.headline_table(tmp_path, [pinned])
    out.write_text(json.dumps(data))
    # --memory-only re-measures memory into the same file and leaves the runs alone.
    assert ttft.main(["--tiny", "--lengths", "192", "--memory-only", "--out", str(out)]) == 0
    again = json.loads(out.read_text())
    assert again["runs"] == data["runs"] and again["created_utc"] == data["created_utc"]
    assert again["memory"]["peak_ratio"] > 0 and "--memory-only" in again["memory_command"]


@needs_data
def test_ttft_memory_child_measures_a_peak() -> None:
    from benchmarks.lib import peak_memory
    from benchmarks.suites import ttft

    row = ttft.memory_child("score", "unused", 128, tiny=True, device="cpu")
    assert row["peak_bytes"] >= row["baseline_bytes"] > 0
    assert row["source"] == ("heap" if peak_memory.heap_reader() else "rss") and row["rss_peak_bytes"] > 0


def test_peak_memory_sees_a_short_lived_tensor() -> None:
    from benchmarks.lib import peak_memory

    if peak_memory.heap_reader() is None:
        pytest.skip("no glibc mallinfo2 here: the CPU memory figure falls back to RSS")
    size = 64 * 2**20
    with peak_memory.PeakMemory() as mem:
        block = torch.ones(size // 4)
        time.sleep(0.05)
        del block
    assert mem.heap_peak - mem.heap_baseline >= size


def test_ttft_plain_draft_forward_reads_the_drafts_own_tokens() -> None:
    from benchmarks.suites import ttft
    from specprefill_rag import testing

    engine = testing.tiny_engine(cross_family=True)
    prompt = engine.assemble("what is the passkey?", ["The passkey is 48213. " * 8])
    ids = ttft.draft_token_ids(engine, prompt)
    assert engine.maps_tokens and ids.numel() != prompt.n_tokens
    assert int(ids.max()) < engine.draft.model.config.vocab_size
    assert ttft.plain_forward_s(engine.draft.model, ids) > 0
    same = testing.tiny_engine()
    assert torch.equal(ttft.draft_token_ids(same, prompt), prompt.token_ids)


def test_ttft_records_a_served_main_models_precision_only_when_known() -> None:
    """The vllm_server backend's main model has no weights here: its dtype is what --server-dtype
    says the server runs (vLLM does not report it), else unrecorded (and never headlined)."""
    from types import SimpleNamespace

    from benchmarks.suites import ttft

    draft = SimpleNamespace(model=torch.nn.Linear(2, 2).to(torch.bfloat16))
    served = SimpleNamespace(backend=SimpleNamespace(), draft=draft)
    args = ttft.parse_args(["--backend", "vllm_server", "--server-url", "http://h:1", "--server-dtype", "bf16"])
    assert ttft.run_dtypes(served, "vllm_server", args) == {"draft": "bfloat16", "main": "bfloat16"}
    args = ttft.parse_args(["--backend", "vllm_server", "--server-url", "http://h:1"])
    assert ttft.run_dtypes(served, "vllm_server", args) == {"draft": "bfloat16"}
    local = SimpleNamespace(backend=SimpleNamespace(model=torch.nn.Linear(2, 2)), draft=draft)
    assert ttft.run_dtypes(local, "transformers", args) == {"main": "float32", "draft": "bfloat16"}


def test_benchmarks_that_repeat_a_prompt_score_every_request() -> None:
    """TTFT repetitions and keep rates send the same prompt again: with the engine's score memo
    on they would time a memo hit, so the benchmarks' engines keep no memo and no prefix store."""
    from benchmarks.suites import ttft
    from specprefill_rag import DraftConfig
    from specprefill_rag.testing import tiny_engine

    drafts = [ttft.build_draft_config(argparse.Namespace(lookahead=None)),
              ttft.build_draft_config(argparse.Namespace(lookahead=4)),
              ttft.with_draft_config(tiny_engine(), DraftConfig(lookahead=3)).config.draft]
    engine = quality.build_engine(argparse.Namespace(tiny=True, main="m", draft="d", lookahead=None, max_new_tokens=4))
    drafts.append(engine.config.draft)
    assert all(d.memo_entries == 0 and d.prefix_cache_entries == 0 for d in drafts)
    assert engine.config.draft.lookahead == DraftConfig().lookahead
