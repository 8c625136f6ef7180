"""Chat messages and retrieved documents → prompt segments: the one place segments are built.

The engine (a question and its passages), the gateway (OpenAI messages) and both integrations
(LangChain messages and documents, LlamaIndex chat messages and query-engine context) build
their segments here:

* ``build_segments``: the instructions, the passages in order, then the question;
* ``chat_segments``: a chat given as (role, text) turns: system turns are the instructions, the
  last user turn is the question, every earlier user or assistant turn a history segment (its own
  chat message, so turn k's prompt begins with turn k − 1's conversation), the passages in the
  last user message;
* ``as_passages`` / ``passage_segments``: what counts as a passage (a ``Passage`` or a str), and
  its segment (a passage without an id gets its number);
* ``split_documents``: documents joined by blank lines (LangChain's separator, LlamaIndex's
  ``context_str``) back into passages.

Rendering segments with a chat template into token ids is ``render``'s job.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import cast

from ..errors import InputError, InputTypeError
from ..types import Passage, Segment, SegmentKind

__all__ = [
    "Passages",
    "as_passages",
    "build_segments",
    "chat_segments",
    "passage_segments",
    "request_segments",
    "split_documents",
]

_ROLE_NAMES = {"tool": "Tool", "function": "Function"}
_CHAT_ROLES = {"user": "user", "human": "user", "assistant": "assistant", "ai": "assistant"}
# A blank line: what joins documents (LangChain's default separator, LlamaIndex's context_str).
_BLANK_LINE = re.compile(r"\n[ \t]*\n")


Passages = Sequence[Passage | str] | Passage | str


def as_passages(passages: Passages) -> list[Passage]:
    """``passages`` as a list of ``Passage``; one ``str`` or ``Passage`` alone is one passage.

    Anything else (a dict, bytes, a retriever's node object) raises ``InputTypeError``: it
    would otherwise be read as text character by character, or key by key.
    """
    if isinstance(passages, (str, Passage)):
        passages = [passages]
    elif isinstance(passages, (bytes, Mapping)) or not isinstance(passages, Iterable):
        raise InputTypeError(
            f"passages must be a list of Passage or str (or one str), got {type(passages).__name__}"
        )
    items: list[Passage] = []
    for n, item in enumerate(passages):
        if isinstance(item, Passage) and isinstance(item.text, str):
            items.append(item)
        elif isinstance(item, str):
            items.append(Passage(text=item))
        else:
            shown = type(item.text if isinstance(item, Passage) else item).__name__
            raise InputTypeError(f"passage {n} must be a Passage (with str text) or a str, got {shown}")
    return items


def passage_segments(passages: Passages) -> list[Segment]:
    """One prunable segment per non-empty passage; a passage without an id gets its number."""
    return [
        Segment(SegmentKind.PASSAGE, p.text.strip(), p.id if p.id is not None else str(number), p.metadata)
        for number, p in enumerate(as_passages(passages), start=1)
        if p.text.strip()
    ]


def _question(text: object, what: str = "the question") -> str:
    if not isinstance(text, str):
        raise InputTypeError(f"{what} must be a str, got {type(text).__name__}")
    if not text.strip():
        raise InputError(f"{what} is empty: pass the user's question as a non-empty string")
    return text.strip()


def build_segments(question: str, passages: Passages, instructions: str | None = None) -> tuple[Segment, ...]:
    """The segments of a RAG prompt: instructions, passages in order, then the question."""
    question = _question(question)
    context = passage_segments(passages)
    if not context:
        raise InputError(
            "the context is empty: pass at least one non-empty passage "
            "(did the retriever return nothing?)"
        )
    segments: list[Segment] = []
    if instructions and instructions.strip():
        segments.append(Segment(SegmentKind.INSTRUCTIONS, instructions.strip()))
    return (*segments, *context, Segment(SegmentKind.QUESTION, question))


def request_segments(question: str | Sequence[Segment], passages: Passages = (), instructions: str | None = None,
                     *, default_instructions: str = "") -> tuple[Segment, ...]:
    """The segments of one request: a question str with its passages and ``instructions``
    (``default_instructions`` when None) by ``build_segments``, or a list of ``Segment`` taken as
    is (then neither passages nor instructions may be given)."""
    if isinstance(question, str):
        return build_segments(question, passages, default_instructions if instructions is None else instructions)
    if not isinstance(question, Sequence):
        raise InputTypeError(f"the question must be a str (or a list of Segment), got {type(question).__name__}")
    if passages or instructions is not None:
        raise InputError("pass either segments, or a question with passages and instructions")
    segments = tuple(question)
    if not all(isinstance(s, Segment) for s in segments):
        raise InputError("a prompt given as a list must hold Segment objects; pass a question str otherwise")
    return cast("tuple[Segment, ...]", segments)


def chat_segments(
    turns: Sequence[tuple[str, str]],
    passages: Passages = (),
    *,
    instructions: str | None = None,
) -> tuple[Segment, ...]:
    """Segments for a chat given as (role, text) turns, oldest first.

    System turns become the instructions (else ``instructions``); the last user turn is the
    protected question. Every other user or assistant turn becomes a history segment with id
    ``turn-<i>``, rendered as the chat message it was (``render.render``), so the prompt of turn
    k begins with the conversation of turn k − 1 and vLLM's prefix cache holds it; history is
    protected unless ``SelectionConfig.protect_history`` is False. Turns of other roles (a tool's
    output) become prunable context "Tool: ..." in the last user message, before the passages.
    Roles: "system", "user"/"human", "assistant"/"ai", others as named.
    """
    if not turns:
        raise InputError("no messages: pass at least one message with the question")
    for n, turn in enumerate(turns):
        if not (isinstance(turn, tuple) and len(turn) == 2 and all(isinstance(x, str) for x in turn)):
            raise InputTypeError(f"message {n} must be a (role, text) pair of str, got {turn!r:.80}")
    system = [text.strip() for role, text in turns if role == "system" and text.strip()]
    history = [(role, text) for role, text in turns if role != "system"]
    if not history:
        raise InputError("only system messages were given: add a user message with the question")
    users = [i for i, (role, _) in enumerate(history) if role in ("user", "human")]
    question_at = users[-1] if users else len(history) - 1
    question = _question(history[question_at][1], "the last user message")
    segments: list[Segment] = []
    joined = "\n\n".join(system) or instructions
    if joined:
        segments.append(Segment(SegmentKind.INSTRUCTIONS, joined))
    others: list[Segment] = []
    for i, (role, text) in enumerate(history):
        if i == question_at or not text.strip():
            continue
        chat_role = _CHAT_ROLES.get(role)
        if chat_role is not None:
            segments.append(Segment(SegmentKind.HISTORY, text.strip(), f"turn-{i}", role=chat_role))
        else:
            name = _ROLE_NAMES.get(role, role.capitalize())
            others.append(Segment(SegmentKind.CONTEXT, f"{name}: {text.strip()}", f"turn-{i}"))
    segments.extend(others)
    segments.extend(passage_segments(passages))
    segments.append(Segment(SegmentKind.QUESTION, question))
    return tuple(segments)


def split_documents(text: str, limit: int | None = None) -> list[Passage]:
    """Documents joined by blank lines (LangChain's default separator, LlamaIndex's context_str).

    ``limit``: at most this many passages; more pieces are joined back, consecutive ones together
    in groups of equal count, so no text is lost and a message of a million blank lines costs no
    more objects than the limit (the gateway's bound on client text)."""
    parts = [part.strip() for part in _BLANK_LINE.split(text)]
    parts = [part for part in parts if part]
    if limit is not None and len(parts) > limit:
        size = -(-len(parts) // limit)
        parts = ["\n\n".join(parts[i:i + size]) for i in range(0, len(parts), size)]
    return [Passage(part) for part in parts]
