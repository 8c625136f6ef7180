"""Unit tests of the example apps' shared helpers (examples/rag_chat.py): no model files.

Kept token ranges → kept / dropped character runs of each passage, uploads → documents with
readable errors, and a follow-up's prompt carrying the last exchange as chat turns.
"""

from __future__ import annotations

import pytest
import torch

from examples.rag_chat import ChatSession, load_uploads, passage_views
from specprefill_rag import Passage, SegmentKind
from specprefill_rag import prompt as prompt_lib
from specprefill_rag.selection import full_plan, plan_from_indices
from specprefill_rag.testing import tiny_engine

PASSAGES = [
    Passage("The quick brown fox jumps over the lazy dog near the river bank.", id="fox"),
    Passage("The grass is green. The sky is blue. The sun is yellow.", id="colours"),
]


@pytest.fixture()
def prompt(tokenizer):
    segments = prompt_lib.build_segments("what is the passkey?", PASSAGES, "be concise")
    return prompt_lib.assemble(tokenizer, segments)


class FixedRetriever:
    """Returns the same passages for every query, and remembers the queries."""

    def __init__(self, passages) -> None:
        self.passages, self.queries = passages, []

    def retrieve(self, question: str, top_k: int = 8) -> list[Passage]:
        self.queries.append(question)
        return list(self.passages[:top_k])


def test_a_follow_up_carries_the_last_exchange_as_chat_turns():
    """Turn 2's prompt begins with turn 1's exchange as protected history messages (so caches
    serve it), retrieval still sees the earlier question, and the views show passages only."""
    passages = [Passage(f"Bridge {i} spans the river at mile {i * 13} since {1900 + i}.", id=f"p{i}") for i in range(6)]
    retriever = FixedRetriever(passages)
    session = ChatSession(tiny_engine(), retriever, keep_rate=0.5, top_k=6, max_new_tokens=3)
    first = list(session.answer("Which bridge is at mile 26?"))[-1]
    stream, pending = session.ask("And when was it built?")
    history = [s for s in pending.segments if s.kind is SegmentKind.HISTORY]
    assert [(s.role, s.text) for s in history] == [("user", "Which bridge is at mile 26?"),
                                                   ("assistant", first.result.text.strip())]
    assert retriever.queries[-1] == "And when was it built? Which bridge is at mile 26?"
    for _ in stream:
        pass
    second = session.finish(stream, pending)
    assert second.prompt.protected[pending.prompt.segment_index == pending.segments.index(history[0])].all()
    assert [v.id for v in second.views] == [p.id for p in passages]  # no history among the passages
    # Turn 2 reads on from the start it shares with turn 1 (template, instructions): read once.
    assert first.result.draft_cached_tokens == 0 < second.result.draft_cached_tokens


def test_views_cover_each_passage_text_exactly(prompt):
    views = passage_views(prompt, full_plan(prompt))
    assert [v.id for v in views] == ["fox", "colours"]
    for view, passage in zip(views, PASSAGES, strict=True):
        assert "".join(text for text, _ in view.pieces) == passage.text  # passage text only, no template
        assert all(kept for _, kept in view.pieces) and view.keep_ratio == 1.0


def test_dropped_tokens_become_dropped_characters(prompt):
    fox = [i for i, s in enumerate(prompt.segment_index.tolist()) if s >= 0 and prompt.segments[s].id == "fox"]
    dropped = set(fox[2:5])
    kept = torch.tensor([i for i in range(prompt.n_tokens) if i not in dropped])
    views = passage_views(prompt, plan_from_indices(prompt, kept))
    fox_view, colours_view = views
    assert fox_view.n_kept == fox_view.n_tokens - 3
    assert [k for _, k in fox_view.pieces] == [True, False, True]
    a, b = prompt.offsets[fox[2]][0].item(), prompt.offsets[fox[4]][1].item()
    assert fox_view.pieces[1][0] == prompt.text[a:b]  # exactly the dropped tokens' characters
    assert all(k for _, k in colours_view.pieces)
    assert {s.kind for s in plan_from_indices(prompt, kept).kept_spans} >= {SegmentKind.PASSAGE}


def test_uploads_become_documents(tmp_path):
    (tmp_path / "a.md").write_text("# Hut\n\nThe hut has four beds.")
    (tmp_path / "b.txt").write_text("The boat is red.")
    docs = load_uploads([tmp_path / "a.md", tmp_path / "b.txt"])
    assert [d.source for d in docs] == ["a.md", "b.txt"]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("huge.txt", "x" * 3_000_000, "the upload is too large"),
        ("empty.md", "  \n", "no documents: the uploaded files contain no text"),
        ("table.csv", "a,b", "unsupported file type"),
        ("broken.pdf", "not a pdf", "broken.pdf"),
    ],
)
def test_bad_uploads_give_readable_errors(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_uploads([path], max_mb=2.0)


def test_no_uploads():
    with pytest.raises(ValueError, match="no documents"):
        load_uploads([])
