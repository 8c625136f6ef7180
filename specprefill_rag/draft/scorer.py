"""The draft's side of one request, decided in one place: ``DraftScorer``.

What the engine asks of the draft is "how much does each token of this prompt matter?". The
answer takes more than a forward: the draft reads its own rendering of the prompt when its
tokenizer differs from the main model's; a prompt longer than the draft's window is refused, read
in windows or prefilled whole (``DraftConfig.on_overflow``); an identical request is answered from
the score memo; concurrent requests share one batched run; and scores reach the main prompt's
tokens through character offsets. ``DraftScorer`` holds all of it, so the engine only calls
``reading`` (may the draft read this prompt, and how) and ``score`` / ``score_many``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import prompt as prompt_lib
from ..caches import PromptMemo, ScoreMemo, digest
from ..config import DraftConfig
from ..errors import InputError
from ..payoff import PrefillCosts
from ..types import AssembledPrompt, PathChoice, Segment, SegmentKind, TokenScores
from .batching import MicroBatcher, TurnLock, in_buckets
from .model import DraftModel
from .passage_reading import ANCHOR_KINDS, PromptLayout, canonical_anchor, prompt_layout
from .token_mapping import map_scores, needs_mapping

__all__ = ["DraftReading", "DraftScorer"]

logger = logging.getLogger(__name__)

ANCHORS_KEPT = 64  # system parts whose anchor ``DraftScorer.anchor`` remembers


@dataclass(frozen=True)
class DraftReading:
    """A prompt and what the draft reads of it: the prompt itself when the draft shares the main
    tokenizer and the question comes last, else its segments (the question echoed after context
    that follows it, ``prompt.echoed_question``) in the draft's tokenizer and chat template, whose
    scores are carried back by segment. ``windows``: the windows the draft reads it in
    (``DraftModel.windows``), None when it fits in one pass."""

    prompt: AssembledPrompt
    read: AssembledPrompt
    salt: str | None = None  # the request's cache namespace (``GenerationConfig.cache_salt``)
    windows: tuple[torch.Tensor, ...] | None = None
    # The score memo's key under the engine's config, once ``DraftScorer.choose`` computed it.
    memo_key: bytes | None = None

    def question(self) -> torch.Tensor:
        """The draft-side indices of the question's tokens."""
        return self.read.positions_of(SegmentKind.QUESTION)


    @property
    def maps(self) -> bool:
        """Whether the draft's scores must be carried onto the main prompt's tokens."""
        return self.read is not self.prompt


class DraftScorer:
    """The draft model and everything one request's scores go through: rendering, the draft's
    window, the score memo, micro-batching and the cross-tokenizer mapping.

    ``main_tokenizer``: the main model's, onto whose tokens the scores are mapped when the
    draft's tokenizer differs (``DraftConfig.tokenizer_mapping``, docs/cross-family.md).
    ``config``: the engine's draft settings; ``score_many`` takes another for one call.
    ``costs``: the engine's running costs, which the draft's runs and queue feed (``payoff``).
    """

    def __init__(self, model: DraftModel, main_tokenizer: Any, config: DraftConfig,
                 costs: PrefillCosts | None = None) -> None:
        self.model = model
        self.config = config
        self.costs = costs or PrefillCosts()
        # True: the draft has its own tokenizer (scores mapped by offsets).
        self.maps_tokens = needs_mapping(model.tokenizer, main_tokenizer, config.tokenizer_mapping)
        # Concurrent requests (threads, async tasks) share draft passes (DraftConfig.max_batch).
        # A batch's key is (draft config, cache salt): requests of other namespaces never share a batch.
        self._batcher: MicroBatcher[DraftReading, TokenScores] = MicroBatcher(
            lambda key, items: self._score_readings(items, key[0]),  # type: ignore[index]
            max_batch=config.max_batch,
            window_s=config.batch_window_s,
        )
        # Draft passes one at a time, in arrival order (DraftConfig.passes_in_order).
        self._turns = TurnLock()
        # The scores of the last prompts, so an identical request skips the draft (DraftConfig.memo_entries),
        # and the draft's own renderings of them.
        self.memo = ScoreMemo(config.memo_entries, config.memo_bytes)
        self.prompts = PromptMemo(config.memo_entries, config.memo_bytes)
        self._anchors: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # system part -> its anchor (``anchor``)
        self._anchors_lock = threading.Lock()

    # -- what the draft reads ------------------------------------------------------------------

    def render(self, prompt: AssembledPrompt, salt: str | None = None, config: DraftConfig | None = None
               ) -> DraftReading:
        """``prompt`` and what the draft reads of it (``DraftReading``) under ``config`` (default the
        scorer's): itself, or its segments in the draft's own tokenizer and chat template, the question
        echoed where context follows it (rendered once per request, remembered under ``salt``)."""
        segments = self._own_segments(prompt, config)
        if segments is None:
            return DraftReading(prompt, prompt, salt)
        if not prompt.segment_spans:
            raise InputError("the prompt carries no segment spans: build it with engine.assemble")
        read = prompt_lib.assemble_cached(self.prompts, self.model.tokenizer, segments,
                                          protect_instructions=True, protect_tail_tokens=0, protect_history=True,
                                          salt=salt)
        return DraftReading(prompt, read, salt)

    def _own_segments(self, prompt: AssembledPrompt, config: DraftConfig | None) -> Sequence[Segment] | None:
        """The segments the draft renders in its own tokenizer and chat template (``render``), or None
        when it reads the main prompt as it is."""
        echoed = prompt_lib.echoed_question(prompt.segments) if (config or self.config).echo_question else None
        return (echoed or prompt.segments) if self.maps_tokens or echoed is not None else None

    def unrenderable(self, prompt: AssembledPrompt, config: DraftConfig | None = None) -> str | None:
        """Why the draft cannot render ``prompt`` in its own chat template, or None: a draft of
        another family whose template renders no tools cannot read an agent's prompt (tools, calls,
        tool results), which is then prefilled whole (``choose``) rather than refused, since the
        main model reads it."""
        segments = self._own_segments(prompt, config)
        try:
            prompt_lib.check_tool_support(self.model.tokenizer, segments or ())
        except InputError as error:
            return f"the draft cannot render this prompt: {error}"
        return None

    def overflow(self, reading: DraftReading, config: DraftConfig | None = None) -> str | None:
        """Why the draft cannot read ``reading`` in one pass (its rendering plus the look-ahead), or None."""
        config = config or self.config
        n, extra = reading.read.n_tokens, self._extra_positions(reading, config)
        if self.model.fits(n, extra):
            return None
        return (
            f"the prompt of {n} draft tokens plus {extra} look-ahead positions exceeds the draft "
            f"model's window of {self.model.max_context}"
        )

    def fits(self, prompt: AssembledPrompt, config: DraftConfig | None = None) -> bool:
        """Whether the draft reads ``prompt`` in one pass (its own rendering, look-ahead included)."""
        return self.unrenderable(prompt, config) is None and self.overflow(self.render(prompt, config=config),
                                                                            config) is None

    def reading(self, prompt: AssembledPrompt, salt: str | None = None) -> DraftReading | None:
        """What the draft reads for ``prompt``, decided here once: in one pass, or in windows when
        it is longer than the draft's window (``DraftConfig.on_overflow="windows"``). None when the
        draft cannot read it and the prompt is prefilled whole (``"full"``, or windows that cannot
        hold its context; logged), or that it cannot render (``unrenderable``); ``InputError`` under
        ``"raise"``."""
        return self._read(prompt, salt)[0]

    def _read(self, prompt: AssembledPrompt, salt: str | None) -> tuple[DraftReading | None, str]:
        """``reading``, and when it is None the reason the prompt is prefilled whole (``choose``)."""
        if (problem := self.unrenderable(prompt)) is not None:
            logger.warning("%s: prefilling the whole prompt", problem)
            return None, f"{problem}; the main model prefills it whole"
        reading = self.render(prompt, salt)
        config = self.config
        reason = self.overflow(reading, config)
        if reason is None:
            return reading, ""
        if config.on_overflow == "raise":
            raise InputError(f"{reason}: shorten the context or use a draft with a longer window")
        if config.on_overflow == "windows":
            try:
                windowed = self._with_windows(reading, config)
            except InputError as error:
                reason = f"{reason}, and it cannot be read in windows: {error}"
            else:
                logger.info("%s: the draft reads it in %d windows", reason, len(windowed.windows or ()))
                return windowed, ""
        logger.warning("%s: prefilling the whole prompt (DraftConfig.on_overflow)", reason)
        return None, f"{reason}; on_overflow={config.on_overflow!r} prefills it whole"

    def _with_windows(self, reading: DraftReading, config: DraftConfig) -> DraftReading:
        """``reading`` with its windows decided (``DraftModel.windows``: None when it fits in one
        pass); ``InputError`` when it cannot be read in windows."""
        read = reading.read
        windows = self.model.windows(read.n_tokens, ~read.protected, self._extra_positions(reading, config))
        return dataclasses.replace(reading, windows=None if windows is None else tuple(windows))

    def choose(self, prompt: AssembledPrompt, saved_tokens: int, salt: str | None = None, *,
               weigh_cost: bool = True) -> tuple[DraftReading | None, PathChoice | None]:
        """What the draft reads of ``prompt`` (``reading``), or None with the reason it is
        prefilled whole: the draft cannot read it, or (``DraftConfig.skip_when_slower``, when
        ``weigh_cost``) its queue and scoring would take longer than the prefill of the
        ``saved_tokens`` pruning saves. An identical request's scores in the memo always pay (the
        draft does not run). Portable mode passes ``weigh_cost=False``: what it saves is another
        LLM's prefill, not this engine's."""
        reading, why = self._read(prompt, salt)
        if reading is None:
            return None, PathChoice("draft_cannot_read", why)
        if not (weigh_cost and self.config.skip_when_slower):
            return reading, None
        if self.config.memo_entries:
            key = self._memo_key(reading, self.config)
            reading = dataclasses.replace(reading, memo_key=key)
            if self.memo.get(key) is not None:
                return reading, None
        slower = self.costs.slower(reading.read.n_tokens, saved_tokens)
        return (None, slower) if slower is not None else (reading, None)

    @staticmethod
    def _extra_positions(reading: DraftReading, config: DraftConfig) -> int:
        """The positions the look-ahead adds to the draft's reading of the prompt."""
        return config.extra_positions(config.lookahead_for(int(reading.question().numel())))

    # -- scores ----------------------------------------------------------------------------------

    def score(self, reading: DraftReading) -> TokenScores:
        """The draft's scores of ``reading`` (onto the main prompt's tokens): from the memo when an
        identical request was scored (the same draft reading, the same scoring rule, the same cache
        salt), else scored — batched with concurrent requests — and remembered."""
        config = self.config
        key = (reading.memo_key or self._memo_key(reading, config)) if config.memo_entries else None
        if key is not None and (remembered := self.memo.get(key)) is not None:
            return remembered
        with self.costs.queued(reading.read.n_tokens):
            if config.max_batch > 1:
                scores = self._batcher.submit((config, reading.salt), reading)
            else:
                scores = self._score_readings([reading], config)[0]
        if key is not None:
            self.memo.put(key, scores)
        return scores

    def layout(self, reading: DraftReading) -> PromptLayout | None:
        """Where the passages of what the draft reads sit (``passage_reading.prompt_layout``), each
        read after the anchor a RAG prompt of the same system part has (``anchor``): a chat with
        earlier turns, or an agent's tool results, finds the passages a RAG prompt read, and
        passages read ahead (``read_passages``)."""
        read = reading.read
        layout = prompt_layout(read.token_ids, read.segment_index, [s.kind for s in read.segments])
        anchor = None if layout is None else self.anchor(read.segments)
        return layout if layout is None or anchor is None else dataclasses.replace(layout, anchor=anchor)

    def anchor(self, segments: Sequence[Segment]) -> torch.Tensor | None:
        """The anchor passages are read after under the system part of ``segments``: the tokens a
        prompt of that system part, one passage and a question holds before the passage, in the
        draft's tokenizer and template (remembered per system part)."""
        system = tuple(s for s in segments if s.kind in ANCHOR_KINDS)
        key = PromptMemo.key(system, "anchor")
        with self._anchors_lock:
            if (found := self._anchors.get(key)) is not None:
                self._anchors.move_to_end(key)
                return found
        canonical = prompt_lib.assemble(self.model.tokenizer, [*system, Segment(SegmentKind.PASSAGE, "A"),
                                                               Segment(SegmentKind.QUESTION, "?")])
        anchor = canonical_anchor(canonical.token_ids, canonical.segment_index, [s.kind for s in canonical.segments])
        if anchor is not None:
            with self._anchors_lock:
                self._anchors[key] = anchor
                while len(self._anchors) > ANCHORS_KEPT:
                    self._anchors.popitem(last=False)
        return anchor

    def read_passages(self, prompt: AssembledPrompt, salt: str | None = None) -> tuple[int, int]:
        """Read the passages of ``prompt`` (the draft's own rendering of it) into the draft's
        passage store under ``salt``, scoring nothing: (passages held already, passages read)."""
        reading = self.render(prompt, salt)
        layout = self.layout(reading)
        if layout is None:
            return 0, 0
        with self._turns.turn() if self.config.passes_in_order else contextlib.nullcontext():
            return self.model.read_passages(reading.read.token_ids, layout, self.config, salt or "")

    def score_many(self, prompts: Sequence[AssembledPrompt], config: DraftConfig | None = None
                   ) -> list[TokenScores]:
        """The scores of several prompts in one batched draft run, past the memo and the batcher
        (each result equals the prompt's own within floating-point tolerance)."""
        config = config or self.config
        return self._score_readings([self._with_windows(self.render(p, config=config), config) for p in prompts],
                                    config)

    def _memo_key(self, reading: DraftReading, config: DraftConfig) -> bytes:
        """What the draft's scores of ``reading`` depend on: the draft's token ids, question and
        prunable tokens, the main prompt's token ids when scores are mapped onto them, the scoring
        fields of ``config``, and the request's cache salt (namespaces share nothing)."""
        read = reading.read
        main = reading.prompt.token_ids if reading.maps else None
        return digest([read.token_ids, reading.question(), read.protected, main], (config.rule, reading.salt))

    @staticmethod
    def map_onto_main(scores: torch.Tensor, reading: DraftReading) -> torch.Tensor:
        """The draft's scores of ``reading.read`` carried onto the main prompt's tokens through
        character offsets (``token_mapping.map_scores``)."""
        return map_scores(scores, reading.read, reading.prompt)

    def _score_readings(self, readings: Sequence[DraftReading], config: DraftConfig) -> list[TokenScores]:
        """The draft's scores of each reading, in order: one padded pass per group of near-equal
        lengths (``length_buckets``, ``DraftConfig.batch_pad_limit``)."""
        if len(readings) == 1:
            return self._score_pass(readings, config)
        return in_buckets([r.read.n_tokens for r in readings], config.batch_pad_limit,
                          lambda group: self._score_pass([readings[i] for i in group], config))

    def _score_pass(self, readings: Sequence[DraftReading], config: DraftConfig) -> list[TokenScores]:
        """The draft's scores of each reading (one batched run), mapped onto the main tokens when
        the draft has its own tokenizer. The readings share one cache salt (a batch never mixes
        namespaces): the draft's prefix store is read and written under it."""
        start = time.perf_counter()
        read = [reading.read for reading in readings]
        salts = {reading.salt for reading in readings}
        if len(salts) > 1:
            raise RuntimeError(f"a draft batch mixes {len(salts)} cache salts")
        with self._turns.turn() if config.passes_in_order else contextlib.nullcontext():
            scored = self.model.score_batch(
                [d.token_ids for d in read],
                questions=[reading.question() for reading in readings],
                contexts=[~d.protected for d in read],
                config=config,
                namespace=salts.pop() or "",
                windows=[reading.windows for reading in readings],  # decided once, by ``reading``
                layouts=None if config.passages is None else [self.layout(reading) for reading in readings],
            )
        self.costs.observe_draft(sum(d.n_tokens for d in read), scored[0].seconds)
        if not any(reading.maps for reading in readings):
            return scored
        mapped = [self.map_onto_main(s.scores, r) if r.maps else s.scores
                  for s, r in zip(scored, readings, strict=True)]
        seconds = time.perf_counter() - start
        logger.debug("mapped draft scores onto %d prompts in %.3f s", len(readings), seconds - scored[0].seconds)
        return [dataclasses.replace(s, scores=m, seconds=seconds) for m, s in zip(mapped, scored, strict=True)]
