"""A LlamaIndex query engine whose LLM prefills with SpecPrefill.

Indexes the bundled station handbook in a ``VectorStoreIndex`` (embedded offline with the
packaged all-MiniLM-L6-v2), asks one question through ``index.as_query_engine(llm=...)``,
streams the answer, and prints what the draft kept of each retrieved node. Needs the
integration package (``pip install -e integrations/llama-index-llms-specprefill``). From the
repository root::

    .venv/bin/python examples/llamaindex_query_engine.py
    .venv/bin/python examples/llamaindex_query_engine.py --models qwen --question "..."
"""

from __future__ import annotations

import argparse
import os
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from llama_index.core import Document, VectorStoreIndex  # noqa: E402
from llama_index.core.base.response.schema import StreamingResponse  # noqa: E402
from llama_index.core.instrumentation import get_dispatcher  # noqa: E402
from llama_index.core.instrumentation.event_handlers import BaseEventHandler  # noqa: E402
from llama_index.core.instrumentation.events.llm import LLMCompletionEndEvent  # noqa: E402
from llama_index.core.node_parser import SentenceSplitter  # noqa: E402
from llama_index.llms.specprefill import MiniLMEmbedding, PassageIdPostprocessor, SpecPrefillLLM  # noqa: E402

from specprefill_rag.loading import MODEL_PAIRS  # noqa: E402
from specprefill_rag.tools.retrieval import demo_documents  # noqa: E402


class LastCompletion(BaseEventHandler):
    """Keeps the last completion the instrumentation reports: its additional_kwargs hold
    SpecPrefill's timings, keep ratio and kept spans (one per retrieved node)."""

    response: Any = None

    def handle(self, event: Any, **kwargs: Any) -> None:
        if isinstance(event, LLMCompletionEndEvent):
            self.response = event.response


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--question", default="On what date was Tindra Point Research Station officially opened?")
    parser.add_argument("--models", choices=sorted(MODEL_PAIRS), default="smollm2")
    parser.add_argument("--keep-rate", type=float, default=0.3)
    parser.add_argument("--top-k", type=int, default=4)
    args = parser.parse_args()

    documents = [Document(text=d.text, metadata={"source": d.source}) for d in demo_documents()]
    index = VectorStoreIndex.from_documents(
        documents, embed_model=MiniLMEmbedding(), transformations=[SentenceSplitter(chunk_size=200, chunk_overlap=0)]
    )
    main_model, draft_model = MODEL_PAIRS[args.models]
    llm = SpecPrefillLLM(model_name=main_model, draft_model=draft_model, keep_rate=args.keep_rate, max_new_tokens=64)
    query_engine = index.as_query_engine(
        llm=llm,
        similarity_top_k=args.top_k,
        streaming=True,
        # Marks where each node starts in the context, so every node reaches the engine as its
        # own prunable passage (and the question stays protected).
        node_postprocessors=[PassageIdPostprocessor()],
    )

    last = LastCompletion()
    get_dispatcher().add_event_handler(last)

    print(f"Q: {args.question}\nA: ", end="", flush=True)
    response = query_engine.query(args.question)
    assert isinstance(response, StreamingResponse)  # streaming=True
    for token in response.response_gen:
        print(token, end="", flush=True)
    print()

    info = last.response.additional_kwargs
    t = info["timings"]
    print(f"TTFT {t['ttft_s']:.2f} s (draft {t['draft_s'] or 0:.2f} s + main prefill {t['prefill_s']:.2f} s), "
          f"prefilled {info['prefilled_tokens']}/{info['prompt_tokens']} tokens ({info['keep_ratio']:.0%})")
    spans = [s for s in info["kept_spans"] if s["kind"] == "passage"]
    for node, span in zip(response.source_nodes, spans, strict=False):
        print(f"  {node.node.metadata['source']:<26} kept {span['n_kept']:4d}/{span['n_tokens']:<4d} tokens")

if __name__ == "__main__":
    main()
