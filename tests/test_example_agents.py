"""The agent examples (examples/agent_llamaindex.py, examples/agent_langchain.py) on a tiny engine
whose answers are scripted (a call, then the answer): the tool loop runs through each framework's
face and the report names every retrieved document. No model files; skipped without the
integration packages."""

from __future__ import annotations

import asyncio
import json

import pytest

from specprefill_rag import SpecPrefillEngine, testing

DOCS = [("opening.md", "Tindra Point Research Station opened on 4 March 1987. " * 4),
        ("physician.md", "The winter physician is Dr. Ilse Varga. " * 4)]
ANSWER = "It opened on 4 March 1987."


def scripted(call_arguments: dict[str, str]) -> SpecPrefillEngine:
    """A tiny engine with a tool-rendering template whose model calls search, then answers."""
    inner = testing.tiny_engine(max_position_embeddings=4096, tools=True)
    call = f'<tool_call>\n{json.dumps({"name": "search", "arguments": call_arguments})}\n</tool_call>'
    return SpecPrefillEngine(testing.ScriptedBackend(inner.backend, call, ANSWER), inner.draft, inner.config)


def test_the_llamaindex_function_agent_example(capsys):
    example = pytest.importorskip("examples.agent_llamaindex")
    from llama_index.core import Document, MockEmbedding, VectorStoreIndex
    from llama_index.llms.specprefill import SpecPrefillLLM

    documents = [Document(text=text, metadata={"source": source}) for source, text in DOCS]
    index = VectorStoreIndex.from_documents(documents, embed_model=MockEmbedding(embed_dim=8))
    llm = SpecPrefillLLM(engine=scripted({"input": "opening date"}), max_new_tokens=200, keep_rate=0.3)
    output = asyncio.run(example.ask(example.build_agent(llm, index, top_k=2), "When did the station open?"))
    example.report(output, index)
    out = capsys.readouterr().out
    assert "[calls search(" in out and ANSWER in out
    assert all(f"{source} " in out for source, _ in DOCS)  # one kept-tokens line per retrieved node


def test_the_langchain_tool_agent_example(capsys):
    example = pytest.importorskip("examples.agent_langchain")
    from langchain_core.documents import Document
    from langchain_core.embeddings import DeterministicFakeEmbedding
    from langchain_core.vectorstores import InMemoryVectorStore
    from langchain_specprefill import ChatSpecPrefill

    store = InMemoryVectorStore(DeterministicFakeEmbedding(size=8))
    store.add_documents([Document(text, id=source) for source, text in DOCS])
    llm = ChatSpecPrefill(engine=scripted({"query": "opening date"}), max_tokens=200, keep_rate=0.3)
    messages = example.run_agent(llm, [example.search_tool(store, top_k=2)], "When did the station open?")
    assert [m.type for m in messages] == ["system", "human", "ai", "tool", "ai"] and messages[-1].text == ANSWER
    example.report(messages[-1])
    out = capsys.readouterr().out
    assert all(f"{source} " in out for source, _ in DOCS)  # one kept-tokens line per retrieved document
