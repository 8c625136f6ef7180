"""``bench evidence``: evidence spans, variant scores equal to the draft's, a smoke run that
resumes, pairing against another file, re-evaluation from the cache, prompts read in windows,
resumes refused or repaired."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from helpers import needs_data, words

from benchmarks.suites import quality


@needs_data
def test_evidence_spans_cover_the_gold_text(tokenizer) -> None:
    from benchmarks.suites import evidence
    from specprefill_rag import Passage
    from specprefill_rag.prompt import assemble, build_segments

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
    from specprefill_rag.prompt import assemble, build_segments
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
    from specprefill_rag.prompt import assemble, build_segments
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


@pytest.mark.full
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
