"""SpecPrefillNodePostprocessor on the tiny random engine: one node per node with its id, score and
metadata, kept spans that map back to the node's text and are the engine's own plan, the option
for nodes with nothing kept, the async path, and a query engine in front of another LLM."""

from __future__ import annotations

import asyncio
import functools

import pytest
from llama_index.core import VectorStoreIndex
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.llms import MockLLM
from llama_index.core.schema import ImageNode, MetadataMode, NodeWithScore, TextNode
from specprefill_rag import (
    InputError,
    InputTypeError,
    Passage,
    SegmentKind,
    SelectionConfig,
    SpecPrefillEngine,
    testing,
)

from llama_index.postprocessor.specprefill import SpecPrefillNodePostprocessor

QUESTION = "Which city hosts the lantern festival?"
TEXTS = [
    "The river runs north. Boats carry grain to the mills. The mills grind it at night.",
    "Lanterns fill the sky in Hoian every spring! Visitors come from far away. Street food is sold until dawn.",
    "Cats sleep most of the day. Dogs bark at the postman. Birds sing before sunrise; owls sing at night.",
    "The festival began centuries ago. Its lanterns are made of silk and bamboo. The city glows for a week.",
    "Trains leave the station every hour. The last one departs at midnight. Tickets are sold on board.",
]
SELECTION = SelectionConfig(keep_rate=0.3, min_prompt_tokens=16)


@functools.lru_cache(maxsize=1)
def tiny_engine() -> SpecPrefillEngine:
    return testing.tiny_engine(max_position_embeddings=4096)


def _nodes() -> list[NodeWithScore]:
    return [NodeWithScore(node=TextNode(text=t, id_=f"node-{i}", metadata={"file": f"{i}.txt"}), score=1.0 - i / 10)
            for i, t in enumerate(TEXTS)]


def _postprocessor(**options: object) -> SpecPrefillNodePostprocessor:
    return SpecPrefillNodePostprocessor(engine=tiny_engine(), selection=SELECTION, **options)


def test_one_node_per_node_with_its_id_score_and_metadata():
    nodes = _nodes()
    out = _postprocessor().postprocess_nodes(nodes, query_str=QUESTION)
    assert [(n.node.node_id, n.score) for n in out] == [(n.node.node_id, n.score) for n in nodes]
    for source, kept in zip(nodes, out, strict=True):
        assert kept.node.metadata["file"] == source.node.metadata["file"]
        spans = kept.node.metadata["specprefill_spans"]
        pieces = [source.node.get_content()[a:b] for a, b in spans]
        assert [p.strip() for p in kept.node.get_content().split("…") if p.strip()] == pieces
        assert 0.0 <= kept.node.metadata["specprefill_keep_ratio"] <= 1.0
        assert "specprefill" not in kept.node.get_content(metadata_mode=MetadataMode.LLM)
        assert "specprefill" not in kept.node.get_content(metadata_mode=MetadataMode.EMBED)
    assert [n.node.get_content() for n in nodes] == TEXTS  # the input nodes are left as they were
    assert 0 < sum(len(n.node.get_content()) for n in out) < sum(len(t) for t in TEXTS)


def test_the_kept_text_is_the_engines_own_plan():
    engine, nodes = tiny_engine(), _nodes()
    out = _postprocessor().postprocess_nodes(nodes, query_str=QUESTION)
    passages = [Passage(n.node.get_content(), id=n.node.node_id, metadata=dict(n.node.metadata)) for n in nodes]
    compression = engine.compress(QUESTION, passages, selection=SELECTION)
    plan = engine.plan(engine.assemble(QUESTION, passages, selection=SELECTION), selection=SELECTION).plan
    own = {s.id: s.ranges for s in plan.kept_spans if s.kind is SegmentKind.PASSAGE}
    assert {p.id: p.token_ranges for p in compression.passages} == own
    assert [n.node.metadata["specprefill_spans"] for n in out] == [[list(s) for s in p.spans]
                                                                    for p in compression.passages]


def test_nodes_with_nothing_kept_are_kept_empty_or_dropped():
    kept = _postprocessor(keep_rate=0.1).postprocess_nodes(_nodes(), query_str=QUESTION)
    dropped = _postprocessor(keep_rate=0.1, if_nothing_kept="drop").postprocess_nodes(_nodes(), query_str=QUESTION)
    assert len(kept) == len(TEXTS) and any(not n.node.get_content() for n in kept)
    assert [n.node.node_id for n in dropped] == [n.node.node_id for n in kept if n.node.get_content()]


def test_a_node_without_text_stays_one_node():
    image = NodeWithScore(node=ImageNode(id_="picture", metadata={"kind": "photo"}), score=0.5)
    out = _postprocessor().postprocess_nodes([*_nodes()[:2], image], query_str=QUESTION)
    assert len(out) == 3 and (out[-1].node.node_id, out[-1].score) == ("picture", 0.5)
    assert isinstance(out[-1].node, ImageNode) and out[-1].node.metadata["kind"] == "photo"
    assert out[-1].node.metadata["specprefill_spans"] == [] and out[-1].node.get_content() == ""
    assert _postprocessor().postprocess_nodes([image], query_str=QUESTION)[0].node.node_id == "picture"


def test_async_postprocessing_leaves_the_event_loop_free():
    postprocessor = _postprocessor()

    async def main() -> tuple[list[NodeWithScore], int]:
        ticks, done = 0, False

        async def tick() -> None:
            nonlocal ticks
            while not done:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        out = await postprocessor.apostprocess_nodes(_nodes(), query_str=QUESTION)
        done = True
        await ticker
        return out, ticks

    out, ticks = asyncio.run(main())
    assert ticks > 1, "the event loop did not run while the draft scored"
    sync = postprocessor.postprocess_nodes(_nodes(), query_str=QUESTION)
    assert [n.node.get_content() for n in out] == [n.node.get_content() for n in sync]


def test_a_query_engine_in_front_of_another_llm():
    """The postprocessor hands the LLM the kept text only: MockLLM echoes its prompt."""
    nodes = [TextNode(text=t, id_=f"node-{i}") for i, t in enumerate(TEXTS)]
    index = VectorStoreIndex(nodes, embed_model=MockEmbedding(embed_dim=8))
    engine = index.as_query_engine(llm=MockLLM(), similarity_top_k=5, node_postprocessors=[_postprocessor()])
    response = engine.query(QUESTION)
    assert len(response.source_nodes) == 5
    prompt = str(response)
    for node in response.source_nodes:
        for piece in node.node.get_content().split("…"):
            assert piece.strip() in prompt
    dropped = [t for t, n in zip(TEXTS, sorted(response.source_nodes, key=lambda n: n.node.node_id), strict=True)
               if n.node.metadata["specprefill_keep_ratio"] < 1.0]
    assert dropped and not any(t in prompt for t in dropped)
    assert "specprefill_spans" not in prompt


def test_bad_input_is_a_clear_error():
    with pytest.raises(InputError, match="needs the query"):
        _postprocessor().postprocess_nodes(_nodes())
    with pytest.raises(InputTypeError, match="node 1 must be a NodeWithScore"):
        _postprocessor().postprocess_nodes([_nodes()[0], TextNode(text="x")], query_str=QUESTION)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="pass engine="):
        SpecPrefillNodePostprocessor()


def test_the_package_exports_the_postprocessor():
    import llama_index.postprocessor.specprefill as package

    assert package.__all__ == ["SpecPrefillNodePostprocessor"]
    assert SpecPrefillNodePostprocessor.class_name() == "SpecPrefillNodePostprocessor"
