"""``SpecPrefillPassageReader`` in an ``IngestionPipeline``: the draft reads the nodes as they are
ingested, and a query engine's question over them then finds every passage in the draft's store
(``passages_cached``), with or without ``PassageIdPostprocessor``, sync and async. Tiny random
engine whose 8-layer draft reads passages apart."""

from __future__ import annotations

import pytest
from li_helpers import CompletionRecorder, tiny_engine, tiny_reading_engine
from llama_index.core import MockEmbedding, VectorStoreIndex
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.schema import TextNode
from specprefill_rag import ConfigError, PassagesRead

from llama_index.llms.specprefill import PassageIdPostprocessor, SpecPrefillLLM, SpecPrefillPassageReader

SYSTEM = "Answer from the station handbook only."


def nodes() -> list[TextNode]:
    """Five nodes, each with a metadata header the LLM sees and one it does not."""
    return [TextNode(text=f"Hut {i} stands {100 + i} metres above the fjord and sleeps {i + 2} people. " * 2,
                     id_=f"hut-{i}", metadata={"file_name": f"hut{i}.md", "hidden": "x"},
                     excluded_llm_metadata_keys=["hidden"]) for i in range(5)]


def query(llm: SpecPrefillLLM, recorder: CompletionRecorder, ingested: list[TextNode], marked: bool) -> dict:
    """The facts of one query over ``ingested`` (every node retrieved)."""
    index = VectorStoreIndex(ingested, embed_model=MockEmbedding(embed_dim=8))
    post = [PassageIdPostprocessor()] if marked else []
    index.as_query_engine(llm=llm, similarity_top_k=len(ingested), node_postprocessors=post).query(
        "Which hut sleeps five people?")
    return recorder.responses[-1].additional_kwargs


@pytest.mark.parametrize("marked", [True, False])
def test_ingested_nodes_are_found_by_the_query(recorder, marked):
    llm = SpecPrefillLLM(engine=tiny_reading_engine(), system_prompt=SYSTEM)
    reader = SpecPrefillPassageReader(llm=llm, passage_ids=marked)
    ingested = list(IngestionPipeline(transformations=[reader]).run(nodes=nodes()))
    assert [n.node_id for n in ingested] == [f"hut-{i}" for i in range(5)]  # returned unchanged
    pieces = len(reader.passages(ingested))
    assert pieces == (5 if marked else 10)  # unmarked, each node's metadata header is a passage of its own
    assert all("hidden" not in p.text and "passage_id" not in p.text for p in reader.passages(ingested))
    assert len(llm.engine.draft.passages) == pieces
    facts = query(llm, recorder, ingested, marked)
    assert (facts["passages_cached"], facts["passages_read"]) == (pieces, 0)  # the draft read none again
    assert reader.read(ingested) == PassagesRead(pieces, 0)


def test_the_query_must_match_how_the_nodes_were_read(recorder):
    """Another system prompt is another system part; another cut gives other passages: read anew."""
    engine = tiny_reading_engine()
    reader = SpecPrefillPassageReader(llm=SpecPrefillLLM(engine=engine, system_prompt=SYSTEM))
    ingested = list(reader(nodes()))
    other = SpecPrefillLLM(engine=engine, system_prompt="Be brief.")
    facts = query(other, recorder, ingested, marked=True)
    assert (facts["passages_cached"], facts["passages_read"]) == (0, 5)
    facts = query(SpecPrefillLLM(engine=engine, system_prompt=SYSTEM), recorder, ingested, marked=False)
    assert facts["passages_cached"] == 0 and facts["passages_read"] == 10


async def test_the_async_pipeline_reads_in_a_thread(recorder):
    llm = SpecPrefillLLM(engine=tiny_reading_engine())  # no system_prompt: the engine's instructions
    ingested = list(await IngestionPipeline(transformations=[SpecPrefillPassageReader(llm=llm)]).arun(
        nodes=nodes()))
    facts = query(llm, recorder, ingested, marked=True)
    assert (facts["passages_cached"], facts["passages_read"]) == (5, 0)


def test_an_engine_that_reads_jointly_refuses_to_read_ahead():
    reader = SpecPrefillPassageReader(llm=SpecPrefillLLM(engine=joint_engine()))
    with pytest.raises(ConfigError, match="DraftConfig\\(passages=PassageReading"):
        reader(nodes())


def joint_engine():
    """The tiny engine with its draft reading every prompt jointly (``DraftConfig(passages=None)``)."""
    import dataclasses

    engine = tiny_engine()
    engine.config = dataclasses.replace(engine.config, draft=dataclasses.replace(engine.config.draft, passages=None))
    return engine
