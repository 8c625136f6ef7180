"""LangChain integration for specprefill-rag: a chat model, a RAG runnable, a document compressor
and the packaged MiniLM embeddings."""

from .chat_models import ChatSpecPrefill, messages_to_segments
from .document_compressors import SpecPrefillCompressor
from .embeddings import MiniLMEmbeddings
from .rag import create_specprefill_rag_chain

__version__ = "0.1.0"

__all__ = [
    "ChatSpecPrefill",
    "MiniLMEmbeddings",
    "SpecPrefillCompressor",
    "__version__",
    "create_specprefill_rag_chain",
    "messages_to_segments",
]
