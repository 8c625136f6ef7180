"""The draft reads the question again where context follows it (an agent's tool results come
after the user's turn): its question queries then see the tool results, and the scores carry
back to the main prompt by segment (``prompt.echoed_question``, ``ScoringConfig.echo_question``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specprefill_rag import ConfigError, DraftConfig, SegmentKind, SpecPrefillEngine, testing
from specprefill_rag import prompt as prompt_lib
from specprefill_rag.draft.token_mapping import map_scores
from specprefill_rag.prompt import build_segments, message_segments

SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
DOCS = ["The sky is blue. The quick brown fox jumps over the lazy dog. " * 4,
        "The passkey is 48213. The sky is blue. " * 4,
        "Answer the question using the context. The fox jumps. " * 4]
QUESTION = "What is the passkey?"


def agent_chat(question: str = QUESTION) -> list[dict]:
    return [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": question},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"query": "passkey"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "\n\n".join(DOCS)},
    ]


@pytest.fixture(scope="module")
def engine() -> SpecPrefillEngine:
    return testing.tiny_engine(tools=True)


def test_the_question_is_asked_again_after_the_last_message():
    segments = message_segments(agent_chat(), [SEARCH])
    echoed = prompt_lib.echoed_question(segments)
    assert echoed is not None and len(echoed) == len(segments) + 1
    at = next(i for i, s in enumerate(segments) if s.kind is SegmentKind.QUESTION)
    assert echoed[at].kind is SegmentKind.HISTORY and echoed[at].role == "user" and echoed[at].text == QUESTION
    assert echoed[-1] == segments[at]
    assert [s for i, s in enumerate(echoed[:-1]) if i != at] == [s for i, s in enumerate(segments) if i != at]


def test_nothing_is_echoed_where_the_question_comes_last():
    assert prompt_lib.echoed_question(build_segments(QUESTION, DOCS)) is None
    answered = [*agent_chat(), {"role": "assistant", "content": "48213"}, {"role": "user", "content": "And the sky?"}]
    assert prompt_lib.echoed_question(message_segments(answered, [SEARCH])) is None


def test_the_drafts_question_follows_every_tool_result(engine):
    prompt = engine.assemble(list(message_segments(agent_chat(), [SEARCH])))
    question = prompt.positions_of(SegmentKind.QUESTION)
    results = (prompt.segment_index[:, None] == torch.tensor(
        [i for i, s in enumerate(prompt.segments) if s.kind is SegmentKind.TOOL_RESULT])).any(1).nonzero().flatten()
    assert int(question.max()) < int(results.min())  # the main prompt asks before the results come

    reading = engine.scorer.render(prompt)
    assert reading.maps and reading.read.segments[-1].kind is SegmentKind.QUESTION
    read_results = torch.isin(reading.read.segment_index, torch.tensor(
        [i for i, s in enumerate(reading.read.segments) if s.kind is SegmentKind.TOOL_RESULT]))
    assert int(reading.question().min()) > int(read_results.nonzero().max())


def test_scores_carry_back_by_segment(engine):
    segments = message_segments(agent_chat(), [SEARCH])
    prompt = engine.assemble(list(segments))
    scores = engine.score(prompt).scores
    # the reference: the echoed chat as a prompt of its own, scored as it stands (its question is last)
    reference = engine.assemble(list(prompt_lib.echoed_question(segments)))
    assert engine.scorer.render(reference).read is reference
    expected = engine.score(reference).scores
    for k, s in enumerate(prompt.segments):
        if s.kind is SegmentKind.TOOL_RESULT:
            torch.testing.assert_close(scores[prompt.segment_index == k], expected[reference.segment_index == k],
                                       rtol=1e-4, atol=1e-6)
    assert bool((scores[prompt.segment_index == -1] == 0).all())  # template tokens: always kept, never read


def test_echo_off_reads_the_prompt_as_it_stands(engine):
    prompt = engine.assemble(list(message_segments(agent_chat(), [SEARCH])))
    off = dataclasses.replace(engine.config.draft, echo_question=False)
    assert engine.scorer.render(prompt, config=off).read is prompt
    assert not torch.equal(engine.score(prompt, draft=off).scores, engine.score(prompt).scores)
    plain = engine.assemble(QUESTION, DOCS)
    assert engine.scorer.render(plain).read is plain  # a question that comes last costs nothing more


def test_a_draft_segment_inside_the_main_prompts_range_is_refused(engine):
    prompt = engine.assemble(list(message_segments(agent_chat(), [SEARCH])))
    read = engine.scorer.render(prompt).read
    with pytest.raises(ValueError, match="cannot align"):
        map_scores(torch.zeros(prompt.n_tokens), prompt, read)  # the main side lacks the echo


def test_echo_question_is_a_switch():
    with pytest.raises(ConfigError, match="echo_question must be True or False"):
        DraftConfig(echo_question="yes")
