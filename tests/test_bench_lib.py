"""What the suites share (``benchmarks/lib/``): result names, bootstrap intervals, and every
suite importable as a module."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_result_names_keep_other_configurations_apart() -> None:
    from benchmarks.lib.results import result_name

    assert result_name("ttft") == "ttft"
    assert result_name("ttft", backends=["vllm_server"]) == "ttft_vllm_server"
    assert result_name("ttft", backends=["transformers", "vllm_server"]) == "ttft_transformers-vllm_server"
    assert result_name("quality", draft="smollm2-135m-instruct") == "quality_draft-smollm2-135m-instruct"
    assert result_name("quality", quick=True, main="/m/My Model.gguf") == "quality_quick_main-my-model"
    assert result_name("quality", draft="x", tiny=True) == "quality_tiny"


def test_bootstrap_ci_brackets_the_mean_and_narrows_with_n() -> None:
    from benchmarks.lib.metrics import bootstrap_ci, paired_ratio_ci

    small = bootstrap_ci([1.0, 0.0] * 5)
    large = bootstrap_ci([1.0, 0.0] * 200)
    assert small[0] == large[0] == pytest.approx(0.5)
    assert small[1] < 0.5 < small[2] and large[1] < 0.5 < large[2]
    assert (large[2] - large[1]) < (small[2] - small[1]) / 3
    assert bootstrap_ci([0.7]) == (0.7, 0.7, 0.7)
    ratio, lo, hi = paired_ratio_ci([1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0])
    assert ratio == pytest.approx(0.75) and lo <= 0.75 <= hi <= 1.0
    assert paired_ratio_ci([1.0], [0.0])[0] is None


def test_share_ci_gives_the_exact_bound_where_every_example_scored_the_same() -> None:
    from benchmarks.lib.metrics import bootstrap_ci, share_ci

    assert bootstrap_ci([1.0] * 27)[1:] == (1.0, 1.0)  # the degenerate interval share_ci replaces
    mean, lo, hi = share_ci([1.0] * 27)
    assert mean == 1.0 and hi == 1.0 and lo == pytest.approx(0.8723, abs=1e-4)  # Clopper-Pearson, 27 of 27
    assert share_ci([1.0] * 10)[1] == pytest.approx(0.6915, abs=1e-4)
    assert share_ci([0.0] * 10) == pytest.approx((0.0, 0.0, 1 - 0.6915), abs=1e-4)
    mixed = [1.0] * 26 + [0.0]
    assert share_ci(mixed) == bootstrap_ci(mixed)  # otherwise the bootstrap, unchanged
    assert share_ci([1.0]) == (1.0, 1.0, 1.0)


def test_paired_ratio_ci_of_shares_is_not_degenerate_where_every_pair_agrees() -> None:
    from benchmarks.lib.metrics import paired_ratio_ci

    assert paired_ratio_ci([1.0] * 30, [1.0] * 30)[1:] == (1.0, 1.0)  # what shares=True replaces
    ratio, lo, hi = paired_ratio_ci([1.0] * 30, [1.0] * 30, shares=True)
    assert ratio == 1.0 and lo == pytest.approx(0.8843, abs=1e-4) and hi == pytest.approx(1.1157, abs=1e-4)
    ratio, lo, hi = paired_ratio_ci([0.0] * 4, [1.0, 0.0, 1.0, 0.0], shares=True)  # none kept: 0 of 4
    assert ratio == 0.0 and lo == 0.0 and hi == pytest.approx((1 - 0.025 ** 0.25) / 0.5, abs=1e-4)
    differ = [1.0, 0.0, 1.0, 1.0]
    assert paired_ratio_ci(differ, [1.0] * 4, shares=True) == paired_ratio_ci(differ, [1.0] * 4)


def test_every_bench_suite_runs_as_a_module() -> None:
    """``python -m benchmarks.suites.NAME``: every suite with a ``__main__`` block imports as a
    module of the package (no path set up by hand) and has the ``main`` that block calls."""
    import importlib

    folder = Path(__file__).resolve().parents[1] / "benchmarks" / "suites"
    suites = [path.stem for path in sorted(folder.glob("*.py")) if 'if __name__ == "__main__":' in path.read_text()]
    assert "ttft" in suites and "gpu_ttft" in suites
    for name in suites:
        assert callable(importlib.import_module(f"benchmarks.suites.{name}").main), name
