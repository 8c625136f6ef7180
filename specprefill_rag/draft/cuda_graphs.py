"""CUDA graphs of the draft's look-ahead forwards: captured at warm-up, replayed per request.

On a GPU a small draft's decode step is bound by kernel launches, not arithmetic: one eager
step of a 1B draft at 8k tokens cost 11.3 ms on an H200 against ~48 ms for its whole 8k
prefill, so seven sequential steps ate most of what SpecPrefill saves. ``early_exit.StepLoop``
keeps the greedy look-ahead in tensors of fixed size, changed in place; so one forward of it
can be captured once as a CUDA graph and replayed as one launch.

Graphs are captured per loop shape (batch, prompt width rounded up to a power of two, layers,
steps, tokens per forward) by ``StepGraphs.capture``, which the engine's warm-up calls for every
width up to the draft's window (``DraftModel.capture_graphs``): never inside a request. A
request whose shape has no graph, or that finds the graphs busy with another request, runs the
same loop eagerly; the tokens and recorded queries are the same either way (the eager loop is
what the CPU tests check against full decoding).

What a captured forward records (each aggregated layer's look-ahead query rows) lands in
tensors the graph owns; after each replay they are handed to the draft's recorder as an eager
forward would have recorded them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .early_exit import DecoderParts, LoopShape, StepLoop

__all__ = ["MIN_GRAPH_WIDTH", "StepGraphs", "graph_width"]

MIN_GRAPH_WIDTH = 512  # the narrowest captured prompt width; widths double from there


def graph_width(n: int) -> int:
    """The captured prompt width that serves a padded prompt of ``n`` tokens: a power of two."""
    width = MIN_GRAPH_WIDTH
    while width < n:
        width *= 2
    return width


class _Rows:
    """Stands in for the draft's recorder while a forward is captured: keeps each layer's query
    tensor (batch, heads, feed, head_dim), which every replay then overwrites in place."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, torch.Tensor]] = []

    def record(self, module: Any, query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> None:
        self.rows.append((int(module.layer_idx), query.clone()))


@dataclass
class _Captured:
    """A loop's buffers and its two captured forwards (upper layers run or not), each with the
    tensors its replay writes: which slots were kept, and the recorded query rows."""

    loop: StepLoop
    graphs: dict[bool, tuple[Any, torch.Tensor, list[tuple[int, torch.Tensor]]]]
    recorder: Any = None  # the request's recorder, while one holds this loop

    def run(self, predict: bool) -> torch.Tensor:
        """``StepLoop.run`` replayed: one launch."""
        graph, take, rows = self.graphs[predict]
        graph.replay()
        if self.recorder is not None:
            for layer, query in rows:
                self.recorder.lookahead_rows(layer, query)
        return take


class StepGraphs:
    """The captured look-ahead forwards of one draft on a CUDA device.

    ``recording(obj)``: a context manager under which the draft's attention reports to ``obj``
    (its ``record`` method); ``current()``: the recorder of the calling request. One request at a
    time replays a given loop; another one meanwhile runs eagerly."""

    def __init__(self, parts: DecoderParts, device: torch.device, recording: Callable[[Any], Any],
                 current: Callable[[], Any]) -> None:
        self.parts, self.device = parts, device
        self._recording, self._current = recording, current
        self._captured: dict[LoopShape, _Captured] = {}
        self._busy: set[LoopShape] = set()
        self._lock = threading.Lock()
        self._pool: Any = None

    def __len__(self) -> int:
        return len(self._captured)

    @staticmethod
    def key(shape: LoopShape) -> LoopShape:
        """The captured shape that serves ``shape``: its widths rounded up (the reading set never
        holds more tokens than the prompt, so its buffer is the prompt's width)."""
        width = graph_width(shape.width)
        return dataclasses.replace(shape, width=width, reading=width)

    @contextlib.contextmanager
    def claim(self, shape: LoopShape) -> Iterator[_Captured | None]:
        """The captured loop serving ``shape``, held by the caller until the block ends; None
        when there is none or another request holds it (the caller runs eagerly)."""
        key = self.key(shape)
        with self._lock:
            captured = self._captured.get(key)
            if captured is None or key in self._busy:
                captured = None
            else:
                self._busy.add(key)
        if captured is None:
            yield None
            return
        captured.recorder = self._current()
        try:
            yield captured
        finally:
            captured.recorder = None
            with self._lock:
                self._busy.discard(key)

    @torch.inference_mode()
    def capture(self, shape: LoopShape) -> bool:
        """Capture the forwards of the loop serving ``shape`` (once); False when it was already."""
        key = self.key(shape)
        with self._lock:
            if key in self._captured:
                return False
        loop = StepLoop(self.parts, key, self.device)
        graphs = {predict: self._capture_one(loop, predict) for predict in (True, False)}
        with self._lock:
            self._captured[key] = _Captured(loop, graphs)
        return True

    def _capture_one(self, loop: StepLoop, predict: bool) -> tuple[Any, torch.Tensor, list[tuple[int, torch.Tensor]]]:
        """One forward of ``loop`` as a CUDA graph, after two eager runs on a side stream (lazy
        initialisation must not happen inside a capture)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), self._recording(_Rows()):
            for _ in range(2):
                loop.reset()
                loop.run(predict)
        torch.cuda.current_stream(self.device).wait_stream(side)
        loop.reset()
        rows = _Rows()
        graph = torch.cuda.CUDAGraph()
        with self._recording(rows), torch.cuda.graph(graph, pool=self._pool):
            take = loop.run(predict)
        self._pool = graph.pool()
        return graph, take, rows.rows
