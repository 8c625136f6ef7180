"""``create_specprefill_rag_chain``: retriever → ``ChatSpecPrefill`` with documents as passages.

The retrieved ``Document``s are handed to the chat model as separate passages (one prunable
segment each), never pasted into one prompt string, so the question stays protected and the
draft's selection is reported per document.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

from langchain_core.documents import Document
from langchain_core.messages import AIMessageChunk, BaseMessage, HumanMessage, SystemMessage
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnableConfig, RunnableLambda, RunnableParallel
from langchain_core.runnables.utils import AddableDict

from .chat_models import ChatSpecPrefill

__all__ = ["create_specprefill_rag_chain"]


def _question(inputs: str | dict[str, Any]) -> str:
    question = inputs if isinstance(inputs, str) else inputs.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ValueError('the RAG chain takes a question: a string or {"question": "..."}')
    return question


def _with_ids(documents: list[Document]) -> list[Document]:
    """Documents with an id each (their own, else their 1-based rank), so spans can name them."""
    return [d if d.id is not None else d.model_copy(update={"id": str(i)}) for i, d in enumerate(documents, 1)]


def create_specprefill_rag_chain(
    retriever: BaseRetriever | Runnable[str, list[Document]],
    llm: ChatSpecPrefill,
    *,
    instructions: str | None = None,
) -> Runnable[str | dict[str, Any], dict[str, Any]]:
    """An LCEL chain: question → retrieve → answer with the documents as passages.

    Input: a question string or ``{"question": ...}``. Output (``invoke``): a dict with
    ``question``, ``documents`` (the retrieved ``Document``s, each with an ``id``),
    ``answer`` (text), ``kept_spans`` (one dict per prompt segment; passage spans carry
    the document ids) and ``response_metadata`` (timings, keep ratio, counts).
    ``stream`` yields the same keys as partial dicts, ``answer`` a text delta at a time.
    ``instructions`` is the system text (default: the engine's RAG instructions).
    """

    def answer(inputs: dict[str, Any], config: RunnableConfig) -> Iterator[AddableDict]:
        documents = _with_ids(list(inputs["documents"]))
        yield AddableDict(question=inputs["question"], documents=documents, answer="")
        messages: list[BaseMessage] = [HumanMessage(inputs["question"])]
        if instructions:
            messages.insert(0, SystemMessage(instructions))
        final: AIMessageChunk | None = None
        for chunk in llm.stream(messages, config, passages=documents):
            if chunk.text:
                yield AddableDict(answer=chunk.text)
            if chunk.chunk_position == "last":
                final = chunk
        if final is None:
            raise RuntimeError("the chat model stream ended without its final chunk")
        metadata = dict(final.response_metadata)
        yield AddableDict(kept_spans=metadata.pop("kept_spans"), response_metadata=metadata)

    retrieve = RunnableParallel(
        question=RunnableLambda(_question),
        documents=RunnableLambda(_question) | retriever,
    )
    chain = (retrieve | RunnableLambda(answer)).with_config(run_name="specprefill_rag")
    return cast("Runnable[str | dict[str, Any], dict[str, Any]]", chain)  # invoke merges the streamed dicts
