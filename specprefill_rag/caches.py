"""The draft's scores of recent prompts, so an identical request (a retry, "regenerate", the same
question twice) skips the draft; and their assembled prompts, so it skips the template and the
tokenizer too (``PromptMemo``).

Keyed by a digest of everything the scores depend on: what the draft reads (its token ids, the
question's positions, the prunable tokens), the main prompt's token ids when scores are mapped
onto another tokenizer, and the draft config's scoring fields. Bounded in entries and in bytes,
least recently used first out; thread-safe (the engine serves threads and async tasks).
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, TypeVar

import torch

from .types import AssembledPrompt, Segment, TokenScores

K = TypeVar("K")
V = TypeVar("V")

__all__ = ["Bounded", "PromptMemo", "ScoreMemo", "digest"]


def digest(tensors: Iterable[torch.Tensor | None], settings: object) -> bytes:
    """A SHA-256 of ``tensors`` (dtype, shape and contents of each; None counts) and ``repr(settings)``."""
    h = hashlib.sha256(repr(settings).encode())
    for t in tensors:
        if t is None:
            h.update(b"none")
            continue
        data = t.detach().cpu().contiguous()
        h.update(f"{data.dtype}{tuple(data.shape)}".encode())
        h.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


def _size(scores: TokenScores) -> int:
    return scores.scores.numel() * scores.scores.element_size() + 8 * len(scores.lookahead_token_ids)


class Bounded(Generic[K, V]):
    """At most ``entries`` values and ``max_bytes`` of them together (``size(value)``), least
    recently used first out; 0 entries: nothing is kept, and a value larger than ``max_bytes``
    alone is not kept. Thread-safe. The score memo and the draft's prefix store (``draft.prefix_store``)."""

    def __init__(self, entries: int, max_bytes: int, size: Callable[[V], int]) -> None:
        self.entries, self.max_bytes, self._size = entries, max_bytes, size
        self._items: OrderedDict[K, V] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def _get(self, key: K) -> V | None:
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
            return found

    def _snapshot(self) -> list[tuple[K, V]]:
        with self._lock:
            return list(self._items.items())

    def put(self, key: K, value: V) -> None:
        size = self._size(value)
        if self.entries == 0 or size > self.max_bytes:
            return
        with self._lock:
            if key in self._items:
                self._bytes -= self._size(self._items.pop(key))
            self._items[key] = value
            self._bytes += size
            self._evict()

    def resize(self, entries: int, max_bytes: int) -> None:
        """New bounds; values over them leave now."""
        with self._lock:
            self.entries, self.max_bytes = entries, max_bytes
            self._evict()

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0

    def _evict(self) -> None:
        while self._items and (len(self._items) > self.entries or self._bytes > self.max_bytes):
            _, old = self._items.popitem(last=False)
            self._bytes -= self._size(old)


class ScoreMemo(Bounded[bytes, TokenScores]):
    """The last scores, at most ``entries`` of them and ``max_bytes`` of score tensors together
    (0 entries: nothing is kept). ``get`` returns a hit with ``seconds=0.0`` and ``from_memo``."""

    def __init__(self, entries: int, max_bytes: int) -> None:
        super().__init__(entries, max_bytes, _size)

    def get(self, key: bytes) -> TokenScores | None:
        found = self._get(key)
        if found is None:
            return None
        return dataclasses.replace(found, seconds=0.0, from_memo=True, cached_tokens=0, passages_cached=0,
                                   passages_read=0)


def _prompt_size(prompt: AssembledPrompt) -> int:
    tensors = (prompt.token_ids, prompt.segment_index, prompt.protected, prompt.offsets, prompt.sentence_start,
               prompt.cut_level)
    return 4 * len(prompt.text) + sum(t.numel() * t.element_size() for t in tensors if t is not None)


class PromptMemo(Bounded[bytes, AssembledPrompt]):
    """The last assembled prompts (rendered, tokenized, with their bookkeeping), at most
    ``entries`` of them and ``max_bytes`` together: a retry skips the chat template and the
    tokenizer (tens of milliseconds for a few thousand tokens). Keyed by what ``prompt.assemble``
    reads of the segments (kind, role, text) and its options; a hit carries the request's own
    segments (ids and metadata, which assembly never reads, may differ)."""

    def __init__(self, entries: int, max_bytes: int) -> None:
        super().__init__(entries, max_bytes, _prompt_size)

    @staticmethod
    def key(segments: Sequence[Segment], options: object) -> bytes:
        h = hashlib.sha256(repr(options).encode())
        for segment in segments:
            text = segment.text.encode("utf-8", "surrogatepass")
            h.update(f"{segment.kind.value}|{segment.role}|{len(text)}|".encode())
            h.update(text)
            if segment.kind.value.startswith("tool") or "message" in segment.metadata:  # names, glue, grouping
                h.update(repr(sorted(segment.metadata.items())).encode("utf-8", "surrogatepass"))
        return h.digest()

    def get(self, key: bytes, segments: Sequence[Segment]) -> AssembledPrompt | None:
        found = self._get(key)
        return None if found is None else dataclasses.replace(found, segments=tuple(segments))
