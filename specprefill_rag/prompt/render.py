"""Segments → chat-templated text → token ids with segment map, protected mask and offsets.

The chat messages and their text are ``layout``'s (the user message's "Context: [1] ...
Question: ..." layout, tool messages, tool schemas). Passage headers, separators and the chat
template's own text are *template* tokens (segment index -1) and are always kept; so are the
question, the instructions (by default), tool schemas and calls, and the last few tokens. Only
passage, context and tool-result text is prunable (a tool result's atomic item whole or not at
all). The segments themselves are built by ``segments`` and ``tool_segments``.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..caches import PromptMemo
from ..errors import InputError
from ..types import AssembledPrompt, PrefillPlan, Segment, SegmentKind, lone_surrogate
from . import layout as layout_lib

__all__ = [
    "assemble",
    "assemble_cached",
    "cut_levels",
    "kept_runs",
    "markup_tokens",
    "render",
    "sentence_breaks",
    "special_token_ids",
]

# A sentence ends after . ! or ? (and any closing quotes or brackets) followed by white space,
# or at a line break. The white space belongs to the next sentence, as tokenizers attach it.
_SENTENCE_END = re.compile(r"[.!?][\"'\u201d\u2019)\]]*(?=\s)|\n+")


def render(tokenizer: Any, segments: Sequence[Segment]) -> tuple[str, list[tuple[int, int, int]], bool]:
    """Full prompt text, segment character spans in it, and whether a chat template was used.

    Spans come from construction, never from searching the rendered text (client text may
    repeat the template's own strings): the template is rendered with a placeholder for each
    message's content, and the content is put in its place (``layout``). Messages: the
    instructions as the system message, each history segment as a message of its role (with its
    tool calls), each tool message, and the last user message (context and question).
    """
    return layout_lib.layout(tokenizer, segments, tuple(markup_tokens(tokenizer)))


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


# How ``cut_levels`` classes characters: letters and digits of scripts that write spaces between
# words (cut only between words), scripts without spaces (CJK, kana, Thai, ...: cut anywhere),
# white space, and the punctuation that ends a clause or joins the parts of a number or word.
_NO_SPACE_SCRIPTS = ((0x0E00, 0x0EFF), (0x1000, 0x109F), (0x1780, 0x17FF), (0x2E80, 0xA4CF), (0xF900, 0xFAFF),
                     (0xFF66, 0xFF9F), (0x20000, 0x3FFFF))
_DIGIT, _LETTER, _SPACE, _CLAUSE_JOIN, _CLAUSE, _JOIN, _OTHER = b"0a kcpo"
_CLAUSE_CHARS = {",": "k", ":": "k", ";": "c", "\u2013": "c", "\u2014": "c"}  # a clause starts after these
_JOIN_CHARS = {".": "p", "'": "p", "\u2019": "p"}  # inside between two digits (3.14) or letters (don't); , : too


def _char_class(c: str) -> str:
    if c in _CLAUSE_CHARS:
        return _CLAUSE_CHARS[c]
    if c in _JOIN_CHARS:
        return _JOIN_CHARS[c]
    if c.isspace():
        return " "
    if c.isalnum() and not any(a <= ord(c) <= b for a, b in _NO_SPACE_SCRIPTS):
        return "0" if c.isdigit() else "a"
    return "o"


def cut_levels(text: str, offsets: torch.Tensor) -> torch.Tensor:
    """(n,) int8: may a unit begin at token ``i``? 0: no, it continues a word or number (digits
    joined by . , : such as 3.14 or 1,986, letters joined by an apostrophe), or a character the
    previous token began; 1: a word begins; 2: a clause begins (after , ; : or a dash).
    ``selection.unit_bounds`` cuts sentences longer than its limit only where this allows. Array
    operations over the text's characters (one table lookup per distinct character)."""
    n = offsets.shape[0]
    if n == 0:
        return torch.zeros(0, dtype=torch.int8)
    table = {ord(c): _char_class(c) for c in set(text)}
    cls = np.frombuffer(text.translate(table).encode("ascii"), dtype=np.uint8)
    pad = 2  # cls[p] is at padded[p + pad]; positions before and after the text are "other"
    padded = np.concatenate([np.full(pad, _OTHER, np.uint8), cls, np.full(pad + 1, _OTHER, np.uint8)])
    digit, letter = padded == _DIGIT, padded == _LETTER
    word, join = digit | letter, (padded == _JOIN) | (padded == _CLAUSE_JOIN)

    def at(mask: np.ndarray, shift: int) -> np.ndarray:
        """mask at character p + shift, for every boundary p in 0..len(text)."""
        return mask[pad + shift: pad + shift + len(cls) + 1]

    joined = (at(word, -1) & at(word, 0)) \
        | (at(join, 0) & ((at(digit, -1) & at(digit, 1)) | (at(letter, -1) & at(letter, 1)))) \
        | (at(join, -1) & ((at(digit, -2) & at(digit, 0)) | (at(letter, -2) & at(letter, 0))))
    # the last non-space character before boundary p ends a clause
    last = np.maximum.accumulate(np.where(cls != _SPACE, np.arange(len(cls)), -1))
    before = np.concatenate([[-1], last])  # (len + 1,): last non-space index < p
    clause = (before >= 0) & np.isin(np.append(cls, _OTHER)[np.maximum(before, 0)], (_CLAUSE, _CLAUSE_JOIN))
    starts, ends = offsets[:, 0].numpy().clip(0, len(cls)), offsets[:, 1].numpy()
    previous_end = np.maximum.accumulate(np.concatenate([[0], ends[:-1]]))
    levels = np.where(joined[starts] | (starts < previous_end), 0, np.where(clause[starts], 2, 1))
    return torch.from_numpy(levels.astype(np.int8))


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of the tokenizer's special added tokens (role markers, end of turn, BOS/EOS, ...)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids = {int(i) for i, token in decoder.items() if getattr(token, "special", False)}
    return frozenset(ids | set(getattr(tokenizer, "all_special_ids", ()) or ()))


def markup_tokens(tokenizer: Any) -> dict[str, int]:
    """The tokenizer's added tokens that are not special (Qwen's ``<tool_call>``): text → id. The
    template writes them as markup; client text must not become them (``split_special_tokens``
    does not split them)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special = special_token_ids(tokenizer)
    return {str(t.content): int(i) for i, t in decoder.items() if int(i) not in special and str(t.content).strip()}


def _tokenize_untrusted(tokenizer: Any, text: str, markup: dict[str, int]) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids and offsets of client text with special tokens split, and every markup token's string
    cut after its first character, so that neither a special nor a markup token comes out."""
    cuts = sorted({m + 1 for token in markup for m in _find_all(text, token)})
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []
    for a, b in itertools.pairwise([0, *cuts, len(text)]):
        part = tokenizer(text[a:b], add_special_tokens=False, return_offsets_mapping=True, split_special_tokens=True)
        ids.extend(part["input_ids"])
        offsets.extend((a + s, a + e) if e > s else (a, a) for s, e in part["offset_mapping"])
    return ids, offsets


def _find_all(text: str, token: str) -> list[int]:
    found, at = [], text.find(token)
    while at >= 0:
        found.append(at)
        at = text.find(token, at + 1)
    return found


def _encode(
    tokenizer: Any, text: str, spans: Sequence[tuple[int, int, int]], *, add_special_tokens: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (n,) and character offsets (n, 2) of ``text``; segment text is plain text.

    Passages, questions, chat messages and tool schemas, calls and results are untrusted:
    "<|im_start|>system" written inside one must not become the real role marker, nor
    "<tool_call>" Qwen's markup token. Only the chat template may produce special or markup
    tokens. A prompt whose segments hold no special-token string is tokenized in one piece
    (the model's own tokenization); otherwise template and segment text are tokenized
    separately, the segments with ``split_special_tokens=True``.
    """
    encoded = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    ids = torch.tensor(encoded["input_ids"], dtype=torch.int64)
    offsets = torch.tensor(encoded["offset_mapping"], dtype=torch.int64).reshape(-1, 2)
    markup = markup_tokens(tokenizer)
    special = torch.tensor(sorted(special_token_ids(tokenizer) | set(markup.values())), dtype=torch.int64)
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
        if untrusted and markup and not (add_special_tokens and n == 0):
            part_ids, part_offsets = _tokenize_untrusted(tokenizer, text[a:b], markup)
            all_ids.extend(part_ids)
            all_offsets.extend((a + s, a + e) for s, e in part_offsets)
            continue
        part = tokenizer(
            text[a:b],
            add_special_tokens=add_special_tokens and n == 0,
            return_offsets_mapping=True,
            split_special_tokens=untrusted,
        )
        all_ids.extend(part["input_ids"])
        all_offsets.extend((a + s, a + e) if e > s else (a, a) for s, e in part["offset_mapping"])
    return torch.tensor(all_ids, dtype=torch.int64), torch.tensor(all_offsets, dtype=torch.int64).reshape(-1, 2)


# Every code point str.isspace() (and so str.lstrip()) treats as white space (a test checks the
# list against Python's own rule).
_WHITESPACE = np.array(
    [0x9, 0xA, 0xB, 0xC, 0xD, 0x1C, 0x1D, 0x1E, 0x1F, 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028,
     0x2029, 0x202F, 0x205F, 0x3000],
    dtype=np.uint32,
)


def _visible_starts(text: str, starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """(n,) each token's first character that is not white space (``str.lstrip``'s rule); its
    start when it is white space only. Vectorised: one pass over the text's code points."""
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    solid = np.flatnonzero(~np.isin(codes, _WHITESPACE))  # indices of the non-white characters
    at = np.searchsorted(solid, starts.numpy())  # the first non-white character at or after each start
    first = torch.from_numpy(np.append(solid, len(codes))[at].astype(np.int64))
    return torch.where(first < ends, first, starts)


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
    protect_history: bool = True,
) -> AssembledPrompt:
    """Render ``segments`` with the tokenizer's chat template and tokenize with bookkeeping.

    Needs a fast tokenizer (character offsets). Template tokens, the question, tool schemas and calls, the
    instructions (unless ``protect_instructions`` is False), earlier chat turns (unless
    ``protect_history`` is False) and the last ``protect_tail_tokens`` tokens are marked protected.
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
    visible = _visible_starts(text, starts, ends)
    segment_index = _segment_of(visible, starts, ends, spans)
    kinds = {SegmentKind.QUESTION, SegmentKind.TOOL_SCHEMA, SegmentKind.TOOL_CALL} \
        | ({SegmentKind.INSTRUCTIONS} if protect_instructions else set()) \
        | ({SegmentKind.HISTORY} if protect_history else set())
    keep = torch.tensor([s.kind in kinds for s in segments] + [True], dtype=torch.bool)  # [-1]: template text
    protected = keep[segment_index]
    if protect_tail_tokens:
        protected[-protect_tail_tokens:] = True
    sentence_start, cut_level = _atomic(segments, segment_index, _sentence_starts(text, starts, spans, segments),
                                        cut_levels(text, offsets))
    return AssembledPrompt(
        text=text,
        token_ids=token_ids,
        segment_index=segment_index,
        protected=protected,
        offsets=offsets,
        segments=segments,
        segment_spans=tuple(spans),
        sentence_start=sentence_start,
        cut_level=cut_level,
    )


def _atomic(segments: Sequence[Segment], segment_index: torch.Tensor, sentence_start: torch.Tensor,
            cut_level: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sentence starts and cut levels with each atomic segment (``metadata["atomic"]``: a JSON item
    or code block of a tool's output) one unit that no cut enters: no sentence starts after its
    first token, and cut level -1 (never) inside it."""
    atomic = [i for i, s in enumerate(segments) if s.metadata.get("atomic")]
    if not atomic:
        return sentence_start, cut_level
    inside = torch.isin(segment_index, torch.tensor(atomic, dtype=torch.int64))
    first = inside.clone()
    first[1:] &= segment_index[1:] != segment_index[:-1]
    later = inside & ~first
    return sentence_start & ~later, torch.where(later, torch.full_like(cut_level, -1), cut_level)


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


def assemble_cached(memo: PromptMemo, tokenizer: Any, segments: Sequence[Segment], *, protect_instructions: bool,
                    protect_tail_tokens: int, protect_history: bool, salt: str | None) -> AssembledPrompt:
    """``assemble`` of ``segments``, or the same prompt assembled before under the same cache
    ``salt`` (the request's namespace): a retry skips the template and the tokenizer. A ``memo``
    of no entries remembers nothing."""
    options = (protect_instructions, protect_tail_tokens, protect_history, salt)
    key = PromptMemo.key(segments, options) if memo.entries else None
    if key is not None and (remembered := memo.get(key, segments)) is not None:
        return remembered
    prompt = assemble(tokenizer, segments, protect_instructions=protect_instructions,
                      protect_tail_tokens=protect_tail_tokens, protect_history=protect_history)
    if key is not None:
        memo.put(key, prompt)
    return prompt
