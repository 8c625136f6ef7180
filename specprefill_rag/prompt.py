"""Segments → chat-templated text → token ids with segment map, protected mask and offsets.

The user message is laid out as::

    Context:
    [1]
    <passage 1>

    [2]
    <passage 2>

    Question: <question>

Passage headers, separators and the chat template's own text are *template* tokens
(segment index -1) and are always kept; so are the question, the instructions (by default)
and the last few tokens. Only passage/context text is prunable.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from .types import AssembledPrompt, Passage, Segment, SegmentKind

__all__ = ["assemble", "build_segments", "chat_segments", "render", "sentence_breaks"]

# A sentence ends after . ! or ? (and any closing quotes or brackets) followed by white space,
# or at a line break. The white space belongs to the next sentence, as tokenizers attach it.
_SENTENCE_END = re.compile(r"[.!?][\"'\u201d\u2019)\]]*(?=\s)|\n+")

_ROLE_NAMES = {"user": "User", "human": "User", "assistant": "Assistant", "ai": "Assistant", "tool": "Tool"}


def build_segments(
    question: str, passages: Sequence[Passage | str], instructions: str | None = None
) -> tuple[Segment, ...]:
    """The segments of a RAG prompt: instructions, passages in order, then the question."""
    if not isinstance(question, str) or not question.strip():
        raise ValueError("the question is empty: pass the user's question as a non-empty string")
    items = [p if isinstance(p, Passage) else Passage(text=p) for p in passages]
    if not any(p.text.strip() for p in items):
        raise ValueError(
            "the context is empty: pass at least one non-empty passage "
            "(did the retriever return nothing?)"
        )
    segments: list[Segment] = []
    if instructions and instructions.strip():
        segments.append(Segment(SegmentKind.INSTRUCTIONS, instructions.strip()))
    for number, p in enumerate(items, start=1):
        if p.text.strip():
            pid = p.id if p.id is not None else str(number)
            segments.append(Segment(SegmentKind.PASSAGE, p.text.strip(), pid, p.metadata))
    segments.append(Segment(SegmentKind.QUESTION, question.strip()))
    return tuple(segments)


def chat_segments(
    turns: Sequence[tuple[str, str]],
    passages: Sequence[Passage | str] = (),
    *,
    instructions: str | None = None,
) -> tuple[Segment, ...]:
    """Segments for a chat given as (role, text) turns, oldest first.

    System turns become the instructions (else ``instructions``); the last user turn is the
    protected question; every other turn becomes a prunable context segment "User: ..." /
    "Assistant: ..." with id ``turn-<i>`` (a long history is what SpecPrefill trims); passages
    follow the history. Roles: "system", "user"/"human", "assistant"/"ai", others as named.
    """
    if not turns:
        raise ValueError("no messages: pass at least one message with the question")
    system = [text.strip() for role, text in turns if role == "system" and text.strip()]
    history = [(role, text) for role, text in turns if role != "system"]
    if not history:
        raise ValueError("only system messages were given: add a user message with the question")
    users = [i for i, (role, _) in enumerate(history) if role in ("user", "human")]
    question_at = users[-1] if users else len(history) - 1
    question = history[question_at][1].strip()
    if not question:
        raise ValueError("the last user message is empty: pass the user's question as text")
    segments: list[Segment] = []
    joined = "\n\n".join(system) or instructions
    if joined:
        segments.append(Segment(SegmentKind.INSTRUCTIONS, joined))
    for i, (role, text) in enumerate(history):
        if i != question_at and text.strip():
            name = _ROLE_NAMES.get(role, role.capitalize())
            segments.append(Segment(SegmentKind.CONTEXT, f"{name}: {text.strip()}", f"turn-{i}"))
    for number, item in enumerate(passages, start=1):
        p = item if isinstance(item, Passage) else Passage(text=item)
        if p.text.strip():
            pid = p.id if p.id is not None else str(number)
            segments.append(Segment(SegmentKind.PASSAGE, p.text.strip(), pid, p.metadata))
    segments.append(Segment(SegmentKind.QUESTION, question))
    return tuple(segments)


def _user_content(segments: Sequence[Segment]) -> tuple[str, list[tuple[int, int, int]]]:
    """User message text and (segment index, start, end) character spans inside it."""
    parts: list[str] = []
    spans: list[tuple[int, int, int]] = []
    length = 0

    def add(text: str, segment: int | None = None) -> None:
        nonlocal length
        if segment is not None:
            spans.append((segment, length, length + len(text)))
        parts.append(text)
        length += len(text)

    context = [i for i, s in enumerate(segments) if s.prunable]
    if context:
        add("Context:\n")
        for number, i in enumerate(context, start=1):
            if segments[i].kind is SegmentKind.PASSAGE:
                add(f"[{number}]\n")
            add(segments[i].text, i)
            add("\n\n")
    for i, s in enumerate(segments):
        if s.kind is SegmentKind.QUESTION:
            add("Question: ")
            add(s.text, i)
    return "".join(parts).rstrip("\n"), spans


def render(tokenizer: Any, segments: Sequence[Segment]) -> tuple[str, list[tuple[int, int, int]], bool]:
    """Full prompt text, segment character spans in it, and whether a chat template was used."""
    user, user_spans = _user_content(segments)
    system = "\n\n".join(s.text for s in segments if s.kind is SegmentKind.INSTRUCTIONS)
    system_index = [i for i, s in enumerate(segments) if s.kind is SegmentKind.INSTRUCTIONS]
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": user}]
        if system:
            messages.insert(0, {"role": "system", "content": system})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        chat = True
    else:
        text = f"{system}\n\n{user}\nAnswer:" if system else f"{user}\nAnswer:"
        chat = False
    spans: list[tuple[int, int, int]] = []
    if system:
        at = text.find(system)
        if at < 0:
            raise ValueError("the chat template rewrote the instructions; cannot locate them")
        # Several instruction segments are joined; only the first gets a precise span.
        spans.append((system_index[0], at, at + len(system)))
    at = text.find(user)
    if at < 0:
        raise ValueError("the chat template rewrote the user message; cannot locate segments")
    spans.extend((i, at + a, at + b) for i, a, b in user_spans)
    return text, spans, chat


def sentence_breaks(text: str, start: int = 0, end: int | None = None) -> list[int]:
    """Character positions in ``text[start:end]`` where a new sentence begins (``start`` included)."""
    end = len(text) if end is None else end
    breaks = [start]
    breaks.extend(m.end() for m in _SENTENCE_END.finditer(text, start, end) if m.end() < end)
    return breaks


def _sentence_starts(
    text: str, starts: torch.Tensor, spans: Sequence[tuple[int, int, int]], segments: Sequence[Segment]
) -> torch.Tensor:
    """(n,) bool: True for the first token of each sentence of a prunable segment."""
    breaks = sorted(b for i, a, e in spans if segments[i].prunable for b in sentence_breaks(text, a, e))
    sentence = torch.searchsorted(torch.tensor(breaks, dtype=torch.int64), starts.contiguous(), right=True)
    out = torch.ones_like(starts, dtype=torch.bool)
    out[1:] = sentence[1:] != sentence[:-1]
    return out


def assemble(
    tokenizer: Any,
    segments: Sequence[Segment],
    *,
    protect_instructions: bool = True,
    protect_tail_tokens: int = 8,
) -> AssembledPrompt:
    """Render ``segments`` with the tokenizer's chat template and tokenize with bookkeeping.

    Needs a fast tokenizer (character offsets). Template tokens, the question, the
    instructions (unless ``protect_instructions`` is False) and the last
    ``protect_tail_tokens`` tokens are marked protected.
    """
    segments = tuple(segments)
    if not any(s.text.strip() for s in segments):
        raise ValueError("the prompt is empty: pass a question and at least one passage")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"{type(tokenizer).__name__} is a slow tokenizer without character offsets; "
            "load the fast one (AutoTokenizer.from_pretrained(..., use_fast=True))"
        )
    text, spans, chat = render(tokenizer, segments)
    encoded = tokenizer(text, add_special_tokens=not chat, return_offsets_mapping=True)
    token_ids = torch.tensor(encoded["input_ids"], dtype=torch.int64)
    offsets = torch.tensor(encoded["offset_mapping"], dtype=torch.int64).reshape(-1, 2)
    starts, ends = offsets[:, 0], offsets[:, 1]
    # A token such as " what" starts on the space before a segment's first character: it
    # belongs to the segment by its visible text (pure white space keeps its own start).
    lead = torch.tensor([len(t) - len(t.lstrip()) for t in (text[a:b] for a, b in offsets.tolist())])
    visible = torch.where(starts + lead < ends, starts + lead, starts)
    segment_index = torch.full_like(token_ids, -1)
    for index, a, b in spans:
        inside = (visible >= a) & (ends <= b) & (ends > starts)
        segment_index[inside] = index
    protected = segment_index < 0
    for index, segment in enumerate(segments):
        keep = segment.kind is SegmentKind.QUESTION or (
            segment.kind is SegmentKind.INSTRUCTIONS and protect_instructions
        )
        if keep:
            protected |= segment_index == index
    if protect_tail_tokens:
        protected[-protect_tail_tokens:] = True
    return AssembledPrompt(
        text=text,
        token_ids=token_ids,
        segment_index=segment_index,
        protected=protected,
        offsets=offsets,
        segments=segments,
        segment_spans=tuple(spans),
        sentence_start=_sentence_starts(text, starts, spans, segments),
    )
