"""``bench tool_rag``: the agent loop over a retriever tool (issue 50's evaluation), on the tiny
engine whose main model writes a call and then the answer (a scripted backend; the draft scores
for real): the tool results reach the prompt as documents, pruned per mode, and the summary
reports F1 retention, valid calls and the reading turn's TTFT."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from benchmarks.lib import machine
from benchmarks.lib.datasets import Example
from benchmarks.suites import tool_rag
from specprefill_rag import (
    DraftConfig,
    GenerationConfig,
    SelectionConfig,
    SpecPrefillConfig,
    SpecPrefillEngine,
    testing,
)

PARAGRAPHS = [("Sky", "Sky\nThe sky is blue over the station. " * 3), ("Fox", "Fox\nThe quick brown fox jumps. " * 3),
              ("Key", "Key\nThe passkey is 48213 and it opens the door. " * 3)]
EXAMPLE = Example("hotpotqa", "ex1", "What is the passkey?", tuple(PARAGRAPHS), ("48213",))
OTHER = Example("hotpotqa", "ex2", "Who?", (("Dog", "Dog\nThe lazy dog sleeps all day long. " * 3),), ("dog",))
CALL = '<tool_call>\n{"name": "search", "arguments": {"query": "passkey"}}\n</tool_call>'


def words(texts):
    """A bag-of-letters embedding: enough for a deterministic ranking."""
    rows = [[text.lower().count(c) for c in "abcdefghijklmnopqrstuvwxyz0123456789"] for text in texts]
    return torch.nn.functional.normalize(torch.tensor(rows, dtype=torch.float32), dim=1)


@pytest.fixture
def engine() -> SpecPrefillEngine:
    """A fresh script per test: a call, then the answer to every later turn."""
    config = SpecPrefillConfig(draft=machine.cold(DraftConfig(lookahead=2)),
                               generation=GenerationConfig(max_new_tokens=100),
                               selection=SelectionConfig(min_prompt_tokens=32, chunk_size=8))
    inner = testing.tiny_engine(config, max_position_embeddings=4096, tools=True)
    return SpecPrefillEngine(testing.ScriptedBackend(inner.backend, CALL, "48213"), inner.draft, inner.config)


def args(**changes: object) -> argparse.Namespace:
    return argparse.Namespace(**{"keep_rates": [0.1, 0.3], "max_steps": 3, "top_k": 3, "first_choice": "auto",
                                 "answer_tools": "offered", **changes})


def test_the_retriever_ranks_own_and_padding_paragraphs():
    search = tool_rag.Retriever(EXAMPLE, [EXAMPLE, OTHER], pad=1, seed=0, embed=words)
    assert len(search.texts) == 4 and search.texts[3].startswith("Dog")  # its own 3, then 1 of the others'
    assert search("passkey 48213 door", 1) == [PARAGRAPHS[2][1]]


def test_one_agent_run_per_mode_shares_the_first_turn(engine):
    search = tool_rag.Retriever(EXAMPLE, [OTHER], pad=1, seed=0, embed=words)
    row = tool_rag.run_example(engine, EXAMPLE, search, args())
    assert row["first"]["calls"][0]["arguments"] == {"query": "passkey"}
    assert set(row["modes"]) == {"full", "keep_0.1", "keep_0.3"}
    for label, got in row["modes"].items():
        (reading,) = got["steps"]  # the call, then the answer that read the documents
        assert got["answer"] == "48213" and got["f1"] == 1.0 and got["valid"] and got["called"]
        assert got["reading_ttft_s"] == reading["ttft_s"] > 0
        assert reading["prompt_tokens"] > row["first"]["prompt_tokens"] + 40  # the documents reached the prompt
        if label == "full":
            assert reading["prefilled_tokens"] == reading["prompt_tokens"] and reading["draft_s"] is None
        else:
            assert reading["prefilled_tokens"] < reading["prompt_tokens"] and reading["draft_s"] > 0
    summary = tool_rag.summarise([row, {**row, "id": "again"}])
    assert summary["n"] == 2 and summary["called_share"][0] == 1.0
    assert summary["keep_0.1"]["f1_retention"][0] == 1.0 and summary["keep_0.1"]["valid_minus_full"] == 0.0
    assert summary["keep_0.3"]["reading_ttft_speedup_median"] > 0


def test_a_bad_call_is_recorded_as_invalid_not_raised(engine):
    broken = SpecPrefillEngine(testing.ScriptedBackend(engine.backend.inner, "<tool_call>\nsearch(passkey)"),
                               engine.draft, engine.config)
    row = tool_rag.run_example(broken, EXAMPLE, tool_rag.Retriever(EXAMPLE, [], 0, 0, words), args())
    assert "is not JSON" in row["first"]["error"] or "not closed" in row["first"]["error"]
    assert all(not m["valid"] and m["answer"] == "" and m["steps"] == [] for m in row["modes"].values())
    json.dumps(row)  # a row is one JSON line


def test_the_answer_turn_can_be_offered_no_tools(engine):
    search = tool_rag.Retriever(EXAMPLE, [OTHER], pad=1, seed=0, embed=words)
    withheld = tool_rag.run_example(engine, EXAMPLE, search, args(keep_rates=[], answer_tools="withheld"))
    engine.backend.texts = [CALL, "48213"]  # the script again
    offered = tool_rag.run_example(engine, EXAMPLE, search, args(keep_rates=[]))["modes"]["full"]["steps"][0]
    (reading,) = withheld["modes"]["full"]["steps"]
    assert withheld["first"]["calls"] and withheld["modes"]["full"]["answer"] == "48213"
    assert reading["prompt_tokens"] < offered["prompt_tokens"]  # the tool schema is not in the prompt


SENTENCE = "The passkey is 48213 and it opens the door."
WITH_EVIDENCE = Example("hotpotqa", "ex3", "What is the passkey?", tuple(PARAGRAPHS), ("48213",),
                        evidence=((2, 4, 4 + len(SENTENCE)),), key=((2, 4, 4 + len(SENTENCE)),), key_share=0.5)


@pytest.mark.parametrize("layout", ["plain", "tool"])
def test_the_evidence_masks_cover_the_supporting_sentence_in_either_layout(engine, layout):
    from specprefill_rag import prompt as prompt_lib

    documents = [text for _, text in PARAGRAPHS]
    prompt = (engine.assemble(WITH_EVIDENCE.question, documents) if layout == "plain" else engine.assemble(
        list(prompt_lib.message_segments(tool_rag.answer_turn(WITH_EVIDENCE, documents)))))
    (mask,) = tool_rag.evidence_masks(prompt, WITH_EVIDENCE, documents)
    assert engine.tokenizer.decode(prompt.token_ids[mask].tolist()).strip() == SENTENCE
    assert tool_rag.evidence_masks(prompt, WITH_EVIDENCE, [t + " changed" for t in documents]) == []


def test_the_evidence_proxy_scores_each_layout_without_the_main_model(engine):
    search = tool_rag.Retriever(WITH_EVIDENCE, [OTHER], pad=1, seed=0, embed=words)
    row = tool_rag.evidence_row(engine, WITH_EVIDENCE, search, args(keep_rates=[0.1, 1.0], answer_tools="withheld"))
    assert row["gold_sentences"] == 1 and set(row["layouts"]) == set(tool_rag.LAYOUTS)
    for layout in tool_rag.LAYOUTS:
        assert row["layouts"][layout]["1"] == [1.0, 1]  # everything kept: every sentence kept
        assert 0.0 <= row["layouts"][layout]["0.1"][0] <= 1.0
    assert engine.backend.texts == [CALL, "48213"]  # the main model never ran
    summary = tool_rag.summarise_evidence([row, {**row, "id": "again"}, {**row, "id": "none", "gold_sentences": 0}])
    assert summary["n"] == 2 and summary["tool_echo@1"]["complete"][0] == 1.0
    assert summary["tool_echo@1"]["complete_minus_tool"][0] == 0.0 and summary["plain@1"]["complete_minus_tool_echo"]
    assert not any(key.startswith("complete_minus") for key in summary["tool@1"])
