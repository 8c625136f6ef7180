"""OpenAI messages → prompt segments: what the main model may prune, with no client change.

Rules (docs/gateway.md):

* system (and developer) messages are the instructions: protected;
* the last user message is the question: protected;
* every earlier user or assistant turn is history, rendered as the chat message it was
  (``prompt.chat_segments``), so turn k's prompt begins with turn k − 1's conversation and vLLM's
  prefix cache holds it; kept whole unless ``SelectionConfig.protect_history`` is False;
* retrieved documents are recognised, and become prunable passages, when a message follows a
  known shape: ``<document>`` / ``<context>`` tags, LlamaIndex's default ``text_qa_template``,
  or the prompts LangChain documents for ``create_stuff_documents_chain`` (documents joined by
  blank lines, ``prompt.split_documents``). Anything else stays where the rules above put it: never
  pruned by guesswork.

Pure functions, no web framework: ``to_segments`` is what the gateway calls per request. The
recognition of documents in whole messages is the gateway's alone (the integrations get their
documents as objects); the segments are built by ``specprefill_rag.prompt``.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ..errors import InputError
from ..prompt import MAX_SEGMENTS, chat_segments, split_documents
from ..types import Passage, Segment

__all__ = [
    "DEFAULT_SHAPES",
    "MAX_PARTS",
    "PromptShape",
    "Recognised",
    "recognise",
    "to_segments",
]

Role = Literal["user", "system"]

# At most this many messages, content parts in one message, passages, and documents recognised in
# one message: each becomes objects, template text and selection units, so a megabyte of blank
# lines or empty strings must not become a million of them. Recognised documents beyond it are
# joined back into fewer passages (nothing is lost); the explicit forms get HTTP 400. In all, a
# request makes at most ``MAX_SEGMENTS`` segments (passages, tool documents, calls, turns) and holds
# at most as many content parts (``limits``): more is HTTP 400, found while splitting.
MAX_PARTS = 4096


@dataclass(frozen=True)
class PromptShape:
    """A documented prompt layout: a regular expression over one whole message (stripped).

    Named groups: ``context`` (the documents, joined by blank lines), ``question`` (user
    shapes only: the protected question), and any group whose name starts with
    ``instructions`` (kept, protected, as instructions). Text matched by the literal parts
    (headers, separators, "Answer:") is layout and is dropped: the engine renders its own.
    Keep the pattern linear in the message's length (see the atomic groups below).
    """

    name: str
    role: Role  # which message it applies to: the last user message, or a system message
    pattern: re.Pattern[str]

    def __post_init__(self) -> None:
        groups = set(self.pattern.groupindex)
        if "context" not in groups:
            raise ValueError(f"prompt shape {self.name!r} needs a named group 'context'")
        if self.role == "user" and "question" not in groups:
            raise ValueError(f"user prompt shape {self.name!r} needs a named group 'question'")


def _shape(name: str, role: Role, pattern: str) -> PromptShape:
    return PromptShape(name, role, re.compile(pattern, re.DOTALL))


# The patterns run on whole client messages, so they must stay linear in the message's length
# whatever the text (tests/test_hostile_shapes.py times each on adversarial texts):
# - each part up to a marker is an atomic group ``(?>...)``, matched once (a lazy ``.*?`` takes the
#   marker's first occurrence, a greedy ``.*`` its last) and never retried;
# - every run of whitespace, dashes or tabs is possessive (``*+``, ``++``, ``{5,}+``): never given
#   back one character at a time to a later part that then rescans the rest;
# - a part's text is never followed by ``\s*`` before a marker (a lazy ``.*?`` would rescan the
#   whole run at each of its characters: quadratic); the groups are stripped instead.

# LlamaIndex's DEFAULT_TEXT_QA_PROMPT_TMPL (and its chat and tree-summarize variants):
#   "Context information is below.\n---------------------\n{context_str}\n---------------------\n"
#   "Given the context information and not prior knowledge, answer the query.\nQuery: {query_str}\nAnswer: "
# The sentence before "Query:" is the instruction; customised wordings there still match.
LLAMAINDEX_QA = _shape(
    "llamaindex_qa", "user",
    r"(?>(?P<instructions_head>.*?)Context information (?:from multiple sources )?is below\.[ \t]*+\n-{5,}+[ \t]*+\n)"
    r"(?>(?P<context>.*)\n-{5,}+[ \t]*+\n)(?>(?P<instructions>(?:.*\n)?)Query:[ \t]*+)(?P<question>.*)\nAnswer:",
)
# LangChain hub "rlm/rag-prompt" (LangChain's RAG tutorial), any instruction sentences before it:
#   "You are an assistant for question-answering tasks. ... keep the answer concise.\n"
#   "Question: {question} \nContext: {context} \nAnswer:"
LANGCHAIN_RAG_PROMPT = _shape(
    "langchain_rag_prompt", "user",
    r"(?>(?P<instructions>.*?)(?<![^\n])Question:[ \t]*+)(?>(?P<question>.*?)\nContext:[ \t]*+)"
    r"(?P<context>.*)\nAnswer:",
)
# LangChain's stuff-documents QA prompt (chains/question_answering/stuff_prompt.py, PROMPT).
LANGCHAIN_STUFF_QA = _shape(
    "langchain_stuff", "user",
    r"(?P<instructions>Use the following pieces of context to answer the question at the end\. If you don't know "
    r"the answer, just say that you don't know, don't try to make up an answer\.)\s++"
    r"(?>(?P<context>.*)\n[ \t]*+\nQuestion:[ \t]*+)(?P<question>.*)\nHelpful Answer:",
)
# The system prompt of LangChain's create_retrieval_chain / create_stuff_documents_chain tutorial;
# the question is the human message ("{input}").
LANGCHAIN_RAG_SYSTEM = _shape(
    "langchain_rag_system", "system",
    r"(?P<instructions>You are an assistant for question-answering tasks\. Use the following pieces of retrieved "
    r"context to answer the question\. If you don't know the answer, (?:just )?say that you don't know\. Use three "
    r"sentences maximum and keep the answer concise\.)\s++(?P<context>.+)",
)
# LangChain's stuff-documents chat prompt (chains/question_answering/stuff_prompt.py, CHAT_PROMPT).
LANGCHAIN_STUFF_CHAT = _shape(
    "langchain_stuff_chat", "system",
    r"(?P<instructions>Use the following pieces of context to answer the user's question\.\s*+If you don't know the "
    r"answer, just say that you don't know, don't try to make up an answer\.)[ \t]*+\n-{16}\n(?P<context>.+)",
)

DEFAULT_SHAPES: tuple[PromptShape, ...] = (
    LLAMAINDEX_QA, LANGCHAIN_STUFF_QA, LANGCHAIN_RAG_PROMPT, LANGCHAIN_RAG_SYSTEM, LANGCHAIN_STUFF_CHAT,
)

# Explicit form: <document id="...">...</document> (one passage each, optionally inside
# <documents>...</documents>), or a <context>...</context> block of blank-line-separated documents
# (LangChain hub "langchain-ai/retrieval-qa-chat" uses the latter in its system prompt).
_TAG = re.compile(r"<(?P<close>/?)(?P<name>document|context)(?P<attrs>\s[^<>]{0,200})?>", re.IGNORECASE)
_WRAPPER_OPEN = re.compile(r"<documents\s*>\s*\Z", re.IGNORECASE)
_WRAPPER_CLOSE = re.compile(r"\s*</documents\s*>", re.IGNORECASE)
_ID_ATTR = re.compile(r"""\b(?:id|index)\s*=\s*["']([^"']*)["']""", re.IGNORECASE)


@dataclass(frozen=True)
class _Block:
    start: int  # of the opening tag
    end: int  # after the closing tag
    name: str  # "document" or "context"
    attrs: str
    inner: str


def _blocks(text: str, limit: int = MAX_PARTS) -> list[_Block] | None:
    """The outermost ``<document>`` / ``<context>`` blocks, in one pass over the tags (linear),
    at most ``limit + 1`` of them (the pass stops there: too many).

    Tags inside an open block are data (a retrieved document may quote the tags); a block
    closes at its own matching tag, counted by depth. None when the tags do not pair up (a
    block left open, a stray closing tag): the layout is then ambiguous, retrieved text may
    have made it, and nothing is recognised.
    """
    blocks: list[_Block] = []
    opened: re.Match[str] | None = None
    depth = 0
    for tag in _TAG.finditer(text):
        name = tag.group("name").lower()
        if opened is None:
            if tag.group("close"):
                return None
            opened, depth = tag, 1
        elif name == opened.group("name").lower():
            depth += -1 if tag.group("close") else 1
            if depth == 0:
                inner = text[opened.end():tag.start()]
                blocks.append(_Block(opened.start(), tag.end(), name, opened.group("attrs") or "", inner))
                opened = None
                if len(blocks) > limit:
                    return blocks
    return blocks if opened is None else None


@dataclass(frozen=True)
class Recognised:
    """One message taken apart: documents, and what is left of it (question or instructions)."""

    shape: str
    passages: tuple[Passage, ...]
    rest: str  # the question (a user message) or the instructions (a system message)
    instructions: str = ""  # instruction text a user-message shape carried


def _too_many() -> InputError:
    return InputError(f"the messages hold more than {MAX_SEGMENTS} segments in all (recognised documents and "
                      "turns): send fewer, longer documents")


def _tagged(text: str, budget: int) -> Recognised | None:
    """Documents given in tags: each ``<document>`` block one passage (its ``id`` attribute the
    passage id), each ``<context>`` block documents joined by blank lines; the text outside the
    blocks (a ``<documents>`` wrapper right around them dropped) is the rest. More than ``budget``
    passages is an ``InputError``, raised before the next block is split."""
    blocks = _blocks(text)
    if not blocks:
        return None
    if len(blocks) > MAX_PARTS:
        raise InputError(f"a message holds more than the gateway's limit of {MAX_PARTS} <document>/<context> "
                         "blocks: send fewer, longer documents")
    passages: list[Passage] = []
    for block in blocks:
        if block.name == "document":
            found = _ID_ATTR.search(block.attrs)
            passages.append(Passage(block.inner.strip(), id=found.group(1) if found else None))
        else:
            passages.extend(split_documents(block.inner, MAX_PARTS))
        if len(passages) > budget:
            raise _too_many()
    head, tail = text[:blocks[0].start], text[blocks[-1].end:]
    wrapper = _WRAPPER_OPEN.search(head)
    closing = _WRAPPER_CLOSE.match(tail)
    if wrapper is not None and closing is not None:
        head, tail = head[:wrapper.start()], tail[closing.end():]
    between = [text[a.end:b.start] for a, b in itertools.pairwise(blocks)]
    rest = "\n".join(part for part in (head, *between, tail) if part.strip())
    return Recognised("tagged", tuple(p for p in passages if p.text), rest.strip())


def recognise(text: str, role: Role, shapes: Sequence[PromptShape] = DEFAULT_SHAPES, *,
              budget: int = MAX_SEGMENTS) -> Recognised | None:
    """Documents in one message (the last user message or a system message), or None.

    The documented ``shapes`` are tried first: each matches the whole message on its template's
    own literal text, so documents inside it are data whatever they contain (tags included).
    Only a message that follows none of them is read for ``<document>`` / ``<context>`` tags.
    ``budget``: the passages the request may still make; more is an ``InputError``.
    """
    stripped = text.strip()
    for shape in shapes:
        if shape.role != role:
            continue
        match = shape.pattern.fullmatch(stripped)
        if match is None:
            continue
        passages = tuple(split_documents(match.group("context"), MAX_PARTS))
        if not passages:
            continue
        if len(passages) > budget:
            raise _too_many()
        parts = [v.strip() for k, v in match.groupdict().items() if k.startswith("instructions") and v and v.strip()]
        if role == "user":
            return Recognised(shape.name, passages, match.group("question").strip(), "\n".join(parts))
        return Recognised(shape.name, passages, "\n".join(parts))
    return _tagged(text, budget)


def _last_user(turns: Sequence[tuple[str, str]]) -> int:
    users = [i for i, (role, _) in enumerate(turns) if role in ("user", "human")]
    if not users:
        raise InputError("no user message: the last user message is the question")
    return users[-1]


def to_segments(
    turns: Sequence[tuple[str, str]],
    *,
    passages: Sequence[Passage] | None = None,
    question: str | None = None,
    shapes: Sequence[PromptShape] = DEFAULT_SHAPES,
) -> tuple[tuple[Segment, ...], str]:
    """Segments for a conversation of (role, text) turns, and the name of the shape recognised.

    ``passages`` (the ``specprefill.passages`` extension field) are the documents as given: no
    recognition runs, and ``question`` (else the last user message) is the question.
    ``question`` alone marks the protected part of the last user message; the rest of that
    message becomes prunable passages. Otherwise documents are recognised per ``shapes``; the
    shape is "chat" when none matched. Roles: "system" (instructions), "user", "assistant", ...
    """
    turns = [("system" if role == "developer" else role, text) for role, text in turns]
    at = _last_user(turns)
    if passages is not None:
        if question is not None:
            turns[at] = ("user", question)
        return chat_segments(turns, passages), "extension"
    if question is not None:
        text = turns[at][1]
        rest = text.replace(question, "\n", 1) if question.strip() and question in text else text
        turns[at] = ("user", question)
        return chat_segments(turns, split_documents(rest, MAX_PARTS)), "extension"
    found: list[Passage] = []
    shape = "chat"
    budget = MAX_SEGMENTS - len(turns)  # each turn makes a segment at most
    recognised = recognise(turns[at][1], "user", shapes, budget=budget)
    extra_instructions = ""
    if recognised is not None:
        shape = recognised.shape
        turns[at] = ("user", recognised.rest)
        extra_instructions = recognised.instructions
        found.extend(recognised.passages)
    for i, (role, text) in enumerate(turns):
        if role != "system":
            continue
        in_system = recognise(text, "system", shapes, budget=budget - len(found))
        if in_system is not None:
            shape = in_system.shape if shape == "chat" else shape
            turns[i] = ("system", in_system.rest)
            found[:0] = in_system.passages  # a system prompt's documents come before the user's
    if extra_instructions:
        turns.append(("system", extra_instructions))  # after the system messages' own instructions
    if not turns[at][1].strip():
        raise InputError(f"the last user message holds documents ({shape}) but no question outside them")
    return chat_segments(turns, found), shape
