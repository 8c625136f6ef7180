"""Typed values that flow through the pipeline: prompt segments, plans and results.

Data flow: ``Segment`` list → ``AssembledPrompt`` → ``TokenScores`` → ``PrefillPlan`` (with its
prompt and scores: ``PlannedPrompt``) → backend → ``GenerationResult``. Everything here is plain
data; no model code. The checks every layer applies to values it is handed (``is_int``,
``is_number``, ``is_finite_number``, ``lone_surrogate``) live here too.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, NamedTuple, TypeGuard

import torch

from .errors import InputError

__all__ = [
    "HISTORY_ROLES",
    "RETRIEVER_SCORE_KEY",
    "AssembledPrompt",
    "GenerationResult",
    "HeadReduction",
    "KeptSpan",
    "Passage",
    "PassagesRead",
    "PathChoice",
    "PathCode",
    "PlannedPrompt",
    "PrefillPlan",
    "Segment",
    "SegmentKind",
    "Timings",
    "TokenScores",
    "ToolCall",
    "is_finite_number",
    "is_int",
    "is_number",
    "lone_surrogate",
]

HeadReduction = Literal["max", "mean"]  # how one layer's heads are combined (DraftConfig.heads)

_EMPTY: Mapping[str, Any] = MappingProxyType({})
_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(text: str) -> int | None:
    """Index of the first surrogate code point (U+D800 to U+DFFF) in ``text``, or None.

    A Python str holds one only when it is not valid Unicode (JSON's ``"\\ud800"`` unpaired, a
    bad decode): UTF-8 cannot encode it, so neither a tokenizer nor an answer can carry it.
    """
    if text.isascii():  # O(1) in CPython
        return None
    found = _SURROGATE.search(text)
    return None if found is None else found.start()


def is_int(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an integer (a ``bool`` is not, though Python says it is an ``int``)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    """Whether ``value`` is an int or a float (a ``bool`` is not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_finite_number(value: object) -> TypeGuard[int | float]:
    """Whether ``value`` is a finite int or float: an int too large for a float (JSON allows any
    number of digits) is not, nor NaN or infinity, nor a ``bool``."""
    if not is_number(value):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _check_id(owner: str, pid: object) -> None:
    """Ids come back in answers (``kept_spans``): they must be encodable text."""
    if not isinstance(pid, str):
        return
    at = lone_surrogate(pid)
    if at is not None:
        raise InputError(
            f"the {owner} id {pid!r:.80} holds a lone surrogate (U+{ord(pid[at]):04X}) at character {at}: "
            "ids are returned in answers and must be valid Unicode"
        )


HISTORY_ROLES = ("user", "assistant")  # the chat roles a history segment is rendered with


class SegmentKind(enum.StrEnum):
    """What a piece of the prompt is; decides whether selection may prune it."""

    INSTRUCTIONS = "instructions"  # system prompt: protected by default
    PASSAGE = "passage"  # a retrieved passage: prunable
    CONTEXT = "context"  # free-form context without passage structure: prunable
    HISTORY = "history"  # an earlier chat turn, rendered as its own message (Segment.role)
    QUESTION = "question"  # the user query: always protected
    TOOL_SCHEMA = "tool_schema"  # one tool offered to the model (its JSON schema): always protected
    TOOL_CALL = "tool_call"  # the arguments of a tool call an assistant turn made: always protected
    TOOL_RESULT = "tool_result"  # one document or whole item of a tool's output: prunable


# The Passage.metadata key of the retriever's score (higher = more relevant, e.g. a cosine
# similarity), which SelectionConfig.retriever_weight weighs; every retriever writes it here.
RETRIEVER_SCORE_KEY = "score"


@dataclass(frozen=True)
class Passage:
    """A retrieved passage: its text, a stable id and free-form metadata (source, score, ...)."""

    text: str
    id: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)

    def __post_init__(self) -> None:
        _check_id("passage", self.id)


@dataclass(frozen=True)
class Segment:
    """One logical piece of a RAG prompt, before the chat template is applied."""

    kind: SegmentKind
    text: str
    id: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    role: str | None = None  # HISTORY only: the turn's chat role, "user" or "assistant"

    def __post_init__(self) -> None:
        _check_id("segment", self.id)
        if self.kind is SegmentKind.HISTORY and self.role not in HISTORY_ROLES:
            raise InputError(f"a history segment needs the role 'user' or 'assistant', got {self.role!r:.40}")
        if self.kind is not SegmentKind.HISTORY and self.role is not None:
            raise InputError(f"only history segments have a role; a {self.kind.value} segment got {self.role!r:.40}")

    @property
    def prunable(self) -> bool:
        """Selection may drop its tokens: passages, context, tool results and history (unless
        ``SelectionConfig.protect_history``)."""
        return self.kind in (SegmentKind.PASSAGE, SegmentKind.CONTEXT, SegmentKind.HISTORY, SegmentKind.TOOL_RESULT)


@dataclass(frozen=True)
class AssembledPrompt:
    """A rendered, tokenized prompt with per-token bookkeeping.

    ``segment_index[i]`` is the index into ``segments`` of the segment token ``i`` belongs to,
    or -1 for template text (role markers, special tokens, separators). ``protected[i]`` is True
    for tokens selection must keep. ``offsets[i]`` is the (start, end) character span of token
    ``i`` in ``text``.
    """

    text: str
    token_ids: torch.Tensor  # (n_prompt,) int64
    segment_index: torch.Tensor  # (n_prompt,) int64, -1 = template
    protected: torch.Tensor  # (n_prompt,) bool
    offsets: torch.Tensor  # (n_prompt, 2) int64, character offsets into text
    segments: tuple[Segment, ...]
    segment_spans: tuple[tuple[int, int, int], ...] = ()
    sentence_start: torch.Tensor | None = None  # (n_prompt,) bool
    # (n_prompt,) int8: 0 = the token continues a word or number, 1 = a word begins, 2 = a clause
    # begins; where selection may cut a sentence longer than its limit (None: anywhere)
    cut_level: torch.Tensor | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.token_ids.numel())

    @property
    def n_context(self) -> int:
        """Prunable tokens: the context the keep rate is a fraction of."""
        return int((~self.protected).sum())

    def positions_of(self, kind: SegmentKind) -> torch.Tensor:
        """(m,) int64 indices of the tokens that belong to segments of ``kind``."""
        ids = [i for i, s in enumerate(self.segments) if s.kind is kind]
        return torch.isin(self.segment_index, torch.tensor(ids, dtype=torch.int64)).nonzero().flatten()


@dataclass(frozen=True)
class TokenScores:
    """Draft-model importance of every prompt token (higher = more useful to the answer)."""

    scores: torch.Tensor  # (n_prompt,) float32
    lookahead_token_ids: tuple[int, ...]  # the draft's greedy look-ahead tokens
    seconds: float  # wall time of draft prefill + look-ahead + scoring (0.0 from the memo)
    from_memo: bool = False  # the engine's memo had them (an identical request): the draft did not run
    cached_tokens: int = 0  # the prompt's first tokens the draft read from its prefix store, not again
    passages_cached: int = 0  # passages whose reading the draft found in its passage store (read apart)
    passages_read: int = 0  # passages the draft read apart now, and stored
    windows: int = 1  # passes the draft read the prompt in (more than 1: longer than its window)


@dataclass(frozen=True)
class KeptSpan:
    """How much of one prompt segment the main model prefills."""

    segment_index: int
    kind: SegmentKind
    id: str | None
    n_tokens: int
    n_kept: int
    ranges: tuple[tuple[int, int], ...]  # kept [start, end) token ranges, original positions

    @property
    def keep_ratio(self) -> float:
        return self.n_kept / self.n_tokens if self.n_tokens else 1.0


@dataclass(frozen=True)
class PrefillPlan:
    """What the main model prefills: token ids at (possibly non-contiguous) position ids.

    Decoding continues at ``next_position`` (the original prompt length), so the t-th
    generated token sits at ``next_position + t`` whatever was dropped.
    """

    token_ids: torch.Tensor  # (n_kept,) int64
    position_ids: torch.Tensor  # (n_kept,) int64, strictly increasing
    next_position: int  # position of the first generated token
    n_prompt: int  # tokens in the full prompt
    kept_spans: tuple[KeptSpan, ...]  # one per segment (template text not listed)
    speculated: bool  # False when the prompt was prefilled whole (full mode, or too short)

    @property
    def n_kept(self) -> int:
        return int(self.token_ids.numel())

    @property
    def keep_ratio(self) -> float:
        return self.n_kept / self.n_prompt if self.n_prompt else 1.0


class PassagesRead(NamedTuple):
    """What reading passages ahead did (``SpecPrefillEngine.read_passages``): how many the draft's
    passage store held already and how many the draft read now."""

    found: int
    read: int


# Which path a request took: pruned by the draft's scores, or prefilled whole and why.
PathCode = Literal["pruned", "full_mode", "short_prompt", "keeps_everything", "draft_cannot_read", "draft_slower",
                   "planned"]


@dataclass(frozen=True)
class PathChoice:
    """Which path one request took and why: ``code`` (what ``/metrics`` counts) and a sentence."""

    code: PathCode
    reason: str


@dataclass(frozen=True)
class PlannedPrompt:
    """A prompt with its plan, the draft scores the plan was made from and the time spent."""

    prompt: AssembledPrompt
    plan: PrefillPlan
    scores: TokenScores | None  # None when the draft did not run
    assemble_s: float  # seconds; 0.0 when the prompt was assembled elsewhere
    selection_s: float | None  # seconds choosing the kept tokens; None when nothing was selected
    path: PathChoice = PathChoice("planned", "a plan given to execute")


@dataclass(frozen=True)
class ToolCall:
    """One tool call the model wrote, parsed and validated against the tool's schema."""

    name: str
    arguments: Mapping[str, Any]  # a JSON object
    id: str  # unique: "call_<24 hex digits>" (the model writes none; a tool message answers it by this id)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "arguments": dict(self.arguments)}


@dataclass(frozen=True)
class Timings:
    """Wall-clock breakdown of one request, in seconds (``None`` where a stage did not run)."""

    assemble_s: float
    draft_s: float | None  # draft prefill + look-ahead + scoring
    selection_s: float | None  # choosing the kept tokens from the scores (None when the draft did not run)
    prefill_s: float  # main-model prefill up to the first token's logits
    ttft_s: float  # request start → first generated token
    decode_s: float  # first token → last token
    total_s: float
    decode_tokens_per_s: float | None  # None when fewer than two tokens were generated


@dataclass(frozen=True)
class GenerationResult:
    """The answer and everything needed to judge it: counts, kept spans, timings."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" (EOS or stop string), "length" or "cancelled"
    prompt_tokens: int
    prefilled_tokens: int
    plan: PrefillPlan
    timings: Timings
    prompt: AssembledPrompt | None = None  # the assembled prompt the plan was made from
    draft_memo_hit: bool = False  # the draft's scores came from the engine's memo: the draft did not run
    draft_cached_tokens: int = 0  # the prompt's first draft tokens read from the draft's prefix store
    passages_cached: int = 0  # passages the draft's passage store served (DraftConfig.passages)
    passages_read: int = 0  # passages the draft read apart for this request, and stored
    draft_windows: int = 0  # passes the draft's scores came from (>1: read in windows); 0: no draft scores
    path: PathChoice = PathChoice("planned", "a plan given to execute")  # pruned or whole, and why
    # When the prompt offered tools: the calls the model wrote (parsed from ``text`` only, never
    # from the prompt) and ``content``, the text outside them. Without tools: () and None.
    tool_calls: tuple[ToolCall, ...] = ()
    content: str | None = None

    @property
    def keep_ratio(self) -> float:
        return self.plan.keep_ratio

    @property
    def kept_spans(self) -> tuple[KeptSpan, ...]:
        return self.plan.kept_spans

    @property
    def generated_tokens(self) -> int:
        return len(self.token_ids)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly facts of this answer (no tensors): counts, keep ratio, timings, spans (and the
        tool calls, when the prompt offered tools)."""
        calls = {} if self.content is None else {"tool_calls": [call.to_dict() for call in self.tool_calls]}
        return calls | {
            "finish_reason": self.finish_reason,
            "speculated": self.plan.speculated,
            "draft_memo_hit": self.draft_memo_hit,
            "draft_cached_tokens": self.draft_cached_tokens,
            "passages_cached": self.passages_cached,
            "passages_read": self.passages_read,
            "draft_windows": self.draft_windows,
            "path": self.path.code,
            "path_reason": self.path.reason,
            "prompt_tokens": self.prompt_tokens,
            "prefilled_tokens": self.prefilled_tokens,
            "generated_tokens": self.generated_tokens,
            "keep_ratio": self.keep_ratio,
            "timings": dataclasses.asdict(self.timings),
            "kept_spans": [
                {
                    "id": span.id,
                    "kind": str(span.kind),
                    "n_tokens": span.n_tokens,
                    "n_kept": span.n_kept,
                    "keep_ratio": span.keep_ratio,
                    "ranges": [list(r) for r in span.ranges],
                }
                for span in self.kept_spans
            ],
        }
