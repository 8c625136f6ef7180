"""LlamaIndex node postprocessor for specprefill-rag: the draft's selection for any LLM (portable mode)."""

from llama_index.postprocessor.specprefill.base import SpecPrefillNodePostprocessor

__all__ = ["SpecPrefillNodePostprocessor"]
