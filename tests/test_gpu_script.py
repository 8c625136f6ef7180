"""``benchmarks/suites/gpu_ttft.py`` as a dry run on the CPU: the results file a GPU run will write.

The GPU run is one call of a lent machine with a few minutes on it, so the script must not fail
there for want of a key: both pairs, every length, every phase, the precision of both models,
``DraftConfig()`` as it stands, the checks and the profiler's tables are all written by the tiny
run (``--tiny``: tiny shapes on the CPU, seconds), and a length that does not fit the memory or
the time budget is skipped and named.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from benchmarks.suites import gpu_ttft
from specprefill_rag import DraftConfig

PHASES = {"draft_prefill_s", "lookahead_s", "scoring_s", "draft_other_s", "draft_s", "selection_s",
          "pruned_prefill_s", "full_prefill_s"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu") / "gpu_ttft_tiny.json"
    assert gpu_ttft.main(["--tiny", "--profile", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_both_pairs_every_length_every_phase(tiny_run):
    data = tiny_run
    assert data["complete"] and data["tiny"] and data["errors"] == []
    assert [run["pair"] for run in data["runs"]] == ["llama-1b-8b", "qwen-0.5b-32b"]
    assert data["settings"]["lengths"] == [256, 512] and data["settings"]["keep_rates"] == [0.1]
    for run in data["runs"]:
        assert run["status"] == "ok" and run["skipped_lengths"] == []
        assert [row["n_tokens"] for row in run["lengths"]] == [256, 512]
        for row in run["lengths"]:
            (cell,) = row["cells"]
            assert cell["keep_rate"] == 0.1 and cell["speedup"] > 0 and cell["efficiency"] > 0
            phases = cell["phases"]
            assert set(phases) == PHASES and all(v is not None and v >= 0 for v in phases.values()), phases
            # The draft's own steps add up to its time; SpecPrefill's TTFT is the three stages.
            steps = sum(phases[k] for k in ("draft_prefill_s", "lookahead_s", "scoring_s", "draft_other_s"))
            assert steps == pytest.approx(phases["draft_s"], rel=0.05, abs=2e-3)
            assert cell["ttft_spec_s"] == pytest.approx(cell["draft_s"] + cell["selection_s"] + cell["prefill_s"],
                                                        rel=0.05)
            assert cell["speedup"] == pytest.approx(cell["ttft_full_s"] / cell["ttft_spec_s"])
            assert 0 < cell["n_kept"] < row["n_tokens"]


def test_precision_versions_and_the_draft_config_are_recorded(tiny_run):
    data = tiny_run
    assert data["settings"]["draft_config"] == dataclasses.asdict(DraftConfig())  # whatever it is today
    assert data["settings"]["draft_config_timed"]["memo_entries"] == 0  # nothing reused between repetitions
    assert {"torch", "transformers", "python", "cuda"} <= set(data["machine"])
    for run in data["runs"]:
        dtype = data["settings"]["dtype"]
        assert run["dtypes"] == {"main": dtype, "draft": dtype}  # one precision for both models
        assert run["precision"]["main_weights"] == run["precision"]["draft_weights"] == dtype
        assert run["precision"]["main_kv_cache"] == dtype and run["precision"]["attention"] == "sdpa"


def test_checks_and_profile_tables(tiny_run):
    for run in tiny_run["runs"]:
        check = run["checks"]["mask_free_vs_ones_mask"]
        assert check["mask_free"] and check["same_first_token"] and check["max_abs_logit_diff"] == 0.0
        assert run["checks"]["host_syncs"]["pruned_prefill_without_first_token"]["count"] is None  # CUDA only
        profile = run["profile"]
        assert profile["n_tokens"] == 512  # the measured length nearest 4k
        for name in ("pruned_prefill", "draft_scoring", "plain_draft_forward"):
            table = profile[name]
            assert {"wall_s", "gpu_busy_s", "kernels", "launches", "host_time_outside_ops_s", "top_ops_by_device_time",
                    "top_ops_by_launches", "top_ops_by_host_time", "top_kernels", "host_syncs",
                    "host_sync_causes"} <= set(table)
            assert table["wall_s"] > 0 and table["top_ops_by_host_time"]
        # The first token's int() is the pruned prefill's one scalar read.
        assert profile["pruned_prefill"]["host_sync_causes"]["aten::_local_scalar_dense"]["count"] == 1


def test_the_first_pair_keeps_the_earlier_runs_tables(tiny_run):
    first = tiny_run["runs"][0]["lengths"][0]
    assert first["lookahead_scoring"] and first["cells_compared"]
    assert tiny_run["attention"] and tiny_run["concurrency"]["batch"] == 8
    assert "lookahead_scoring" in tiny_run["runs"][1]["lengths"][0] and not tiny_run["runs"][1]["lengths"][0][
        "cells_compared"]


def test_the_warm_cells_read_each_passage_once_then_serve_it_from_the_stores(tiny_run):
    """Per length of both pairs: the first request reads every passage apart, the same request
    again finds them all in the passage store, a follow-up finds its prompt up to its question in
    the prefix store; each case's TTFT is its three stages, its speedup and r over the full
    prefill of the same prompt."""
    from benchmarks.lib import warm_ttft

    assert tiny_run["settings"]["warm"] and tiny_run["targets"]["warm_speedup_at_4k"] == 4.0
    for run in tiny_run["runs"]:
        for row in run["lengths"]:
            warm = row["warm"]
            assert warm["reads_apart"] and row["n_tokens"] - 16 <= warm["n_tokens"] <= row["n_tokens"]
            assert warm["passages"] >= 3
            assert warm["reading"]["recompute"] and warm["store_bytes_per_token"] > 0
            (cell,) = warm["cells"]
            cold, hot, follow = (cell[case] for case in warm_ttft.CASES)
            assert (cold["passages_read"], cold["passages_cached"]) == (warm["passages"], 0)
            assert (hot["passages_cached"], hot["passages_read"], hot["cached_tokens"]) == (warm["passages"], 0, 0)
            assert follow["passages_cached"] == follow["passages_read"] == 0
            assert follow["cached_tokens"] > warm["passage_tokens"]  # everything up to the question
            for case in warm_ttft.CASES:
                c = cell[case]
                assert c["speedup"] == pytest.approx(cell["ttft_full_s"] / c["ttft_s"])
                assert c["r"] == pytest.approx(c["draft_s"] / cell["ttft_full_s"])
                assert c["ttft_s"] == pytest.approx(c["draft_s"] + c["selection_s"] + c["prefill_s"], rel=0.05)
                assert 0 < c["keep_ratio"] < 1


def test_the_warm_prompts_fill_the_length_with_shared_passages():
    from benchmarks.lib import warm_ttft
    from specprefill_rag.types import SegmentKind

    for n in (256, 4096):
        asked, other = warm_ttft.rag_prompts(n, seed=n)
        assert n - 16 <= asked.n_tokens <= n and other.n_tokens <= n
        passages = [s.text for s in asked.segments if s.kind is SegmentKind.PASSAGE]
        assert passages == [s.text for s in other.segments if s.kind is SegmentKind.PASSAGE] and len(passages) >= 3
        assert asked.segments[-1].text != other.segments[-1].text  # another question
    # Below the head's own length: the shortest prompt (one passage of one word), not a hang.
    asked, _ = warm_ttft.rag_prompts(8, seed=8)
    passages = [s.text for s in asked.segments if s.kind is SegmentKind.PASSAGE]
    assert asked.n_tokens > 8 and len(passages) == 1 and " " not in passages[0]
    assert max(warm_ttft.tokenizer().get_vocab().values()) < gpu_ttft.TINY_DRAFT["vocab_size"]


def test_a_length_out_of_memory_is_skipped_and_named(tmp_path: Path, monkeypatch):
    run_length = gpu_ttft.run_length

    def tight(ctx, target, args, extras):
        if target >= 512:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
        return run_length(ctx, target, args, extras)

    monkeypatch.setattr(gpu_ttft, "run_length", tight)
    out = tmp_path / "oom.json"
    assert gpu_ttft.main(["--tiny", "--pairs", "qwen-0.5b-32b", "--lengths", "128", "512", "1024",
                          "--out", str(out)]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run["status"] == "ok" and [row["n_tokens"] for row in run["lengths"]] == [128]
    assert [s["n_tokens"] for s in run["skipped_lengths"]] == [512, 1024]
    assert all(s["why"].startswith("out of GPU memory") for s in run["skipped_lengths"])


def test_a_pair_past_the_time_budget_is_skipped_with_the_reason(tmp_path: Path):
    out = tmp_path / "late.json"
    assert gpu_ttft.main(["--tiny", "--pairs", "qwen-0.5b-32b", "--time-budget-s", "0", "--out", str(out)]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run["status"] == "skipped" and run["lengths"] == [] and "time budget" in run["reason"]
    assert [s["n_tokens"] for s in run["skipped_lengths"]] == [256, 512]


@pytest.mark.full
def test_a_length_is_capped_by_the_window_and_says_so(tmp_path: Path):
    """The Qwen pair's window is 32,768: its "32k" prompt leaves room for the look-ahead and the
    answer; the row keeps the length asked for beside the one measured."""
    out = tmp_path / "capped.json"
    window = gpu_ttft.TINY_DRAFT["max_position_embeddings"]
    assert gpu_ttft.main(["--tiny", "--pairs", "qwen-0.5b-32b", "--lengths", str(window), "--no-extras",
                          "--no-warm", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["runs"][0]["lengths"]
    assert row["target_tokens"] == window and row["n_tokens"] == window - gpu_ttft.HEADROOM
    assert "warm" not in row  # --no-warm


def test_the_phase_marks_leave_the_draft_as_it_was(tokenizer):
    from helpers import make_model

    from benchmarks.lib import gpu_timing
    from specprefill_rag.draft import DraftModel

    draft = DraftModel(make_model("llama", len(tokenizer), layers=4), tokenizer)
    clock = gpu_timing.Clock(torch.device("cpu"))
    with gpu_timing.draft_phases(draft, clock):
        draft.score(torch.randint(0, len(tokenizer), (200,)), question=torch.arange(180, 200))
    assert set(clock.marks) == {"prompt_start", "prompt_end", "scoring_start", "scoring_end"}
    assert "_prompt_forward" not in vars(draft) and "_scores" not in vars(draft)
    assert clock.seconds("prompt_start", "prompt_end") > 0 and clock.seconds("prompt_end", "nope") is None


def test_runtime_call_names_match_with_or_without_cupti_suffixes():
    """The profile tables find launches and waits under the names CUPTI versions give them."""
    from benchmarks.lib import gpu_profile

    for name in ("cudaLaunchKernel", "cudaLaunchKernel_v7000", "cudaLaunchKernelExC_v11060", "cudaLaunchKernel_ptsz"):
        assert gpu_profile.runtime_name(name) in gpu_profile.LAUNCHES
    assert gpu_profile.runtime_name("cudaStreamSynchronize_v3020") in gpu_profile.SYNC_CALLS
    assert gpu_profile.runtime_name("cudaMemcpyAsync_ptsz") == "cudaMemcpyAsync"
    assert gpu_profile.runtime_name("aten::_local_scalar_dense") == "aten::_local_scalar_dense"


def test_a_failed_measurement_beside_the_tables_is_recorded_on_a_gpu_run_and_raised_in_a_dry_run():
    import argparse

    def broken() -> None:
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")

    payload: dict = {"errors": [], "settings": {"device": "cpu"}}
    assert gpu_ttft.guarded("profile", broken, argparse.Namespace(tiny=False), payload) is None
    assert payload["errors"] == [{"what": "profile", "error": "RuntimeError: CUPTI_ERROR_NOT_INITIALIZED"}]
    with pytest.raises(RuntimeError):
        gpu_ttft.guarded("profile", broken, argparse.Namespace(tiny=True), payload)
    assert gpu_ttft.guarded("x", lambda: 3, argparse.Namespace(tiny=False), payload) == 3
