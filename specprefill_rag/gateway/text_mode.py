"""Text mode: the draft's selection sent as an ordinary chat to any OpenAI-compatible upstream.

Position mode (``specprefill``) prefills the kept tokens at their original positions, which needs
the main model in this process or a vLLM with our plugin. Text mode plans the request the same way
(``engine.plan``: the same scores, units and budget), cuts every prunable segment down to its kept
text (``compress.kept_texts``: for a passage, the text ``engine.compress`` returns, the marker
standing for each dropped run), lays the segments out as the chat messages the gateway would have
templated (``prompt.layout.messages``: the instructions as the system message, one user message
"Context: [1] ... Question: ...") and posts them to the upstream's ``/v1/chat/completions``. The
upstream renders its own template and tokenizes, so client text is defused first: a word joiner
goes after the first character of any added token's string in it (``<|im_start|>``, ``<tool_call>``),
which no tokenizer then reads as that token. Without an upstream (a backend in this process) the
same segments are prefilled whole by the engine's own backend.

The answer carries the usual ``specprefill`` report (``TextModeResult``): the plan's kept spans,
keep ratio, path and timings, with ``mode: "text"``, each passage's kept character spans and,
when a planned request fell back to text mode, from what and why.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..backends.base import max_new_tokens
from ..backends.openai_chat import ChatAnswer, ChatUpstream
from ..compress import DEFAULT_MARKER, CompressedPassage, compression, kept_texts
from ..config import GenerationConfig
from ..engine import SpecPrefillEngine
from ..errors import BackendTimeoutError
from ..prompt import build_segments
from ..prompt.layout import messages
from ..streams import TextStream
from ..types import GenerationResult, Passage, PlannedPrompt, Segment, SegmentKind, Timings
from .protocol import GatewayRequest

__all__ = ["WORD_JOINER", "TextMode", "TextModeResult", "added_token_strings", "defuse", "text_segments",
           "text_stream", "to_messages", "warm_up"]

WORD_JOINER = "\u2060"  # invisible, zero width: what breaks a special token's string in client text


@dataclass(frozen=True)
class TextMode:
    """What text mode needs beside the engine: where the chat goes (None: the engine's own backend),
    the marker for dropped runs, and the strings to defuse in client text."""

    upstream: ChatUpstream | None
    marker: str = DEFAULT_MARKER
    tokens: tuple[str, ...] = ()  # added tokens' strings, longest first (``added_token_strings``)


@dataclass(frozen=True)
class TextModeResult(GenerationResult):
    """A text-mode answer: ``plan`` is the selection's (what position mode would prefill), the
    text prompt went to ``upstream``. ``prefilled_tokens`` counts the text prompt the main model
    read, in its own tokens (the upstream's usage; the plan's kept tokens when it reports none)."""

    passages: tuple[CompressedPassage, ...] = ()  # each passage's kept text and character spans
    completion_tokens: int = 0  # the upstream's count (else the answer in the local tokenizer's)
    upstream_prompt_tokens: int | None = None  # the text prompt in the upstream's tokens; None: not reported
    upstream: str = "local"  # the upstream's URL, or "local": the engine's own backend
    fallback: tuple[str, str] | None = None  # (requested mode, why it fell back to text mode); None: asked for

    @property
    def generated_tokens(self) -> int:
        return self.completion_tokens

    def to_dict(self) -> dict[str, Any]:
        fallback = None if self.fallback is None else {"from": self.fallback[0], "reason": self.fallback[1]}
        return super().to_dict() | {
            "mode": "text",
            "fallback": fallback,
            "text_mode": {
                "upstream": self.upstream,
                "upstream_prompt_tokens": self.upstream_prompt_tokens,
                "passages": [
                    {"id": p.id, "n_tokens": p.n_tokens, "n_kept": p.n_kept, "keep_ratio": p.keep_ratio,
                     "spans": [[a, b] for a, b in p.spans], "score": p.score}
                    for p in self.passages
                ],
            },
        }


def added_token_strings(tokenizer: Any) -> tuple[str, ...]:
    """The strings of the tokenizer's added tokens (special ones and markup such as Qwen's
    ``<tool_call>``) that a word joiner can break: two characters or more. Longest first."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    found = {str(token.content) for token in decoder.values()}
    found |= {str(token) for token in getattr(tokenizer, "all_special_tokens", ()) or ()}
    return tuple(sorted((t for t in found if len(t) > 1 and t.strip()), key=lambda t: (-len(t), t)))


def defuse(text: str, tokens: Sequence[str]) -> str:
    """``text`` with a word joiner after the first character of every occurrence of ``tokens``, so
    that no tokenizer reads client text as one of them; ``text`` itself when it holds none."""
    if not tokens or not any(token in text for token in tokens):
        return text
    pattern = re.compile("|".join(re.escape(token) for token in tokens))
    for _ in range(len(tokens) + 1):  # a token inside another's occurrence is found on the next pass
        text, n = pattern.subn(lambda m: m.group(0)[0] + WORD_JOINER + m.group(0)[1:], text)
        if not n:
            break
    return text


def text_segments(segments: Sequence[Segment], kept: Mapping[int, str], mode: TextMode) -> tuple[Segment, ...]:
    """``segments`` with each prunable one cut to its ``kept`` text (the marker alone when nothing
    of it was kept, so the passages keep their numbers) and all client text defused."""
    out = []
    for i, segment in enumerate(segments):
        text = (kept[i] or mode.marker.strip()) if i in kept else segment.text
        out.append(dataclasses.replace(segment, text=defuse(text, mode.tokens)))
    return tuple(out)


def to_messages(segments: Sequence[Segment]) -> list[dict[str, str]]:
    """The chat messages of ``segments``, laid out as the gateway templates them (``layout``)."""
    return [{"role": m.role, "content": m.content} for m in messages(segments)]


def text_stream(engine: SpecPrefillEngine, request: GatewayRequest, mode: TextMode,
                fallback: tuple[str, str] | None = None) -> TextStream:
    """``request`` answered in text mode, as text deltas; ``.result`` is a ``TextModeResult``.
    Bad input raises here, before any model runs (as ``engine.stream``); the draft runs at the
    first ``next``. ``fallback``: (the requested mode, why it fell back), for the report."""
    started = time.perf_counter()
    generation = request.generation
    selection = engine.config.selection
    if request.keep_rate is not None:
        selection = dataclasses.replace(selection, keep_rate=request.keep_rate, token_budget=None)
    prompt = engine.assemble(list(request.segments), selection=selection, cache_salt=generation.cache_salt)
    stop = threading.Event()

    def run() -> Generator[str, None, GenerationResult]:
        assembled = time.perf_counter()
        planned = engine.plan(prompt, selection=selection, cache_salt=generation.cache_salt)
        planned = dataclasses.replace(planned, assemble_s=assembled - started)
        cut = text_segments(prompt.segments, kept_texts(planned, mode.marker), mode)
        rest = dataclasses.replace(request, generation=_time_left(generation, started))
        if mode.upstream is None:
            reply = yield from _local(engine, cut, rest, stop)
        else:
            reply = yield from _upstream(engine, mode.upstream, to_messages(cut), planned, rest, stop)
        return _result(engine, planned, reply, mode, started, fallback)

    return TextStream(run(), stop)


def warm_up(engine: SpecPrefillEngine, mode: TextMode) -> None:
    """One tiny answer in text mode, then the draft's CUDA graphs (as ``engine.warm_up``): the
    gateway's warm-up where the upstream serves no plans but text mode may answer instead."""
    segments = build_segments("Warm-up?", ["Warm-up context. " * 40])
    request = GatewayRequest("chat", segments, "chat", "text", None, GenerationConfig(max_new_tokens=2), False, False)
    text_stream(engine, request, mode).wait()
    if engine.draft is not None:
        draft = engine.config.draft
        engine.draft.capture_graphs(draft, batches=(1, draft.max_batch))


def _time_left(generation: GenerationConfig, started: float) -> GenerationConfig:
    """``generation`` with its timeout cut to what assembling and the draft left of it (as
    ``decoding`` hands a backend); ``BackendTimeoutError`` when nothing is left."""
    if generation.timeout is None:
        return generation
    left = started + generation.timeout - time.perf_counter()
    if left <= 0:
        raise BackendTimeoutError(f"no complete answer within timeout={generation.timeout:g} s")
    return dataclasses.replace(generation, timeout=left)


@dataclass(frozen=True)
class _Reply:
    """The answer to the text prompt: its text, how it ended and when (perf_counter values)."""

    text: str
    answer: ChatAnswer
    sent: float  # the text prompt left for the main model
    first: float | None  # the first text arrived; None: no text
    upstream: str


def _upstream(engine: SpecPrefillEngine, upstream: ChatUpstream, chat: list[dict[str, str]], planned: PlannedPrompt,
              request: GatewayRequest, stop: threading.Event) -> Generator[str, None, _Reply]:
    generation = request.generation
    salt_of = getattr(engine.backend, "salt_of", None)  # a server backend's namespace holds the request's
    salt = salt_of(generation) if salt_of is not None else generation.cache_salt
    limit = max_new_tokens(planned.plan, generation, engine.backend.max_context)
    sent, first = time.perf_counter(), None
    parts: list[str] = []
    deltas = upstream.stream(chat, generation, max_tokens=limit, cache_salt=salt)
    try:
        while not stop.is_set():
            try:
                delta = next(deltas)
            except StopIteration as end:
                return _Reply("".join(parts), end.value, sent, first, upstream.base_url)
            first = first or time.perf_counter()
            parts.append(delta)
            yield delta
    finally:
        deltas.close()
    return _Reply("".join(parts), ChatAnswer("cancelled", None, None), sent, first, upstream.base_url)


def _local(engine: SpecPrefillEngine, segments: Sequence[Segment], request: GatewayRequest,
           stop: threading.Event) -> Generator[str, None, _Reply]:
    """The text prompt prefilled whole by the engine's own backend."""
    sent, first = time.perf_counter(), None
    with engine.stream(list(segments), mode="full", generation=request.generation) as inner:
        for delta in inner:
            if stop.is_set():
                inner.cancel()
            first = first or time.perf_counter()
            yield delta
    result = inner.result
    assert result is not None
    answer = ChatAnswer(result.finish_reason, result.prompt_tokens, result.generated_tokens)
    return _Reply(result.text, answer, sent, first, "local")


def _result(engine: SpecPrefillEngine, planned: PlannedPrompt, reply: _Reply, mode: TextMode, started: float,
            fallback: tuple[str, str] | None) -> TextModeResult:
    end = time.perf_counter()
    first = end if reply.first is None else reply.first
    answer, plan, scores = reply.answer, planned.plan, planned.scores
    generated = answer.completion_tokens
    if generated is None:  # no usage reported: the answer in the local tokenizer's tokens
        generated = len(engine.tokenizer(reply.text, add_special_tokens=False)["input_ids"]) if reply.text else 0
    timings = Timings(
        assemble_s=planned.assemble_s, draft_s=scores.seconds if scores is not None else None,
        selection_s=planned.selection_s, prefill_s=first - reply.sent, ttft_s=first - started,
        decode_s=end - first, total_s=end - started,
        decode_tokens_per_s=(generated - 1) / (end - first) if generated > 1 and end > first else None,
    )
    finish = answer.finish_reason if answer.finish_reason in ("length", "cancelled") else "stop"
    passages = [Passage(s.text, id=s.id, metadata=s.metadata) for s in planned.prompt.segments
                if s.kind is SegmentKind.PASSAGE]
    report = compression(planned, passages, mode.marker, 0.0).passages
    return TextModeResult(
        text=reply.text, token_ids=(), finish_reason=finish, prompt_tokens=plan.n_prompt,
        prefilled_tokens=answer.prompt_tokens if answer.prompt_tokens is not None else plan.n_kept,
        plan=plan, timings=timings, prompt=planned.prompt,
        draft_memo_hit=scores is not None and scores.from_memo,
        draft_cached_tokens=0 if scores is None else scores.cached_tokens,
        passages_cached=0 if scores is None else scores.passages_cached,
        passages_read=0 if scores is None else scores.passages_read,
        draft_windows=0 if scores is None else scores.windows, path=planned.path,
        passages=report, completion_tokens=generated, upstream_prompt_tokens=answer.prompt_tokens,
        upstream=reply.upstream, fallback=fallback,
    )
