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
  ``context_str``) back into passages, at most a limit of them (read one at a time, never all).

``MAX_SEGMENTS`` bounds what splitting client text may make of one prompt: a text of a million
blank lines must cost time linear in its length and memory bounded by the limit, not a million
objects, so the splitters count before they build, and hold no more than the limit.

Rendering segments with a chat template into token ids is ``render``'s job.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import cast

from ..errors import InputError, InputTypeError
from ..types import Passage, Segment, SegmentKind

__all__ = [
    "MAX_SEGMENTS",
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

# At most this many segments in one prompt built from split text (tool documents, recognised
# passages, tool calls, turns): four times the gateway's per-message limit (``gateway.messages.
# MAX_PARTS``). A real RAG or agent prompt holds tens to hundreds; what a context window can hold
# at a few tokens each stays under it. More is an ``InputError``, found while splitting.
MAX_SEGMENTS = 16_384
_CHUNK = 1 << 16  # characters split at blank lines at a time


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


def _pieces(text: str) -> Iterator[list[str]]:
    """The text between the blank lines of ``text``, a chunk of about ``_CHUNK`` characters at a
    time (cut at a blank line: the stripped pieces are those of the whole text's split), so a text
    of a million blank lines never holds a million pieces at once."""
    at = 0
    while at < len(text):
        gap = _BLANK_LINE.search(text, at + _CHUNK) if at + _CHUNK < len(text) else None
        cut = gap.end() if gap is not None else len(text)
        yield _BLANK_LINE.split(text[at:cut])
        at = cut


def _documents(text: str) -> Iterator[str]:
    """The documents of ``text`` joined by blank lines, stripped, the blank ones skipped."""
    return itertools.chain.from_iterable(filter(None, map(str.strip, pieces)) for pieces in _pieces(text))


def _count_documents(text: str) -> int:
    return sum(sum(map(bool, map(str.strip, pieces))) for pieces in _pieces(text))


def split_documents(text: str, limit: int | None = None) -> list[Passage]:
    """Documents joined by blank lines (LangChain's default separator, LlamaIndex's context_str).

    ``limit``: at most this many passages; more pieces are joined back, consecutive ones together
    in groups of equal count, so no text is lost and a message of a million blank lines costs no
    more objects than the limit (the gateway's bound on client text): the pieces are counted
    first, one at a time, and only ``limit`` of them are ever held."""
    if limit is None:
        return [Passage(part) for part in _documents(text)]
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    count = _count_documents(text)
    if count <= limit:
        return [Passage(part) for part in _documents(text)]
    size = -(-count // limit)
    pieces = _documents(text)
    groups = iter(lambda: list(itertools.islice(pieces, size)), [])
    return [Passage("\n\n".join(group)) for group in groups]
