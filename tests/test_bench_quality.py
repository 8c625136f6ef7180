"""``bench quality``: the answer metrics, the summary, a tiny-model smoke run, and resuming a
results file (rows kept, refused, reused from another file; one pair of dtypes per file)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import HAS_LINGUA, needs_data

from benchmarks import report
from benchmarks.suites import quality


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


def test_summarize_reports_retention_and_deltas_to_llmlingua_and_position_mode() -> None:
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

    summary = quality.summarize([row("full", None, 0.8), row("specprefill", 0.1, 0.6), row("llmlingua", 0.1, 0.4),
                                 row("text", 0.1, 0.5), row("text", 0.3, 0.7)])
    by = {(e["method"], e["keep_rate"]): e for e in summary}
    spec, text = by[("specprefill", 0.1)], by[("text", 0.1)]
    assert spec["retention_vs_full"] == pytest.approx(0.75)
    assert spec["vs_llmlingua"] == pytest.approx(0.2)
    assert spec["prefilled_ratio"] == pytest.approx(0.1)
    assert spec["vs_specprefill"] is None and by[("llmlingua", 0.1)]["vs_llmlingua"] is None
    # Text mode is compared with position mode at the same keep rate only.
    assert text["vs_specprefill"] == pytest.approx(-0.1) and text["vs_llmlingua"] == pytest.approx(0.1)
    assert by[("text", 0.3)]["vs_specprefill"] is None


@needs_data
def test_quality_bench_tiny_smoke(tmp_path: Path) -> None:
    out = tmp_path / "quality.json"
    methods = ["specprefill", "reference", "contiguous", "random", "text", "ragcompress"] + (
        ["llmlingua"] if HAS_LINGUA else [])
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
    text = next(r for r in data["rows"] if r["method"] == "text")  # the compressed text, prefilled whole
    assert text["kept_context_tokens"] < text["prefilled"] < text["n_prompt"] and text["compress_s"] > 0
    # ragcompress: its kept sentences under the budget LongLLMLingua gets, prefilled whole.
    peer = next(r for r in data["rows"] if r["method"] == "ragcompress")
    assert peer["budget_tokens"] == spec["prefilled"] - (spec["n_prompt"] - spec["n_context"])
    assert peer["prefilled"] < peer["n_prompt"] and peer["compress_s"] > 0
    assert data["models"]["ragcompress_scorer"].startswith("draft")


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


def test_quality_merged_plan_keeps_what_earlier_runs_measured() -> None:
    before = {"command": "a", "counts": {"hotpotqa_4k": 60}, "models": {"draft": "d", "llmlingua_scorer": "draft"}}
    payload = {"command": "b", "counts": {"needle_8k": 30}, "models": {"draft": "d", "llmlingua_scorer": None}}
    merged = quality.merged_plan(payload, before)
    assert merged["commands"] == ["a", "b"] and merged["counts"] == {"hotpotqa_4k": 60, "needle_8k": 30}
    assert merged["models"] == {"draft": "d", "llmlingua_scorer": "draft"}  # its rows are still in the file
    later = quality.merged_plan({**payload, "models": {"draft": "d", "llmlingua_scorer": None}}, {
        **before, "models": {"draft": "d", "ragcompress_scorer": "draft (AttentionScorer, eager copy)"}})
    assert later["models"] == {"draft": "d", "llmlingua_scorer": None,
                               "ragcompress_scorer": "draft (AttentionScorer, eager copy)"}
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


def test_the_ragcompress_peer_keeps_whole_sentences_per_passage_under_its_budget() -> None:
    """The peer's answer per passage: its kept sentences, verbatim and in order, the passage's own
    id, passages with nothing kept left out, and no more tokens than the budget."""
    pytest.importorskip("ragcompress")
    from benchmarks.lib.ragcompress_peer import RagCompressPeer
    from specprefill_rag import testing

    engine = testing.tiny_engine()
    assert engine.draft is not None
    peer = RagCompressPeer(engine.draft.model, engine.draft.tokenizer)
    passages = [("p1", "The sky is blue. The passkey is 48213. Dogs bark loudly at night."),
                ("p1", "Cats sleep all day. The fox jumps over the dog."),  # ids need not be unique
                ("p3", "Nothing else matters here. The river runs north.")]
    everything, seconds = peer.compress(passages, "What is the passkey?", 10_000)
    assert everything == passages and seconds > 0
    kept, _ = peer.compress(passages, "What is the passkey?", 12)
    assert 0 < sum(peer.count(text) for _, text in kept) <= 12
    for pid, text in kept:  # whole sentences of a passage with that id
        sentences = [x.strip() for x in re.findall(r"[^.]+\.", text)]
        assert sentences and any(all(x in t for x in sentences) for p, t in passages if p == pid)
    assert engine.draft.model.config._attn_implementation != "eager"  # the draft itself is untouched


@needs_data
def test_the_examples_alternate_tasks_and_needle_lengths() -> None:
    """An interrupted run covers every task and, within the needle, every length: the examples come
    round-robin over both (resuming matches rows by id, so the order may change between runs)."""
    args = quality.parse_args(["--tasks", "needle", "squad", "--n-squad", "2", "--needle-lengths", "256", "512",
                               "--needle-depths", "0.25", "0.75"])
    examples = quality.examples_for(args, lambda text: len(text.split()))
    assert [ex.task for ex in examples] == ["squad", "needle", "squad", "needle", "needle", "needle"]
    assert [ex.id for ex in examples if ex.task == "needle"] == [
        "needle-256-0.25", "needle-512-0.25", "needle-256-0.75", "needle-512-0.75"]
