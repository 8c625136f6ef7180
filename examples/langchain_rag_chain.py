"""A LangChain (LCEL) RAG chain whose chat model prefills with SpecPrefill.

Puts the bundled station handbook in an ``InMemoryVectorStore`` (embedded offline with the
packaged all-MiniLM-L6-v2), builds ``create_specprefill_rag_chain(retriever, ChatSpecPrefill(...))``
— which hands the retrieved ``Document``s to the model as separate passages, not one pasted
string — streams the answer, and prints what the draft kept of each document. Needs the
integration package (``pip install -e integrations/langchain-specprefill``). From the
repository root::

    .venv/bin/python examples/langchain_rag_chain.py
    .venv/bin/python examples/langchain_rag_chain.py --models qwen --question "..."
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from langchain_core.documents import Document  # noqa: E402
from langchain_core.vectorstores import InMemoryVectorStore  # noqa: E402
from langchain_specprefill import ChatSpecPrefill, MiniLMEmbeddings, create_specprefill_rag_chain  # noqa: E402

from specprefill_rag.loading import MODEL_PAIRS  # noqa: E402
from specprefill_rag.tools.retrieval import demo_documents, split_passages  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--question", default="On what date was Tindra Point Research Station officially opened?")
    parser.add_argument("--models", choices=sorted(MODEL_PAIRS), default="smollm2")
    parser.add_argument("--keep-rate", type=float, default=0.3)
    parser.add_argument("--top-k", type=int, default=4)
    args = parser.parse_args()

    store = InMemoryVectorStore(MiniLMEmbeddings())
    passages = split_passages(demo_documents())
    store.add_documents([Document(p.text, id=p.id, metadata=dict(p.metadata)) for p in passages])
    main_model, draft_model = MODEL_PAIRS[args.models]
    llm = ChatSpecPrefill(model=main_model, draft_model=draft_model, keep_rate=args.keep_rate, max_tokens=64)
    chain = create_specprefill_rag_chain(store.as_retriever(search_kwargs={"k": args.top_k}), llm)

    print(f"Q: {args.question}\nA: ", end="", flush=True)
    result: dict = {}
    for part in chain.stream({"question": args.question}):  # partial dicts; "answer" arrives as deltas
        if part.get("answer"):
            print(part["answer"], end="", flush=True)
        result.update({k: v for k, v in part.items() if k != "answer"})
    print()

    meta = result["response_metadata"]
    t = meta["timings"]
    print(f"TTFT {t['ttft_s']:.2f} s (draft {t['draft_s'] or 0:.2f} s + main prefill {t['prefill_s']:.2f} s), "
          f"prefilled {meta['prefilled_tokens']}/{meta['prompt_tokens']} tokens ({meta['keep_ratio']:.0%})")
    for span in result["kept_spans"]:
        if span["kind"] == "passage":  # one per retrieved Document, named by its id
            print(f"  {span['id']:<28} kept {span['n_kept']:4d}/{span['n_tokens']:<4d} tokens")


if __name__ == "__main__":
    main()
