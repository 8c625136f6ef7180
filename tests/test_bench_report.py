"""``bench report``: the page and plots rendered from results files, the evidence and length
sections, and the headline: the pinned rows, only a speedup over the main model at its best, the
same table in the README as the current result files give."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import report
from benchmarks.suites import quality


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
    # The quality table shows bootstrap CIs: accuracy 0.50 over examples a (1) and b (0).
    assert "| needle | SpecPrefill | 30% | 2 | accuracy | 0.50 [0.00, 1.00] |" in text
    # None of the pinned headline files is here: the page says so, and pastes no notes.
    assert "## Headline\n\nNot measured yet" in text and "Notes on these runs" not in text
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
    assert "## Other drafts" in text and "quality_long_bf16" not in text[text.index("## Other drafts"):
                                                                         text.index("## Answer quality at length")]
    for image in ("bench_quality.png", "bench_evidence.png"):
        assert (tmp_path / "images" / image).stat().st_size > 0
        assert f"images/{image}" in text


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
        tmp_path: Path, data: dict[str, object], label: str | None) -> None:
    (run,) = data["runs"]  # type: ignore[misc]
    assert report.unfair_baseline(data, run) == label
    (tmp_path / "ttft_x.json").write_text(json.dumps(data))
    row = report.HeadlineRow("ttft_x.json", 2048, 0.1)
    section = "\n".join(report.ttft_section(data, "TTFT"))
    assert "| 2048 | 10% | 10.0 s | 4.00 s | **2.50×** |" in section  # shown either way
    if label is None:
        (line,) = report.headline_table(tmp_path, [row])[2:]
        assert "d → m" in line and "| 2,048 | 10% | **2.50×** (" in line
        assert "Not headlined" not in section
    else:
        with pytest.raises(ValueError, match="a headline shows only a speedup over the main model"):
            report.headline_table(tmp_path, [row])  # a pinned row naming it fails loudly
        assert f"### Backend `transformers` — {label}" in section
        assert f"**Not headlined: {label}** ([fair baselines](#fair-baselines))" in section  # the rule: once, above
        assert "### Fair baselines" in "\n".join(report.HEADER) and "#fair-baselines" not in "\n".join(report.HEADER)


def _quality_file(task: str, scores: list[tuple[float, float]], keep: float = 0.1) -> dict[str, object]:
    """A quality result file: per example (full prompt's F1, SpecPrefill's F1 at ``keep``)."""
    rows = []
    for i, (full, spec) in enumerate(scores):
        for method, keep_rate, f1 in (("full", None, full), ("specprefill", keep, spec)):
            rows.append({"task": task, "id": f"q{i}", "method": method, "keep_rate": keep_rate, "f1": f1,
                         "prefilled": 100, "n_prompt": 1000 + i, "prediction": "x", "answers": ["y"]})
    return {"models": {"main": "m", "draft": "d"}, "machine": {}, "settings": {"seed": 0},
            "summary": quality.summarize(rows), "rows": rows}


FAIR = {"settings": {"best_dtype": "bfloat16"}, "machine": {"cpu_native_bf16": True, "cpu_count": 2}}


def test_the_headline_table_is_exactly_the_pinned_rows_with_the_files_numbers(tmp_path: Path) -> None:
    fair = _ttft_file(BF16, **FAIR)  # type: ignore[arg-type]
    (cell,) = fair["runs"][0]["lengths"][0]["cells"]  # type: ignore[index]
    (tmp_path / "ttft_x.json").write_text(json.dumps(fair))
    quality_file = _quality_file("hotpotqa_4k", [(1.0, 1.0), (0.5, 0.4), (0.8, 0.8)])
    (tmp_path / "quality_x.json").write_text(json.dumps(quality_file))
    (spec,) = [e for e in quality.summarize(quality_file["rows"])  # type: ignore[arg-type]
               if e["method"] == "specprefill"]
    rows = [report.HeadlineRow("ttft_x.json", 2048, 0.1, "quality_x.json", "hotpotqa_4k", readme=True),
            report.HeadlineRow("ttft_x.json", 2048, 0.1),
            report.HeadlineRow("ttft_absent.json", 2048, 0.1, readme=True)]  # not in results/: left out
    table = report.headline_table(tmp_path, rows)
    machine = "| 2-core CPU, d → m, both bf16 (`ttft_x.json`) | 2,048 | 10% "
    speedup = f"| **{cell['speedup']:.2f}×** ({cell['ideal']:.2f}×) |"
    retention = report._ci(spec["retention_vs_full"], spec["retention_ci"])
    assert table[2:] == [
        f"{machine}{speedup} {retention}, n=3 (hotpotqa_4k F1, ~1.0k tokens, `quality_x.json`) |",
        f"{machine}{speedup} — |",
    ]
    assert "**2.50×**" in table[2] and retention.startswith("0.96 [")
    assert report.readme_results(tmp_path, rows) == table[:3]  # the README: the rows marked for it
    # A row naming a cell, task or file that is not there fails loudly.
    for bad, match in ((report.HeadlineRow("ttft_x.json", 4096, 0.1), "no cell at 4096 tokens"),
                       (report.HeadlineRow("ttft_x.json", 2048, 0.1, "quality_x.json", "squad"), "no SpecPrefill"),
                       (report.HeadlineRow("ttft_x.json", 2048, 0.1, "nope.json", "squad"), "nope.json is not in")):
        with pytest.raises(ValueError, match=match):
            report.headline_table(tmp_path, [bad])
    with pytest.raises(ValueError, match="both a quality file and its task"):
        report.HeadlineRow("ttft_x.json", 2048, 0.1, "quality_x.json")


def test_the_rendered_page_opens_with_the_pinned_rows_and_refuses_an_unfair_one(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    results = tmp_path / "results"
    results.mkdir()
    fair = _ttft_file(BF16, settings={"best_dtype": "bfloat16"}, machine={"cpu_native_bf16": True})
    unfair = _ttft_file(MIXED, settings={"best_dtype": "bfloat16"}, machine={"cpu_native_bf16": True})
    (results / "ttft.json").write_text(json.dumps(fair))
    (results / "ttft_bf16-draft.json").write_text(json.dumps(unfair))
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{report.README_MARKERS[0]}\nold\n{report.README_MARKERS[1]}\n\nafter\n")
    rows = [report.HeadlineRow("ttft.json", 2048, 0.1, readme=True)]
    text = report.render(results, tmp_path / "benchmarks.md", tmp_path / "images", readme, rows).read_text()
    head = text[text.index("## Headline"):text.index("## How these runs are made")]
    assert head.count("**2.50×**") == 1 and "(`ttft.json`)" in head and "unfair" not in head
    assert "[findings.md](findings.md)" in head and "lab-notes.md" not in head
    assert text.index("## Headline") < text.index("## Time to first token")
    assert readme.read_text() == ("# x\n\n" + report.README_MARKERS[0] + "\n"
                                  + "\n".join(report.headline_table(results, rows)) + "\n"
                                  + report.README_MARKERS[1] + "\n\nafter\n")
    unfair_part = text[text.index("`benchmarks/results/ttft_bf16-draft.json`"):]
    assert "### Backend `transformers` — unfair baseline (main fp32, draft bf16)" in unfair_part
    assert "| 2048 | 10% | 10.0 s | 4.00 s | **2.50×** |" in unfair_part  # shown, labelled
    with pytest.raises(ValueError, match="unfair baseline"):
        report.render(results, tmp_path / "b.md", tmp_path / "images", None,
                      [report.HeadlineRow("ttft_bf16-draft.json", 2048, 0.1)])


def test_the_readme_results_table_is_what_the_current_files_give() -> None:
    """The README's table is generated (``bench report``): it equals the render of the pinned
    rows from the repository's result files, so it cannot drift from them."""
    text = report.README.read_text(encoding="utf-8")
    assert report.between_markers(text) == "\n" + "\n".join(report.readme_results(report.RESULTS_DIR)) + "\n"
    named = {name for row in report.HEADLINE_ROWS for name in (row.ttft, row.quality) if name}
    assert named <= set(report.CURRENT)  # and tests/test_layout.py: every CURRENT file is there
    assert 0 < sum(row.readme for row in report.HEADLINE_ROWS) <= 4 and len(report.HEADLINE_ROWS) <= 8


def test_the_serving_section_tables_every_rate_and_side_and_draws_p95_against_rate(tmp_path: Path) -> None:
    from benchmarks import report

    def cell(p95: float, answered: int = 4) -> dict:
        return {"requests": 4, "answered": answered, "p50_ttft_s": p95 / 2, "p95_ttft_s": p95, "p99_ttft_s": p95,
                "mean_e2e_s": p95, "answered_per_s": 0.05}

    data = {
        "benchmark": "serving", "created_utc": "2026-12-06 01:00:00", "command": "bench serving",
        "machine": {"cpu": "test"}, "models": {"main": "m", "draft": "d"},
        "dtypes": {"main": "bfloat16", "draft": "bfloat16"},
        "settings": {"requests": 4, "top_k": 8, "keep_rate": 0.1, "max_tokens": 8, "slo_multiple": 3.0},
        "summary": {"alone_ttft_s": 9.0, "alone_gateway_ttft_s": 4.0, "alone_speedup": 2.25, "slo_s": 27.0,
                    "goodput_per_s": {"direct": 0.05, "gateway": 0.1},
                    "paths": {"gateway": {"0.1": {"pruned": 3, "draft_slower": 1}}},
                    "vllm_client": {"rate": 0.1, "direct": {"p50_ttft_s": 20.0, "p95_ttft_s": 40.0, "completed": 4},
                                    "gateway": {"error": "exit 1: boom"}},
                    "per_rate": {"direct": {"0.05": cell(20.0), "0.1": cell(60.0, 3)},
                                 "gateway": {"0.05": cell(8.0), "0.1": cell(12.0)}}},
    }
    lines = report.serving_section(data, tmp_path)
    text = "\n".join(lines)
    assert (tmp_path / "bench_serving_p95.png").stat().st_size > 10_000
    rows = [line for line in lines if line.startswith("| 0.")]
    assert len(rows) == 4 and rows[1].startswith("| 0.05 | gateway (SpecPrefill) | 4/4 | 4.00 s | 8.00 s")
    assert "| 0.1 | vLLM alone (full prefill) | 3/4 |" in rows[2] and "draft_slower 1, pruned 3" in rows[3]
    assert "vLLM alone (full prefill) 0.05/s, gateway (SpecPrefill) 0.1/s" in text
    assert "9.00 s → 27.0 s" in text or "9.00 s → 27.00 s" in text
    assert "gateway: failed (exit 1: boom)" in text and "direct: p50 20.0" in text


def test_the_portable_section_sets_text_mode_beside_position_mode_and_longllmlingua(tmp_path: Path) -> None:
    """``quality_text*.json`` gets its own section: per task and keep rate the three methods'
    scores, text mode's paired differences and the issue's targets, and a compression-time table
    in which position mode's draft scoring counts once per example."""
    rows = []
    for i in range(4):
        n_prompt = 2000 if i < 2 else 1000
        rows.append({"task": "squad", "id": f"q{i}", "method": "full", "keep_rate": None, "f1": 1.0,
                     "prefilled": n_prompt, "n_prompt": n_prompt, "prediction": "x", "answers": ["x"]})
        for keep in (0.1, 0.3):
            for method, f1, extra in (("specprefill", 1.0, {"score_s": 2.0}), ("text", 1.0, {"compress_s": 3.0}),
                                      ("llmlingua", 0.0 if keep == 0.1 else 1.0, {"compress_s": 8.0})):
                rows.append({"task": "squad", "id": f"q{i}", "method": method, "keep_rate": keep, "f1": f1,
                             "prefilled": int(n_prompt * keep), "n_prompt": n_prompt, "prediction": "x",
                             "answers": ["x"], **extra})
    data = {"models": {"main": "m", "draft": "d"}, "machine": {}, "settings": {"seed": 0, "keep_rates": [0.1, 0.3],
            "max_new_tokens": 12}, "summary": quality.summarize(rows), "rows": rows}
    results = tmp_path / "results"
    results.mkdir()
    (results / "quality_text_bf16.json").write_text(json.dumps(data))
    text = report.render(results, tmp_path / "b.md", tmp_path / "img").read_text()
    part = text[text.index("## Portable mode"):]
    assert "| squad | 10% | 4 | 1.00 | 1.00 | **1.00** | 0.00 | – | " in part  # no ragcompress rows: a dash
    assert "| +0.00 [+0.00, +0.00] | +1.00 [+1.00, +1.00] | 10% / 10% / 10% / – " in part
    assert "as position ✓, ahead of LongLLMLingua ✓ |" in part
    assert "| squad | 30% | 4 |" in part and "retention ≥ 0.95 ✓ |" in part
    # Scoring counted once per example (4 calls), compress() and LongLLMLingua per keep rate (8); the
    # 2k column holds the two 2,000-token prompts: 3 s / 2k tokens = 1.50 s per 1k.
    assert "| position mode (draft scoring, once per example) | 4 | 2.00 s | 1.50 s | 2 | 2.00 s | 1.00 s |" in part
    assert "| text mode (`compress()`, per keep rate) | 8 | 3.00 s | 2.25 s | 4 | 3.00 s | 1.50 s |" in part
    assert "| LongLLMLingua (same draft LM) | 8 | 8.00 s | 6.00 s | 4 | 8.00 s | 4.00 s |" in part
    # Not also shown as another draft's run, and the LongLLMLingua line counts only its own calls.
    assert "## Other drafts" not in text
    assert "LongLLMLingua compression took 8 s per call" in part


def test_the_peer_evidence_section_tables_each_compressor_and_text_modes_paired_lead(tmp_path: Path) -> None:
    """``peer_evidence*.jsonl`` (``bench peer_evidence``) gets a table per task and keep rate: each
    compressor's answer and evidence survival, text mode's paired difference to each peer, the
    context kept and the seconds per 1k prompt tokens; a smoke run's ``_tiny`` file is skipped."""
    def row(i: int, text: float, lingua: float) -> dict[str, object]:
        return {"task": "squad", "id": str(i), "n_prompt": 2000, "results": {
            "text@0.1": [text, text, text, 0.1, 2.0], "llmlingua@0.1": [lingua, lingua, lingua, 0.2, 6.0],
            "ragcompress@0.1": [None, text, text, 0.1, 4.0]}}

    results = tmp_path / "results"
    results.mkdir()
    rows = [row(0, 1.0, 0.0), row(1, 1.0, 1.0)]
    (results / "peer_evidence_bf16.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (results / "peer_evidence_tiny.jsonl").write_text(json.dumps(row(2, 0.0, 0.0)) + "\n")
    text = report.render(results, tmp_path / "b.md", tmp_path / "img").read_text()
    part = text[text.index("## Portable mode: what each compressor keeps"):]
    assert "`benchmarks/results/peer_evidence_bf16.jsonl`" in part and "tiny" not in part
    # ragcompress's answer column is empty (None: a yes/no question), its evidence equal to text's.
    assert ("| squad | 10% | 2 | 1.00 / 0.50 / – | 1.00 [0.16, 1.00] | 0.50 [0.00, 1.00] | 1.00 [0.16, 1.00] "
            "| +0.50 [+0.00, +1.00] | +0.00 [+0.00, +0.00] | 10% / 20% / 10% | 1.00 / 3.00 / 2.00 |") in part
