"""Portable mode in LangChain: the draft compresses the retrieved documents, any chat model answers.

An LCEL RAG chain over the bundled station handbook (an ``InMemoryVectorStore`` embedded offline
with the packaged all-MiniLM-L6-v2) whose retrieved ``Document``s pass through
``SpecPrefillCompressor`` — the sentences SpecPrefill would prefill for this question, chosen by
the draft in this process — before an unmodified ``ChatOpenAI`` answers from them on any
OpenAI-compatible server: a stock vLLM without our plugin, a hosted API, Ollama. Prints the
answer, the prompt tokens the server reports, and what was kept of each document (its own id and
metadata, the kept ratio and spans). Needs ``langchain-openai`` and the integration package (the
client environment has both: ``make client-setup``). From the repository root (as a module:
it shares the embedder wrapper of ``examples/langchain_rag_chain.py``)::

    .venv-client/bin/python -m examples.portable_langchain --base-url http://127.0.0.1:8000/v1 --baseline
    .venv-client/bin/python -m examples.portable_langchain --base-url ... --scorer qwen2.5-coder-0.5b-instruct

``--scorer``: the model whose tokenizer renders the scored prompt and which scores it (the draft
as its own main: one set of weights; the answering model never runs here).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from langchain_core.documents import Document  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from langchain_core.runnables import Runnable, RunnableLambda, RunnableParallel, RunnablePassthrough  # noqa: E402
from langchain_core.vectorstores import InMemoryVectorStore  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from langchain_specprefill import MiniLMEmbeddings, SpecPrefillCompressor  # noqa: E402

from examples.portable_args import parse_args  # noqa: E402
from specprefill_rag.tools.retrieval import demo_documents, split_passages  # noqa: E402

SYSTEM = ("You are an assistant for question-answering tasks. Use the following pieces of retrieved context to "
          "answer the question. If you don't know the answer, say that you don't know. Keep the answer short.")
PROMPT = ChatPromptTemplate.from_messages([("system", SYSTEM + "\n\n{context}"), ("human", "{question}")])


def _documents(inputs: dict[str, Any]) -> list[Document]:
    return list(inputs["documents"])


def _context(inputs: dict[str, Any]) -> str:
    return "\n\n".join(d.page_content for d in inputs["documents"])


def build_chain(retriever: Runnable, llm: ChatOpenAI, compressor: Runnable | None) -> Runnable:
    """question → {"question", "documents" (compressed), "answer" (the model's message)}. Without
    ``compressor`` the retrieved documents go to the model whole (the baseline)."""
    documents = compressor if compressor is not None else RunnableLambda(_documents)
    context: Runnable = RunnableLambda(_context)
    return (RunnableParallel(question=RunnablePassthrough(), documents=retriever)
            | RunnablePassthrough.assign(documents=documents)
            | RunnablePassthrough.assign(answer=RunnablePassthrough.assign(context=context) | PROMPT | llm))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv, __doc__.split("\n\n")[0], "documents")

    store = InMemoryVectorStore(MiniLMEmbeddings())
    passages = split_passages(demo_documents())
    store.add_documents([Document(p.text, id=p.id, metadata=dict(p.metadata)) for p in passages])
    retriever = store.as_retriever(search_kwargs={"k": args.top_k})
    llm = ChatOpenAI(base_url=args.base_url, api_key=args.api_key, model=args.model, temperature=0,
                     max_tokens=args.max_tokens, max_retries=0, timeout=600)
    compressor = SpecPrefillCompressor(model=args.scorer, keep_rate=args.keep_rate)

    result: dict[str, Any] = build_chain(retriever, llm, compressor).invoke(args.question)
    usage = result["answer"].usage_metadata or {}
    print(f"Q: {args.question}\nA: {result['answer'].content}")
    print(f"the server prefilled {usage.get('input_tokens')} prompt tokens")
    for doc in result["documents"]:
        print(f"  {doc.id:<28} kept {doc.metadata['specprefill_keep_ratio']:.0%} of its text")
    if args.baseline:
        whole = build_chain(retriever, llm, None).invoke(args.question)
        result["baseline"] = whole
        print(f"whole documents: {(whole['answer'].usage_metadata or {}).get('input_tokens')} prompt tokens, "
              f"A: {whole['answer'].content}")
    return result


if __name__ == "__main__":
    main()
