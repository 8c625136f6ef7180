"""LangChain integration for specprefill-rag: a chat model and a RAG runnable."""

from .chat_models import ChatSpecPrefill, messages_to_segments
from .rag import create_specprefill_rag_chain

__version__ = "0.1.0"

__all__ = [
    "ChatSpecPrefill",
    "__version__",
    "create_specprefill_rag_chain",
    "messages_to_segments",
]
