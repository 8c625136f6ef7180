"""The look-ahead drivers: which tokens the draft would write next, and their queries recorded.

The look-ahead is either the reference's L − 1 greedy decode steps (``_greedy``; with early exit
the upper layers read a reading set, ``early_exit.upper_greedy``, verifying guessed tokens where
asked) or the L − 1 likeliest next tokens (``_siblings``), scored together in one more forward at
position n (each sees the prompt and itself). With early exit the prompt's forward stops after
the highest layer whose attention is aggregated, and the layers above it read a reading set of
the prompt (``reading_sets``, ``upper_layer_logits``) to choose the look-ahead tokens; the last
look-ahead forward always stops there. On a GPU the greedy loop replays CUDA graphs captured at
warm-up (``capture_graphs``, ``cuda_graphs``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch

from ..config import DraftConfig
from . import scoring
from .capture import EarlyExit, Recorder, current_recorder, recording
from .cuda_graphs import MIN_GRAPH_WIDTH, StepGraphs
from .early_exit import DecoderParts, ExitedPrompts, LoopShape, reading_set, tree_mask, upper_greedy, upper_logits
from .forward import DraftForward, LocalRead, PaddedBatch
from .lookahead_spec import LookaheadSpec
from .prefix_store import PrefixEntry

__all__ = ["LookaheadDrivers", "reading_sets", "upper_layer_logits"]

logger = logging.getLogger(__name__)


class LookaheadDrivers(DraftForward):
    """The look-ahead of a draft (``DraftModel``): siblings, greedy steps, and their CUDA graphs."""

    def _siblings(self, recorder: Recorder, batch: PaddedBatch, spec: LookaheadSpec, head: PrefixEntry | None = None,
                  local: LocalRead | None = None) -> torch.Tensor:
        """Two forwards: the prompt's, then the ``spec.steps`` likeliest next tokens of each prompt
        together, each at position n_b seeing its prompt and itself (``early_exit.tree_mask``).
        (batch, spec.steps).

        ``spec.early_exit``: the prompt's forward stops after the highest recorded layer (top);
        the layers above it read the ``spec.upper_keep`` share of each prompt's tokens only, the
        best by the recorded rows (question and last token), to find the likeliest next tokens
        (``early_exit.upper_logits``). Else: the full forward's logits. ``head``: the prompts'
        shared start, read from the prefix store. ``local``: their forward with the passages read
        apart (``passage_reading``; with early exit only).
        """
        k, top = spec.steps, spec.top(self.n_layers)
        mask, last = batch.mask, batch.last
        parts = DecoderParts.of(self.model) if spec.early_exit and top < self.n_layers - 1 else None
        if parts is None:
            cache, logits = self._read_prompt(recorder, batch, stop_after=None, leave=None, head=head, local=None)
        else:
            cache, leaving = self._read_prompt(recorder, batch, stop_after=None, leave=parts.layers[top], head=head,
                                               local=local)
            assert leaving is not None
            logits = upper_layer_logits(parts, leaving, last, top, reading_sets(self, recorder, spec.upper_keep))
        assert logits is not None
        siblings = logits.topk(k, dim=-1).indices  # (batch, k), likeliest first
        recorder.stop_after = top
        with contextlib.suppress(EarlyExit):
            self.model(
                input_ids=siblings, position_ids=(last + 1).unsqueeze(1).expand(-1, k),
                attention_mask=tree_mask(mask, k), past_key_values=cache, use_cache=True, logits_to_keep=1,
            )
        return siblings

    def _greedy(self, recorder: Recorder, batch: PaddedBatch, spec: LookaheadSpec, head: PrefixEntry | None = None,
                local: LocalRead | None = None) -> list[list[int]]:
        """The reference's look-ahead: ``spec.steps`` greedy decode steps after the prompt's
        forward, with no host synchronisation inside the loop (verified guesses, or
        ``spec.stop_at_eos``: one per forward). Each prompt's tokens fed: ``spec.steps``, or with
        ``spec.stop_at_eos`` those before the first of the draft's ``end_ids`` (their recorded
        rows only: the rest are dropped).

        ``spec.early_exit``: the prompt's forward stops after the highest recorded layer, and the
        layers above it read the ``spec.upper_keep`` share of each prompt (its reading set, as
        for siblings) in every step (``early_exit.upper_greedy``, which verifies ``spec.guesses``
        guessed tokens per forward: resolved by ``capture_batch``); the recorded layers see the
        whole prompt. Else: full forwards, one per step. ``head``: the prompts' shared start, read
        from the prefix store. ``spec.graphs``: replay the draft's captured CUDA graphs of the
        steps (``cuda_graphs``).
        """
        from transformers import DynamicCache

        top = spec.top(self.n_layers)
        ids, mask = batch.ids, batch.mask
        parts = DecoderParts.of(self.model) if spec.early_exit and top < self.n_layers - 1 else None
        if parts is not None and self._embeds_plainly(parts, ids):
            cache, leaving = self._read_prompt(recorder, batch, stop_after=None, leave=parts.layers[top], head=head,
                                               local=local)
            assert leaving is not None
            # Only the steps' queries are recorded: the layers above ``top`` never are.
            upper = DynamicCache(config=self.model.config)
            keeps = reading_sets(self, recorder, spec.upper_keep)
            found, kept = upper_greedy(parts, ExitedPrompts(ids, mask, cache, leaving), upper, keeps, spec,
                                       loops=self.graphs if spec.graphs else None,
                                       end_ids=sorted(self._end_ids(spec)))
            recorder.keep_lookahead(kept)
            return [row[:n] for row, n in zip(found.tolist(), kept.sum(1).tolist(), strict=True)]
        cache, logits = self._read_prompt(recorder, batch, stop_after=None, leave=None, head=head, local=None)
        assert logits is not None
        return self._decode_steps(recorder, cache, logits, mask, batch.last, spec)

    def _decode_steps(self, recorder: Recorder, cache: Any, logits: torch.Tensor, mask: torch.Tensor,
                      last: torch.Tensor, spec: LookaheadSpec) -> list[list[int]]:
        """Greedy decode steps over full forwards from the prompt's next-token ``logits``
        (``_greedy`` without early exit); with ``spec.stop_at_eos`` a row's tokens end before the
        first of the draft's ``end_ids``, its later rows are dropped and the loop ends once every
        row's answer has."""
        batch, steps, top, end_ids = len(last), spec.steps, spec.top(self.n_layers), self._end_ids(spec)
        ends = torch.tensor(sorted(end_ids), dtype=torch.int64, device=self.device)
        tokens: list[torch.Tensor] = []
        ended = torch.zeros(batch, dtype=torch.bool, device=self.device)
        fed: list[torch.Tensor] = []  # (batch,) per step: which rows' tokens count
        for step in range(steps):
            tokens.append(logits.argmax(-1))  # (batch,)
            if end_ids:
                ended |= torch.isin(tokens[-1], ends)
                if bool(ended.all()):
                    break
            fed.append(~ended)
            mask = torch.cat([mask, torch.ones(batch, 1, dtype=mask.dtype, device=self.device)], dim=1)
            recorder.stop_after = top if step == steps - 1 else None  # the last step's logits go unused
            try:
                out = self.model(
                    input_ids=tokens[-1].reshape(batch, 1), position_ids=(last + 1 + step).reshape(batch, 1),
                    attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=1,
                )
            except EarlyExit:
                break
            logits = out.logits[:, -1]
        kept = torch.stack(fed, dim=1) if fed else torch.zeros(batch, 0, dtype=torch.bool, device=self.device)
        recorder.keep_lookahead(kept)
        return [row[:n] for row, n in zip(torch.stack(tokens, dim=1).tolist(), kept.sum(1).tolist(), strict=True)]

    def _end_ids(self, spec: LookaheadSpec) -> frozenset[int]:
        """The ids a greedy look-ahead of ``spec`` stops before: the draft's, or none."""
        return self.end_ids if spec.stop_at_eos else frozenset()

    # -- CUDA graphs of the look-ahead (``cuda_graphs``) ---------------------------------------

    @torch.inference_mode()
    def capture_graphs(self, config: DraftConfig | None = None, batches: Sequence[int] = (1,)) -> int:
        """Capture the greedy look-ahead's forwards as CUDA graphs for what ``config`` (default:
        the draft's own) runs: each batch size of ``batches`` and every padded prompt width from
        512 up to ``graph_max_tokens`` and the window. What an engine's warm-up calls, so that no
        request pays for a capture. Returns how many loop shapes were captured now: 0 where
        nothing is to capture (a CPU draft, ``cuda_graphs=False``, a look-ahead that is not
        greedy steps after an early exit). A capture that fails is logged and ends the capturing:
        the widths not captured run eagerly (the draft still serves)."""
        cfg = config or self.config
        shapes = self._graph_shapes(cfg, batches)
        if not shapes:
            return 0
        if self.graphs is None:
            parts = DecoderParts.of(self.model)
            assert parts is not None
            self.graphs = StepGraphs(parts, self.device, recording, current_recorder)
        captured = 0
        for shape in shapes:
            try:
                captured += self.graphs.capture(shape)
            except Exception as error:  # a kernel that cannot be captured: serve eagerly, never fail to start
                logger.warning("could not capture the draft's look-ahead as a CUDA graph for batch %d, width %d "
                               "(%s: %s): the look-ahead of the shapes not captured runs eagerly",
                               shape.batch, shape.width, type(error).__name__, error)
                break
        return captured

    def _graph_shapes(self, cfg: DraftConfig, batches: Sequence[int]) -> list[LoopShape]:
        """The loop shapes ``capture_graphs`` captures for ``cfg``: none unless the draft runs
        ``early_exit.upper_greedy`` on a CUDA device with graphs on."""
        lookahead, top = cfg.lookahead, max(cfg.layer_indices(self.n_layers))
        probe = torch.zeros(1, 1, dtype=torch.int64, device=self.device)
        if (not cfg.graphs_on(self.device.type) or lookahead < 2 or cfg.lookahead_tokens != "greedy"
                or not cfg.early_exit or top >= self.n_layers - 1
                or self._exit_layer(lookahead, "greedy", True, top, probe) != top):
            return []  # no upper_greedy loop: siblings, full forwards, no layer above the aggregated ones
        cache = self._cache(None, 1)
        with recording(None):
            self.model(input_ids=probe, past_key_values=cache, use_cache=True)  # the cache's sizes
        limit = min(cfg.graph_max_tokens, self.max_context - cfg.extra_positions(lookahead, "greedy"))
        feed = 1 + min(self._guesses(cfg.lookahead_guesses, lookahead), lookahead - 2)
        widths = [MIN_GRAPH_WIDTH]
        while widths[-1] < limit:
            widths.append(2 * widths[-1])
        one = [LoopShape.of(cache, top + 1, self.n_layers, lookahead - 1, feed, width, width) for width in widths]
        return [dataclasses.replace(shape, batch=b) for b in sorted(set(batches)) for shape in one]


def upper_layer_logits(parts: DecoderParts, leaving: torch.Tensor, last: torch.Tensor, top: int,
                       keeps: Sequence[torch.Tensor]) -> torch.Tensor:
    """(batch, vocab): each prompt's next-token logits from the draft's layers above ``top`` (of
    ``parts``) over its reading set ``keeps[b]`` (``reading_sets``; ``leaving`` (batch, width,
    d_model): the hidden states leaving ``top``; ``last`` (batch,): each prompt's last token)."""
    with recording(None):  # the upper layers' rows are not the prompt's
        return torch.stack([
            upper_logits(parts, leaving[b, : end + 1], keep, top + 1)
            for b, (keep, end) in enumerate(zip(keeps, last.tolist(), strict=True))
        ])


def reading_sets(draft: DraftForward, recorder: Recorder, share: float, layers: Sequence[int] | None = None
                 ) -> list[torch.Tensor]:
    """Each prompt's reading set (``early_exit.reading_set``), chosen by its recorded rows in
    ``layers`` (default every recorded one), on ``draft``'s device."""
    return [
        reading_set(_first_scores(draft, recorder, b, layers), question, share).to(draft.device)
        for b, question in enumerate(recorder.questions)
    ]


def _first_scores(draft: DraftForward, recorder: Recorder, b: int, layers: Sequence[int] | None = None
                  ) -> torch.Tensor:
    """(n_b,) prompt b's importance from the rows recorded at the prompt (its question's and
    last token's queries, in ``layers``, default every recorded one): what chooses the upper
    layers' reading set."""
    positions = recorder.rows[b]
    rows = torch.stack([
        scoring.layer_rows(recorder.queries[layer][b][0], recorder.keys[layer][b], recorder.scaling[layer],
                           draft.config.pool_kernel, positions=positions.to(draft.device))
        for layer in (sorted(recorder.keys) if layers is None else layers)
    ])  # (layers, n_question + 1, n_b)
    return scoring.importance(rows)
