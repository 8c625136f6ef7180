"""A LangChain tool-calling agent whose chat model prefills with SpecPrefill and retrieves through a tool.

Puts the bundled station handbook in an ``InMemoryVectorStore`` (embedded offline with the
packaged all-MiniLM-L6-v2) and offers ``ChatSpecPrefill`` one tool, ``create_retriever_tool(...,
response_format="content_and_artifact")``: its ``ToolMessage`` carries the retrieved
``Document``s as its artifact, so each document is its own prunable passage, named by its id.
The loop is the one ``create_agent`` / a LangGraph ReAct agent runs (model → tool calls → tool
messages → model), written out with ``langchain-core`` alone. The script prints the call, the
answer and what the main model prefilled of each retrieved document. Tool calling needs a chat
template that renders tools: the packaged Qwen2.5-Coder pair (0.5B drafts for 1.5B), not
SmolLM2. Calls are decoded under their grammar (docs/tools.md), so they are always well formed;
the loop retrieves first and answers without tools, as LangGraph's agentic-RAG graph does
(``run_agent``). From the repository root::

    .venv/bin/python examples/agent_langchain.py
    .venv/bin/python examples/agent_langchain.py --keep-rate 0.1 --question "..."
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from langchain_core.documents import Document  # noqa: E402
from langchain_core.language_models import BaseChatModel  # noqa: E402
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage  # noqa: E402
from langchain_core.tools import BaseTool, create_retriever_tool  # noqa: E402
from langchain_core.vectorstores import InMemoryVectorStore  # noqa: E402
from langchain_specprefill import ChatSpecPrefill, MiniLMEmbeddings  # noqa: E402

from specprefill_rag import ToolCallError  # noqa: E402
from specprefill_rag.loading import MODEL_PAIRS  # noqa: E402
from specprefill_rag.tools.retrieval import demo_documents, split_passages  # noqa: E402

SYSTEM = ("You answer questions about the Tindra Point Research Station. Call the search tool first, "
          "then answer in one sentence from what it returns.")



def search_tool(store: InMemoryVectorStore, top_k: int = 4) -> BaseTool:
    """The retriever as a tool whose ``ToolMessage.artifact`` is the retrieved ``Document``s."""
    return create_retriever_tool(store.as_retriever(search_kwargs={"k": top_k}), "search",
                                 "Search the station handbook; returns the passages that match.",
                                 response_format="content_and_artifact")


def run_agent(llm: BaseChatModel, tools: Sequence[BaseTool], question: str, max_steps: int = 4,
              *, retrieve_first: bool = True, answer_with_tools: bool = False) -> list[BaseMessage]:
    """Model → tool calls → tool messages → model, until the model answers without a call; the
    whole conversation (its last message: the answer).

    As LangGraph's agentic-RAG graph: ``retrieve_first`` makes the first step call a tool
    (``tool_choice="any"``: the 1.5B model otherwise mostly answers from memory, or in prose
    about the tool), and once tool results are in, the model answers with no tools bound unless
    ``answer_with_tools`` (offered tools there, it tends to write another call as plain JSON text)."""
    by_name = {tool.name: tool for tool in tools}
    messages: list[BaseMessage] = [SystemMessage(SYSTEM), HumanMessage(question)]
    for step in range(max_steps):
        read = any(isinstance(m, ToolMessage) for m in messages)
        model = (llm.bind_tools(tools, tool_choice="any") if step == 0 and retrieve_first
                 else llm if read and not answer_with_tools else llm.bind_tools(tools))
        answer = model.invoke(messages)
        messages.append(answer)
        if not isinstance(answer, AIMessage) or not answer.tool_calls:
            return messages
        for call in answer.tool_calls:
            print(f"  [calls {call['name']}({call['args']})]", flush=True)
            messages.append(by_name[call["name"]].invoke(call))  # a ToolMessage, documents as its artifact
    raise RuntimeError(f"no answer after {max_steps} model steps")


def report(answer: BaseMessage) -> None:
    """What the main model prefilled of each retrieved document in the step that read them."""
    meta = answer.response_metadata
    t = meta["timings"]
    print(f"TTFT {t['ttft_s']:.2f} s (draft {t['draft_s'] or 0:.2f} s + main prefill {t['prefill_s']:.2f} s), "
          f"prefilled {meta['prefilled_tokens']}/{meta['prompt_tokens']} tokens ({meta['keep_ratio']:.0%}), "
          f"path: {meta['path']}")
    results = [span for span in meta["kept_spans"] if span["kind"] == "tool_result"]  # one per Document
    if not results:
        print("  (the model answered without calling the tool: no retrieved documents in its prompt)")
    for span in results:
        print(f"  {span['id']:<28} kept {span['n_kept']:4d}/{span['n_tokens']:<4d} tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--question", default="On what date was Tindra Point Research Station officially opened?")
    parser.add_argument("--models", choices=sorted(MODEL_PAIRS), default="qwen")
    parser.add_argument("--keep-rate", type=float, default=0.3)
    parser.add_argument("--top-k", type=int, default=4)
    args = parser.parse_args()

    store = InMemoryVectorStore(MiniLMEmbeddings())
    passages = split_passages(demo_documents())
    store.add_documents([Document(p.text, id=p.id, metadata=dict(p.metadata)) for p in passages])
    main_model, draft_model = MODEL_PAIRS[args.models]
    llm = ChatSpecPrefill(model=main_model, draft_model=draft_model, keep_rate=args.keep_rate, max_tokens=96)
    print(f"Q: {args.question}")
    try:
        answer = run_agent(llm, [search_tool(store, args.top_k)], args.question)[-1]
    except ToolCallError as error:  # e.g. a call cut short by max_tokens
        raise SystemExit(f"the model wrote no valid tool call: {error}") from None
    print(f"A: {answer.text}")
    report(answer)


if __name__ == "__main__":
    main()
