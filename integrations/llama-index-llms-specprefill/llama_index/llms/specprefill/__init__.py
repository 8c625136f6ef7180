"""LlamaIndex LLM integration for specprefill-rag (Speculative Prefill for RAG)."""

from llama_index.llms.specprefill.base import PassageIdPostprocessor, SpecPrefillLLM, split_context

__all__ = ["PassageIdPostprocessor", "SpecPrefillLLM", "split_context"]
