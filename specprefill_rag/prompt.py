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

import itertools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from .errors import InputError, InputTypeError
from .types import AssembledPrompt, Passage, PrefillPlan, Segment, SegmentKind, lone_surrogate

__all__ = [
    "RETRIEVER_SCORE_KEY",
    "Passages",
    "as_passages",
    "assemble",
    "build_segments",
    "chat_segments",
    "kept_runs",
    "passage_segments",
    "render",
    "retriever_scores",
    "sentence_breaks",
    "special_token_ids",
]

# A sentence ends after . ! or ? (and any closing quotes or brackets) followed by white space,
# or at a line break. The white space belongs to the next sentence, as tokenizers attach it.
_SENTENCE_END = re.compile(r"[.!?][\"'\u201d\u2019)\]]*(?=\s)|\n+")

_ROLE_NAMES = {"user": "User", "human": "User", "assistant": "Assistant", "ai": "Assistant", "tool": "Tool"}


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


RETRIEVER_SCORE_KEY = "score"  # Passage.metadata key of the retriever's similarity


def retriever_scores(segments: Sequence[Segment]) -> torch.Tensor | None:
    """(n_segments,) float32: each segment's retriever score (``metadata["score"]``), NaN where
    it has none; None when no segment has one. What ``SelectionConfig.retriever_weight`` weighs."""
    values = []
    for segment in segments:
        score = segment.metadata.get(RETRIEVER_SCORE_KEY)
        if isinstance(score, (int, float)) and not isinstance(score, bool) and math.isfinite(score):
            values.append(float(score))
        else:
            values.append(math.nan)
    if all(math.isnan(v) for v in values):
        return None
    return torch.tensor(values, dtype=torch.float32)


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


def chat_segments(
    turns: Sequence[tuple[str, str]],
    passages: Passages = (),
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
    for i, (role, text) in enumerate(history):
        if i != question_at and text.strip():
            name = _ROLE_NAMES.get(role, role.capitalize())
            segments.append(Segment(SegmentKind.CONTEXT, f"{name}: {text.strip()}", f"turn-{i}"))
    segments.extend(passage_segments(passages))
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


def _system_content(segments: Sequence[Segment]) -> tuple[str, list[tuple[int, int, int]]]:
    """System message text (the instructions, joined by blank lines) and their character spans."""
    parts: list[str] = []
    spans: list[tuple[int, int, int]] = []
    length = 0
    for i, s in enumerate(segments):
        if s.kind is SegmentKind.INSTRUCTIONS:
            if parts:
                parts.append("\n\n")
                length += 2
            spans.append((i, length, length + len(s.text)))
            parts.append(s.text)
            length += len(s.text)
    return "".join(parts), spans


def render(tokenizer: Any, segments: Sequence[Segment]) -> tuple[str, list[tuple[int, int, int]], bool]:
    """Full prompt text, segment character spans in it, and whether a chat template was used.

    Spans come from construction, never from searching the rendered text (client text may
    repeat the template's own strings): the template is rendered with a placeholder for each
    message's content, and the content is put in its place.
    """
    system, system_spans = _system_content(segments)
    user, user_spans = _user_content(segments)
    contents = [(system, system_spans)] if system else []
    contents.append((user, user_spans))
    markers = [f"\x00specprefill-content-{n}\x00" for n in range(len(contents))]
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": markers[-1]}]
        if system:
            messages.insert(0, {"role": "system", "content": markers[0]})
        layout = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        chat = True
    else:
        layout = f"{markers[0]}\n\n{markers[1]}\nAnswer:" if system else f"{markers[0]}\nAnswer:"
        chat = False
    pieces: list[str] = []
    spans: list[tuple[int, int, int]] = []
    at = length = 0
    for marker, (content, content_spans) in zip(markers, contents, strict=True):
        found = layout.find(marker, at)
        if found < 0 or marker in layout[found + len(marker):]:
            raise ValueError(
                "the chat template does not place each message's content once and verbatim; "
                "cannot locate the segments"
            )
        pieces.append(layout[at:found])
        length += found - at
        spans.extend((i, length + a, length + b) for i, a, b in content_spans)
        pieces.append(content)
        length += len(content)
        at = found + len(marker)
    pieces.append(layout[at:])
    return "".join(pieces), spans, chat


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


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of the tokenizer's special added tokens (role markers, end of turn, BOS/EOS, ...)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids = {int(i) for i, token in decoder.items() if getattr(token, "special", False)}
    return frozenset(ids | set(getattr(tokenizer, "all_special_ids", ()) or ()))


def _encode(
    tokenizer: Any, text: str, spans: Sequence[tuple[int, int, int]], *, add_special_tokens: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (n,) and character offsets (n, 2) of ``text``; segment text is plain text.

    Passages, questions and chat messages are untrusted: "<|im_start|>system" written inside
    one must not become the real role marker. Only the chat template may produce special
    tokens. A prompt whose segments hold no special-token string is tokenized in one piece
    (the model's own tokenization); otherwise template and segment text are tokenized
    separately, the segments with ``split_special_tokens=True``.
    """
    encoded = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    ids = torch.tensor(encoded["input_ids"], dtype=torch.int64)
    offsets = torch.tensor(encoded["offset_mapping"], dtype=torch.int64).reshape(-1, 2)
    special = torch.tensor(sorted(special_token_ids(tokenizer)), dtype=torch.int64)
    suspects = torch.isin(ids, special)
    if suspects.any():
        # Characters inside any segment, as a prefix sum: token [s, e) touches a segment
        # when covered[e] > covered[s] (one pass, whatever the number of segments).
        inside = torch.zeros(len(text) + 1, dtype=torch.int64)
        for _, a, b in spans:
            inside[a] += 1
            inside[b] -= 1
        covered = torch.cat([torch.zeros(1, dtype=torch.int64), (inside.cumsum(0)[:-1] > 0).cumsum(0)])
        s, e = offsets[suspects, 0], offsets[suspects, 1]
        suspects = covered[e] > covered[s]
    if not suspects.any():
        return ids, offsets
    pieces: list[tuple[int, int, bool]] = []  # (start, end, untrusted)
    at = 0
    for _, a, b in sorted(spans, key=lambda span: span[1]):
        if a > at:
            pieces.append((at, a, False))
        pieces.append((a, b, True))
        at = b
    if at < len(text):
        pieces.append((at, len(text), False))
    all_ids: list[int] = []
    all_offsets: list[tuple[int, int]] = []
    for n, (a, b, untrusted) in enumerate(pieces):
        part = tokenizer(
            text[a:b],
            add_special_tokens=add_special_tokens and n == 0,
            return_offsets_mapping=True,
            split_special_tokens=untrusted,
        )
        all_ids.extend(part["input_ids"])
        all_offsets.extend((a + s, a + e) if e > s else (a, a) for s, e in part["offset_mapping"])
    return torch.tensor(all_ids, dtype=torch.int64), torch.tensor(all_offsets, dtype=torch.int64).reshape(-1, 2)


def _segment_of(
    visible: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, spans: Sequence[tuple[int, int, int]]
) -> torch.Tensor:
    """(n,) int64: the segment each token lies in (its visible text inside the span), else -1."""
    out = torch.full_like(starts, -1)
    if not spans:
        return out
    ordered = sorted(spans, key=lambda span: span[1])
    index, a, b = (torch.tensor(column, dtype=torch.int64) for column in zip(*ordered, strict=True))
    at = torch.searchsorted(a, visible.contiguous(), right=True) - 1  # last span starting at or before
    hit = at >= 0
    at = at.clamp(min=0)
    hit &= (visible >= a[at]) & (ends <= b[at]) & (ends > starts)
    out[hit] = index[at[hit]]
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
        raise InputError("the prompt is empty: pass a question and at least one passage")
    for n, segment in enumerate(segments):
        at = lone_surrogate(segment.text)
        if at is not None:
            raise InputError(
                f"segment {n} ({segment.kind.value}) holds a lone surrogate (U+{ord(segment.text[at]):04X}) at "
                f"character {at}: text must be valid Unicode (UTF-8 cannot encode it, no tokenizer reads it)"
            )
    if not getattr(tokenizer, "is_fast", False):
        raise InputError(
            f"{type(tokenizer).__name__} is a slow tokenizer without character offsets; "
            "load the fast one (AutoTokenizer.from_pretrained(..., use_fast=True))"
        )
    text, spans, chat = render(tokenizer, segments)
    token_ids, offsets = _encode(tokenizer, text, spans, add_special_tokens=not chat)
    starts, ends = offsets[:, 0], offsets[:, 1]
    # A token such as " what" starts on the space before a segment's first character: it
    # belongs to the segment by its visible text (pure white space keeps its own start).
    lead = torch.tensor([len(t) - len(t.lstrip()) for t in (text[a:b] for a, b in offsets.tolist())])
    visible = torch.where(starts + lead < ends, starts + lead, starts)
    segment_index = _segment_of(visible, starts, ends, spans)
    keep = torch.tensor(
        [
            s.kind is SegmentKind.QUESTION or (s.kind is SegmentKind.INSTRUCTIONS and protect_instructions)
            for s in segments
        ]
        + [True],  # index -1: template text
        dtype=torch.bool,
    )
    protected = keep[segment_index]
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


def kept_runs(prompt: AssembledPrompt, plan: PrefillPlan) -> dict[int, tuple[tuple[str, bool], ...]]:
    """What the main model saw of each prunable segment, as text: segment index → (text, kept)
    runs covering the segment's text in order (the UI's highlighted passages).

    A character is dropped when the token covering it was dropped; template tokens are always
    prefilled. ``prompt`` must be the one ``plan`` was made from (its ``segment_spans``).
    """
    kept = torch.zeros(prompt.n_tokens, dtype=torch.bool)
    for span in plan.kept_spans:
        for start, end in span.ranges:
            kept[start:end] = True
    kept |= prompt.segment_index < 0
    dropped = (~kept).nonzero().flatten()
    # Characters of dropped tokens, by a difference array: one pass, whatever the prompt's size.
    marks = torch.zeros(len(prompt.text) + 1, dtype=torch.int64)
    marks.index_add_(0, prompt.offsets[dropped, 0], torch.ones(dropped.numel(), dtype=torch.int64))
    marks.index_add_(0, prompt.offsets[dropped, 1], -torch.ones(dropped.numel(), dtype=torch.int64))
    char_kept = (marks.cumsum(0) <= 0)[:-1]
    runs: dict[int, tuple[tuple[str, bool], ...]] = {}
    for index, a, b in prompt.segment_spans:
        if not prompt.segments[index].prunable or b <= a:
            continue
        state = char_kept[a:b]
        cuts = [0, *((state[1:] != state[:-1]).nonzero().flatten() + 1).tolist(), b - a]
        runs[index] = tuple((prompt.text[a + x : a + y], bool(state[x])) for x, y in itertools.pairwise(cuts))
    return runs
