"""A LlamaIndex ``FunctionAgent`` whose LLM prefills with SpecPrefill and retrieves through a tool.

Indexes the bundled station handbook in a ``VectorStoreIndex`` (embedded offline with the
packaged all-MiniLM-L6-v2) and gives a ``FunctionAgent`` one tool: a ``QueryEngineTool`` over a
retrieval-only query engine (a ``NoText`` synthesizer), wrapped in ``DocumentsTool`` so that
the agent reads the retrieved nodes themselves. The main model calls the tool, reads its
documents (each node one prunable passage, scored by the draft) and answers; the script prints
the call, the answer and what the main model prefilled of each retrieved node. Tool calling
needs a chat template that renders tools: the packaged Qwen2.5-Coder pair (0.5B drafts for
1.5B), not SmolLM2. Calls are decoded under their grammar (docs/tools.md), so they are always
well formed. On llama-index-core 0.14 (``FunctionAgent.initial_tool_choice``) the first step must
call the tool: the 1.5B model otherwise mostly answers from memory; 0.12 has no such field, and
the system prompt alone asks for the call. The answer step still offers the tool, and there the
1.5B model answers poorly (the same under full prefill: docs/tools.md, "On the packaged
models"). From the repository root::

    .venv/bin/python examples/agent_llamaindex.py
    .venv/bin/python examples/agent_llamaindex.py --keep-rate 0.1 --question "..."
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from llama_index.core import Document, VectorStoreIndex  # noqa: E402
from llama_index.core.agent.workflow import AgentStream, FunctionAgent, ToolCall  # noqa: E402
from llama_index.core.node_parser import SentenceSplitter  # noqa: E402
from llama_index.core.query_engine import RetrieverQueryEngine  # noqa: E402
from llama_index.core.response_synthesizers.no_text import NoText  # noqa: E402
from llama_index.core.tools import QueryEngineTool  # noqa: E402
from llama_index.llms.specprefill import DocumentsTool, MiniLMEmbedding, SpecPrefillLLM  # noqa: E402

from specprefill_rag import ToolCallError  # noqa: E402
from specprefill_rag.loading import MODEL_PAIRS  # noqa: E402
from specprefill_rag.tools.retrieval import demo_documents  # noqa: E402

SYSTEM = ("You answer questions about the Tindra Point Research Station. Call the search tool once. When its "
          "passages arrive, write the answer itself in one sentence, taken from them; never call search again.")




def build_agent(llm: SpecPrefillLLM, index: VectorStoreIndex, top_k: int = 4) -> FunctionAgent:
    """A ``FunctionAgent`` with one retrieval tool whose result is the retrieved nodes."""
    # A query engine that only retrieves (NoText: no answer of its own; as_query_engine(response_mode=
    # "no_text") would look for Settings.llm).
    retrieval = RetrieverQueryEngine(index.as_retriever(similarity_top_k=top_k), response_synthesizer=NoText(llm=llm))
    search = QueryEngineTool.from_defaults(
        retrieval, name="search", description="Search the station handbook; returns the passages that match.")
    agent = FunctionAgent(tools=[DocumentsTool(search)], llm=llm, system_prompt=SYSTEM)
    if "initial_tool_choice" in FunctionAgent.model_fields:  # llama-index-core 0.14: the first step calls it
        setattr(agent, "initial_tool_choice", "search")  # noqa: B010  (0.12's type has no such field)
    return agent


async def ask(agent: FunctionAgent, question: str) -> Any:
    """Run the agent on ``question``, printing its tool calls and streaming its answer; the
    ``AgentOutput`` (its ``raw``: the last step's SpecPrefill facts)."""
    handler = agent.run(user_msg=question)
    async for event in handler.stream_events():
        if isinstance(event, ToolCall):
            print(f"  [calls {event.tool_name}({event.tool_kwargs})]", flush=True)
        elif isinstance(event, AgentStream) and event.delta:
            print(event.delta, end="", flush=True)
    print()
    return await handler


def report(output: Any, index: VectorStoreIndex) -> None:
    """What the main model prefilled of each retrieved node in the step that read them."""
    facts = output.raw
    t = facts["timings"]
    print(f"TTFT {t['ttft_s']:.2f} s (draft {t['draft_s'] or 0:.2f} s + main prefill {t['prefill_s']:.2f} s), "
          f"prefilled {facts['prefilled_tokens']}/{facts['prompt_tokens']} tokens ({facts['keep_ratio']:.0%}), "
          f"path: {facts['path']}")
    results = [span for span in facts["kept_spans"] if span["kind"] == "tool_result"]
    if not results:
        print("  (the model answered without calling the tool: no retrieved documents in its prompt)")
    for span in results:
        node = index.docstore.docs.get(span["id"])
        source = node.metadata.get("source", span["id"]) if node is not None else span["id"]
        print(f"  {source:<26} kept {span['n_kept']:4d}/{span['n_tokens']:<4d} tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--question", default="On what date was Tindra Point Research Station officially opened?")
    parser.add_argument("--models", choices=sorted(MODEL_PAIRS), default="qwen")
    parser.add_argument("--keep-rate", type=float, default=0.3)
    parser.add_argument("--top-k", type=int, default=4)
    args = parser.parse_args()

    documents = [Document(text=d.text, metadata={"source": d.source}) for d in demo_documents()]
    index = VectorStoreIndex.from_documents(
        documents, embed_model=MiniLMEmbedding(), transformations=[SentenceSplitter(chunk_size=200, chunk_overlap=0)]
    )
    main_model, draft_model = MODEL_PAIRS[args.models]
    llm = SpecPrefillLLM(model_name=main_model, draft_model=draft_model, keep_rate=args.keep_rate, max_new_tokens=96)
    print(f"Q: {args.question}")
    try:
        output = asyncio.run(ask(build_agent(llm, index, args.top_k), args.question))
    except ToolCallError as error:  # e.g. a call cut short by max_new_tokens
        raise SystemExit(f"the model wrote no valid tool call: {error}") from None
    report(output, index)


if __name__ == "__main__":
    main()
