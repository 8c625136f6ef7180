"""``specprefill_rag.adapters``: the one module the LangChain and LlamaIndex integrations use."""

from __future__ import annotations

import math

import pytest
from pydantic import BaseModel

from specprefill_rag import adapters, testing
from specprefill_rag.backends.vllm_server import DEFAULT_MAX_RETRIES
from specprefill_rag.compress import DEFAULT_MARKER

PASSAGES = [
    "The lantern festival is held in Arden every spring. Boats carry lanterns down the river.",
    "The mills grind grain at night. The river runs north past the mills.",
]


def test_option_is_a_field_with_the_shared_default_and_description():
    class Model(BaseModel):
        max_retries: int = adapters.option("max_retries")
        marker: str = adapters.option("marker")
        keep_rate: float | None = adapters.option("keep_rate", description="this class's own words")

    fields = Model.model_fields
    assert Model().max_retries == DEFAULT_MAX_RETRIES and Model().marker == DEFAULT_MARKER
    assert fields["max_retries"].description == adapters.OPTIONS["max_retries"].description
    assert fields["keep_rate"].description == "this class's own words"
    assert Model(keep_rate=0.3).keep_rate == 0.3
    with pytest.raises(KeyError):
        adapters.option("no_such_option")


def test_to_passage_copies_the_metadata():
    metadata = {"score": 0.7}
    passage = adapters.to_passage("text", "doc-1", metadata)
    metadata["score"] = 0.1
    assert (passage.text, passage.id, passage.metadata["score"]) == ("text", "doc-1", 0.7)
    assert dict(adapters.to_passage("text").metadata) == {}


def test_compress_passages_is_the_engines_compression():
    engine = testing.tiny_engine()
    passages = [adapters.to_passage(text, f"p{i}") for i, text in enumerate(PASSAGES)]
    got = adapters.compress_passages(lambda: engine, "Where is the lantern festival?", passages, keep_rate=0.5)
    want = engine.compress("Where is the lantern festival?", passages, keep_rate=0.5).passages
    assert [(c.id, c.text, c.spans) for c in got] == [(c.id, c.text, c.spans) for c in want]
    assert [c.id for c in got] == ["p0", "p1"]


def test_compress_passages_without_text_leaves_the_engine_unbuilt():
    asked: list[str] = []

    def engine():
        asked.append("engine")
        return testing.tiny_engine()

    passages = [adapters.to_passage("", "a"), adapters.to_passage("  \n", "b")]
    empty = adapters.compress_passages(engine, "question?", passages)
    assert [(c.index, c.id, c.text, c.kept_nothing) for c in empty] == [(0, "a", "", True), (1, "b", "", True)]
    assert asked == []  # nothing to score: the engine was never asked for
    adapters.compress_passages(engine, "Where is the lantern festival?", [adapters.to_passage(PASSAGES[0], "a")])
    assert asked == ["engine"]


def test_answer_report_leads_with_the_model_and_carries_the_results_facts():
    engine = testing.tiny_engine()
    result = engine.generate("Where is the lantern festival?", PASSAGES)
    report = adapters.answer_report("tiny", result)
    assert report == {"model_name": "tiny", **result.to_dict()}
    assert "keep_ratio" in report


@pytest.mark.real_model
def test_embed_is_the_packaged_minilm_at_unit_length():
    from specprefill_rag.tools.retrieval import load_embedder

    vectors = adapters.embed(["the river runs north", "lanterns in spring"])
    assert len(vectors) == 2 and all(len(v) == 384 for v in vectors)
    assert all(math.isclose(sum(x * x for x in v), 1.0, rel_tol=1e-4) for v in vectors)
    direct = load_embedder().encode(["the river runs north"], normalize_embeddings=True)[0]
    assert vectors[0] == pytest.approx(direct.tolist(), abs=1e-6)
