"""``bench guesses`` and ``bench lookahead_cost``: the look-ahead forwards counted and timed."""

from __future__ import annotations

import copy

import pytest
import torch


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
