"""The chat session both example apps share: documents → retriever → SpecPrefill engine → answers.

Everything an app needs besides its user interface lives here, so the web app and the
terminal chat behave the same: which model pairs are offered, how uploaded files become
documents (with size limits and readable errors), how a follow-up question is put in context,
and how the kept token positions of an answer map back to character spans of each passage.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specprefill_rag import (
    AssembledPrompt,
    GenerationConfig,
    GenerationResult,
    Passage,
    PrefillPlan,
    Segment,
    SegmentKind,
    SelectionConfig,
    SpecPrefillConfig,
    SpecPrefillEngine,
    TextStream,
    available_backends,
)
from specprefill_rag import prompt as prompt_lib
from specprefill_rag.loading import MODEL_PAIRS as MODEL_PAIRS_BY_NAME
from specprefill_rag.prompt import chat_segments
from specprefill_rag.tools.retrieval import Document, Retriever, demo_documents, split_passages

__all__ = [
    "MODEL_PAIRS",
    "Answer",
    "ChatSession",
    "ModelPair",
    "PassageView",
    "PendingAnswer",
    "Turn",
    "build_engine",
    "build_retriever",
    "format_timing",
    "load_uploads",
    "passage_views",
]

logger = logging.getLogger(__name__)

INSTRUCTIONS = (
    "You answer questions about the documents in the context. "
    "Answer in one or two short sentences, using only the context."
)
UPLOAD_SUFFIXES = (".md", ".txt", ".pdf")
MAX_UPLOAD_MB = 2.0  # total size of one upload (all files), megabytes
MAX_DOCUMENT_CHARS = 400_000  # text extracted from one upload; more takes minutes to embed on CPU


@dataclass(frozen=True)
class ModelPair:
    """A draft and a main model that share one tokenizer."""

    key: str
    main: str
    draft: str
    label: str


MODEL_PAIRS: dict[str, ModelPair] = {
    pair.key: pair
    for pair in (
        ModelPair("smollm2", *MODEL_PAIRS_BY_NAME["smollm2"], "SmolLM2-135M as draft and main (fast on CPU)"),
        ModelPair("qwen", *MODEL_PAIRS_BY_NAME["qwen"],
                  "Qwen2.5-Coder 0.5B draft → 1.5B main (real speedup, slow on CPU)"),
    )
}


@dataclass(frozen=True)
class Turn:
    """One finished exchange of the conversation."""

    question: str
    answer: str


@dataclass(frozen=True)
class PassageView:
    """One retrieved passage with its text cut into kept and dropped pieces."""

    rank: int  # retrieval rank, 1-based
    id: str | None
    n_tokens: int
    n_kept: int
    pieces: tuple[tuple[str, bool], ...]  # (text, kept) runs covering the passage text in order

    @property
    def keep_ratio(self) -> float:
        return self.n_kept / self.n_tokens if self.n_tokens else 1.0


@dataclass(frozen=True)
class PendingAnswer:
    """A question being answered: what was retrieved and the assembled prompt."""

    question: str  # as the user typed it
    segments: tuple[Segment, ...]  # what the model sees: instructions, earlier turns as chat, passages, question
    passages: tuple[Passage, ...]
    prompt: AssembledPrompt


@dataclass(frozen=True)
class Answer:
    """A finished answer with everything the apps show about it."""

    question: str
    passages: tuple[Passage, ...]
    prompt: AssembledPrompt
    result: GenerationResult
    full: GenerationResult | None = None  # full-prefill baseline (TTFT only), when asked for

    @property
    def views(self) -> list[PassageView]:
        return passage_views(self.prompt, self.result.plan)


# --------------------------------------------------------------------------- engine


def build_engine(
    pair: ModelPair,
    *,
    backend: str = "transformers",
    server_url: str | None = None,
    config: SpecPrefillConfig | None = None,
) -> SpecPrefillEngine:
    """An engine for ``pair`` on ``backend``; one set of weights when draft and main are the same.

    Raises ``ValueError`` with a readable message when the backend is not installed.
    """
    config = config or SpecPrefillConfig(instructions=INSTRUCTIONS)
    if backend not in available_backends():
        raise ValueError(
            f"the backend {backend!r} is not available in this installation "
            f"(available: {', '.join(available_backends())})"
        )
    kwargs: dict[str, Any] = {}
    if backend != "transformers":
        if not server_url or not server_url.strip():
            raise ValueError(f"the {backend!r} backend needs a server URL, e.g. http://127.0.0.1:8000")
        kwargs["base_url"] = server_url.strip()
    # Draft == main on transformers: from_pretrained loads one set of weights for both roles.
    return SpecPrefillEngine.from_pretrained(pair.main, pair.draft, backend=backend, config=config, **kwargs)


# --------------------------------------------------------------------------- documents


def _read_pdf(path: Path) -> str:
    try:
        from pypdf import PdfReader
    except ImportError:
        raise ValueError(f"{path.name}: reading PDF needs pypdf (pip install pypdf)") from None
    try:
        return "\n\n".join(page.extract_text() or "" for page in PdfReader(path).pages)
    except Exception as error:  # pypdf raises many types for broken files
        raise ValueError(f"{path.name}: not a readable PDF ({error})") from None


def load_uploads(paths: Sequence[str | os.PathLike[str]], *, max_mb: float = MAX_UPLOAD_MB) -> list[Document]:
    """Uploaded ``.txt``/``.md``/``.pdf`` files as documents; every problem is a ``ValueError``."""
    files = [Path(p) for p in paths]
    if not files:
        raise ValueError("no documents: upload .txt, .md or .pdf files, or use the bundled handbook")
    total = sum(f.stat().st_size for f in files)
    if total > max_mb * 1e6:
        raise ValueError(
            f"the upload is too large: {total / 1e6:.1f} MB, the limit is {max_mb:g} MB "
            "(embedding runs on CPU); upload fewer or smaller files"
        )
    documents, chars = [], 0
    for file in files:
        suffix = file.suffix.lower()
        if suffix not in UPLOAD_SUFFIXES:
            raise ValueError(f"{file.name}: unsupported file type; upload {', '.join(UPLOAD_SUFFIXES)} files")
        text = _read_pdf(file) if suffix == ".pdf" else file.read_text(encoding="utf-8", errors="replace")
        text = text.replace("\r\n", "\n").strip()
        if not text:
            continue
        chars += len(text)
        if chars > MAX_DOCUMENT_CHARS:
            raise ValueError(
                f"the upload has more than {MAX_DOCUMENT_CHARS:,} characters of text; "
                "upload fewer or smaller files"
            )
        documents.append(Document(text=text, source=file.name, metadata={"title": file.stem}))
    if not documents:
        raise ValueError("no documents: the uploaded files contain no text")
    return documents


def build_retriever(documents: Sequence[Document] | None = None) -> Retriever:
    """A retriever over ``documents`` (default: the bundled station handbook)."""
    documents = list(documents) if documents is not None else demo_documents()
    passages = split_passages(documents)
    if not passages:
        raise ValueError("no documents: the documents contain no text")
    return Retriever(passages)


# --------------------------------------------------------------------------- kept spans


def passage_views(prompt: AssembledPrompt, plan: PrefillPlan) -> list[PassageView]:
    """Each passage's text cut into kept / dropped runs (``prompt.kept_runs`` in the core);
    only passage text, never the chat template around it nor the chat's earlier turns."""
    runs = prompt_lib.kept_runs(prompt, plan)
    views: list[PassageView] = []
    for span in plan.kept_spans:
        if span.segment_index in runs and span.kind in (SegmentKind.PASSAGE, SegmentKind.CONTEXT):
            views.append(PassageView(len(views) + 1, span.id, span.n_tokens, span.n_kept, runs[span.segment_index]))
    return views


def format_timing(answer: Answer) -> str:
    """One line: TTFT with SpecPrefill (and full prefill when measured), keep ratio, tokens."""
    r, t = answer.result, answer.result.timings
    line = f"TTFT {t.ttft_s:.2f} s"
    if t.draft_s is not None:
        line += f" (draft {t.draft_s:.2f} s + main prefill {t.prefill_s:.2f} s)"
    if answer.full is not None:
        full = answer.full.timings.ttft_s
        line += f" | full prefill TTFT {full:.2f} s ({full / t.ttft_s:.2f}x)"
    line += f" | kept {r.prefilled_tokens}/{r.prompt_tokens} tokens ({r.keep_ratio:.0%})"
    if t.decode_tokens_per_s:
        line += f" | {t.decode_tokens_per_s:.1f} tok/s"
    return line


# --------------------------------------------------------------------------- session


class ChatSession:
    """A multi-turn RAG chat: retrieve for each question, answer with SpecPrefill, keep history.

    A follow-up is retrieved with the previous question appended (so "and who built it?"
    finds the same passages). The last ``history_turns`` exchanges go before it as the chat
    messages they were (``chat_segments``: protected history, rendered with the model's chat
    template), so turn k's prompt begins with turn k − 1's conversation: vLLM's prefix cache and
    the draft's prefix store serve it instead of reading it again.
    """

    def __init__(
        self,
        engine: SpecPrefillEngine,
        retriever: Retriever,
        *,
        keep_rate: float = 0.2,
        top_k: int = 6,
        max_new_tokens: int = 96,
        history_turns: int = 1,
    ) -> None:
        SelectionConfig(keep_rate=keep_rate)  # validates
        self.engine = engine
        self.retriever = retriever
        self.keep_rate = keep_rate
        self.top_k = top_k
        self.max_new_tokens = max_new_tokens
        self.history_turns = history_turns
        self.history: list[Turn] = []

    def set_keep_rate(self, keep_rate: float) -> None:
        SelectionConfig(keep_rate=keep_rate)  # raises "keep_rate must be in (0, 1]"
        self.keep_rate = keep_rate

    def _contextualize(self, question: str, history: Sequence[Turn]) -> tuple[str, list[tuple[str, str]]]:
        """(retrieval query, chat messages) for ``question`` after ``history``: the last
        ``history_turns`` exchanges as user and assistant messages, then the question."""
        recent = list(history)[-self.history_turns :] if self.history_turns else []
        messages = [m for t in recent for m in (("user", t.question), ("assistant", t.answer))]
        messages.append(("user", question))
        if not recent:
            return question, messages
        return f"{question} {' '.join(t.question for t in recent)}", messages

    def ask(self, question: str, history: Sequence[Turn] | None = None) -> tuple[TextStream, PendingAnswer]:
        """Start answering; iterate the stream for text, then call ``finish(stream, answer)``.

        Bad input (empty question, no passages, prompt too long) raises ``ValueError`` here.
        """
        question = question.strip() if isinstance(question, str) else ""
        if not question:
            raise ValueError("the question is empty: type a question first")
        history = self.history if history is None else history
        query, messages = self._contextualize(question, history)
        passages = tuple(self.retriever.retrieve(query, top_k=self.top_k))
        segments = chat_segments(messages, passages, instructions=self.engine.config.instructions)
        prompt = self.engine.assemble(segments)
        generation = dataclasses.replace(self.engine.config.generation, max_new_tokens=self.max_new_tokens)
        stream = self.engine.stream(segments, keep_rate=self.keep_rate, generation=generation)
        return stream, PendingAnswer(question, segments, passages, prompt)

    def finish(self, stream: TextStream, pending: PendingAnswer, *, compare_full: bool = False) -> Answer:
        """The finished answer (after the stream ended), optionally with a full-prefill TTFT."""
        if stream.result is None:
            raise RuntimeError("finish() was called before the stream ended")
        full = None
        if compare_full:
            # TTFT is all the comparison needs: one token of the same prompt, fully prefilled.
            full = self.engine.generate(pending.segments, mode="full", generation=GenerationConfig(max_new_tokens=1))
        self.history.append(Turn(pending.question, stream.result.text))
        return Answer(pending.question, pending.passages, pending.prompt, stream.result, full)

    def answer(self, question: str, *, compare_full: bool = False) -> Iterator[str | Answer]:
        """Convenience: yields text deltas, then the finished ``Answer`` as the last item."""
        stream, pending = self.ask(question)
        yield from stream
        yield self.finish(stream, pending, compare_full=compare_full)

