"""Portable mode in LlamaIndex: the draft compresses the retrieved nodes, any LLM answers.

A query engine over the bundled station handbook (a ``VectorStoreIndex`` embedded offline with
the packaged all-MiniLM-L6-v2) whose retrieved nodes pass through
``SpecPrefillNodePostprocessor`` — the sentences SpecPrefill would prefill for this question,
chosen by the draft in this process — before an unmodified ``OpenAILike`` answers from them on
any OpenAI-compatible server: a stock vLLM without our plugin, a hosted API, Ollama. Prints the
answer and, per source node, its id, retriever score and kept ratio. Needs
``llama-index-llms-openai-like`` and the postprocessor package (the client environment has
both: ``make client-setup``). From the repository root (as a module: it shares the embedder
wrapper of ``examples/llamaindex_query_engine.py``)::

    .venv-client/bin/python -m examples.portable_llamaindex --base-url http://127.0.0.1:8000/v1 --baseline
    .venv-client/bin/python -m examples.portable_llamaindex --base-url ... --scorer qwen2.5-coder-0.5b-instruct
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from llama_index.core import Document, VectorStoreIndex  # noqa: E402
from llama_index.core.node_parser import SentenceSplitter  # noqa: E402
from llama_index.llms.openai_like import OpenAILike  # noqa: E402
from llama_index.llms.specprefill import MiniLMEmbedding  # noqa: E402
from llama_index.postprocessor.specprefill import SpecPrefillNodePostprocessor  # noqa: E402

from examples.portable_args import parse_args  # noqa: E402
from specprefill_rag.tools.retrieval import demo_documents  # noqa: E402


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv, __doc__.split("\n\n")[0], "nodes")

    documents = [Document(text=d.text, metadata={"source": d.source}) for d in demo_documents()]
    index = VectorStoreIndex.from_documents(
        documents, embed_model=MiniLMEmbedding(), transformations=[SentenceSplitter(chunk_size=200, chunk_overlap=0)]
    )
    llm = OpenAILike(api_base=args.base_url, api_key=args.api_key, model=args.model, is_chat_model=True,
                     temperature=0, max_tokens=args.max_tokens, max_retries=0, timeout=600)
    compressor = SpecPrefillNodePostprocessor(model_name=args.scorer, keep_rate=args.keep_rate)
    engine = index.as_query_engine(llm=llm, similarity_top_k=args.top_k, node_postprocessors=[compressor])

    response = engine.query(args.question)
    print(f"Q: {args.question}\nA: {response}")
    for node in response.source_nodes:
        print(f"  {node.node.metadata['source']:<26} {node.node_id[:8]} score {node.score:.3f} "
              f"kept {node.node.metadata['specprefill_keep_ratio']:.0%} of its text")
    result: dict[str, Any] = {"response": response}
    if args.baseline:
        result["baseline"] = index.as_query_engine(llm=llm, similarity_top_k=args.top_k).query(args.question)
        print(f"whole nodes: A: {result['baseline']}")
    return result


if __name__ == "__main__":
    main()
