"""LlamaIndex LLM integration for specprefill-rag (Speculative Prefill for RAG)."""

from llama_index.llms.specprefill.base import SpecPrefillLLM
from llama_index.llms.specprefill.chat import messages_to_segments
from llama_index.llms.specprefill.embeddings import MiniLMEmbedding
from llama_index.llms.specprefill.ingestion import SpecPrefillPassageReader
from llama_index.llms.specprefill.passages import PassageIdPostprocessor, split_context
from llama_index.llms.specprefill.tools import DocumentsTool, tool_result_message

__all__ = [
    "DocumentsTool",
    "MiniLMEmbedding",
    "PassageIdPostprocessor",
    "SpecPrefillLLM",
    "SpecPrefillPassageReader",
    "messages_to_segments",
    "split_context",
    "tool_result_message",
]
