"""The draft's readings of passages it has seen, so a passage is read once, not on every request.

A RAG prompt is mostly passages, and passages recur: a follow-up question re-sends the same
retrieved documents, an agent re-sends every earlier tool result on each step, popular chunks are
retrieved for many users, and a corpus is known at indexing time. With passage-local reading
(``passage_reading``) the draft reads each passage against the prompt's anchor (its system part)
and itself only, so that reading depends on nothing else: it is kept here and reused wherever the
passage appears again, its rotary keys re-rotated to where it sits.

An entry holds, for the passage's m tokens, the keys and values of layers 0 … ``exit_layer``
(post-RoPE, computed at positions ``start`` … ``start + m - 1``), the hidden states leaving
``exit_layer`` (what the upper layers' reading set is gathered from) and, where the reading
recomputes some tokens jointly, the hidden states entering that layer.

Entries are content-addressed (``passage_key``): the draft (its weights' fingerprint and
precision), the reading's settings, the anchor's token ids, the passage's token ids and the
request's cache namespace, so tenants never share an entry. Bounded in bytes, least recently
used first out, thread-safe; an optional disk tier (``PassageDisk``) keeps entries beyond memory
in crash-safe safetensors files. ``bytes_per_token`` says what a cached token costs.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from ..caches import Bounded
from ..durable import atomic_open

__all__ = ["PassageDisk", "PassageEntry", "PassageStore", "StoreCounts", "bytes_per_token", "passage_key"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PassageEntry:
    """The draft's reading of one passage of ``n_tokens`` tokens, read at positions ``start`` …
    (after an anchor of ``start`` tokens): per layer 0 … (the exit, or the layer every token is
    recomputed from) its keys and values (kv_heads, m, head_dim), the hidden states (m, d_model)
    leaving the exit layer, and those entering the layer tokens are recomputed from (None when
    the reading recomputes none)."""

    token_ids: torch.Tensor  # (m,) int64, on the CPU: checked against the passage on every hit
    start: int
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    hidden: torch.Tensor | None  # None when the reading recomputes every token up to the exit
    entering: torch.Tensor | None = None
    following: torch.Tensor | None = None  # (m, d_model) leaving that layer (a deviation recompute)

    @property
    def n_tokens(self) -> int:
        return int(self.token_ids.numel())

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (*self.keys, *self.values, *(t for t in (self.hidden, self.entering, self.following) if t is not None))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors()) + 8 * self.n_tokens


def bytes_per_token(n_layers: int, kv_heads: int, head_dim: int, d_model: int, dtype: torch.dtype,
                    states: int) -> int:
    """What one cached passage token costs: keys and values of ``n_layers`` layers, ``states``
    hidden states of ``d_model`` (leaving the exit, entering a recomputed layer, ...), its id."""
    size = torch.empty(0, dtype=dtype).element_size()
    return (2 * n_layers * kv_heads * head_dim + d_model * states) * size + 8


def passage_key(draft: str, settings: object, anchor: torch.Tensor, passage: torch.Tensor, namespace: str) -> bytes:
    """The content address of a passage's reading: the draft's fingerprint, the reading's
    ``settings``, the anchor's and the passage's token ids, and the cache namespace."""
    h = hashlib.sha256(repr((draft, settings, namespace)).encode("utf-8", "surrogatepass"))
    for ids in (anchor, passage):
        data = ids.to(torch.int64).cpu().contiguous()
        h.update(f"{data.numel()}|".encode())
        h.update(data.numpy().tobytes())
    return h.digest()


@dataclass
class StoreCounts:
    """What a store has served: passages found (in memory or on disk), read anew, and entries on disk."""

    hits: int = 0
    misses: int = 0
    disk_hits: int = 0


class PassageDisk:
    """Entries as safetensors files in ``directory`` (one per key, named by its hex digest),
    written crash-safe (``durable.atomic_open``: a kill mid-write leaves the previous file or
    none, never a torn one), at most ``max_bytes`` together: the least recently used files go
    first. A file that cannot be read (another version, a disk error) counts as absent."""

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._bytes = sum(p.stat().st_size for p in self.directory.glob("*.safetensors"))

    @property
    def nbytes(self) -> int:
        return self._bytes

    def _path(self, key: bytes) -> Path:
        return self.directory / f"{key.hex()}.safetensors"

    def load(self, key: bytes) -> PassageEntry | None:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        path = self._path(key)
        try:
            tensors = load_file(path)
            os.utime(path)  # recently used
        except (OSError, SafetensorError, RuntimeError) as error:
            if not isinstance(error, FileNotFoundError):
                logger.warning("passage store: cannot read %s (%s): reading the passage again", path.name, error)
            return None
        try:
            return _entry_of(tensors)
        except (KeyError, ValueError) as error:
            logger.warning("passage store: %s holds no passage reading (%s): reading the passage again", path.name,
                           error)
            return None

    def save(self, key: bytes, entry: PassageEntry) -> None:
        from safetensors.torch import save

        data = save(_tensors_of(entry))
        if len(data) > self.max_bytes:
            return
        path = self._path(key)
        with self._lock:
            try:
                old = path.stat().st_size
            except FileNotFoundError:
                old = 0
            with atomic_open(path) as handle:
                handle.write(data)
            self._bytes += len(data) - old
            self._evict()

    def _evict(self) -> None:
        if self._bytes <= self.max_bytes:
            return
        files = sorted(self.directory.glob("*.safetensors"), key=lambda p: p.stat().st_mtime)
        for path in files:
            if self._bytes <= self.max_bytes:
                break
            try:
                size = path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                continue
            self._bytes -= size


def _tensors_of(entry: PassageEntry) -> dict[str, torch.Tensor]:
    """The entry's tensors by name, each a CPU copy of its own (safetensors refuses shared storage)."""
    out = {"token_ids": entry.token_ids, "start": torch.tensor([entry.start])}
    for i, (k, v) in enumerate(zip(entry.keys, entry.values, strict=True)):
        out[f"keys.{i}"], out[f"values.{i}"] = k, v
    for name in ("hidden", "entering", "following"):
        if getattr(entry, name) is not None:
            out[name] = getattr(entry, name)
    return {name: t.detach().to("cpu", copy=True).contiguous() for name, t in out.items()}


def _entry_of(tensors: dict[str, torch.Tensor]) -> PassageEntry:
    layers = sum(1 for name in tensors if name.startswith("keys."))
    entry = PassageEntry(
        token_ids=tensors["token_ids"], start=int(tensors["start"][0]),
        keys=tuple(tensors[f"keys.{i}"] for i in range(layers)),
        values=tuple(tensors[f"values.{i}"] for i in range(layers)),
        hidden=tensors.get("hidden"), entering=tensors.get("entering"), following=tensors.get("following"),
    )
    m = entry.n_tokens
    states = [t for t in (entry.hidden, entry.entering, entry.following) if t is not None]
    if not states or any(t.shape[-2] != m for t in (*entry.keys, *entry.values)) or any(t.shape[0] != m
                                                                                        for t in states):
        raise ValueError("its tensors do not fit its token ids")
    return entry


class PassageStore(Bounded[bytes, PassageEntry]):
    """Passage readings in memory, at most ``max_bytes`` of tensors (0: nothing is kept), least
    recently used first out, with an optional ``disk`` tier behind it. ``find`` checks an entry's
    token ids against the passage (a digest collision cannot hand over another passage's reading)."""

    def __init__(self, max_bytes: int, disk: PassageDisk | None = None) -> None:
        super().__init__(1 << 62, max_bytes, lambda entry: entry.nbytes)
        self.disk = disk
        self.counts = StoreCounts()

    def configure(self, max_bytes: int, directory: str | None, disk_bytes: int) -> None:
        """The bounds and disk tier a call asks for (``DraftRuntime.passage_store_*``): the memory
        budget, and the disk tier in ``directory`` (opened when it is another; None: none)."""
        self.resize(self.entries, max_bytes)
        if directory is None:
            self.disk = None
        elif self.disk is None or self.disk.directory != Path(directory):
            self.disk = PassageDisk(directory, disk_bytes)
        else:
            self.disk.max_bytes = disk_bytes

    def find(self, key: bytes, token_ids: torch.Tensor) -> PassageEntry | None:
        entry = self._get(key)
        on_disk = False
        if entry is None and self.disk is not None:
            entry, on_disk = self.disk.load(key), True
        if entry is None or not torch.equal(entry.token_ids, token_ids.to(torch.int64).cpu()):
            with self._lock:
                self.counts.misses += 1
            return None
        with self._lock:
            self.counts.hits += 1
            self.counts.disk_hits += on_disk
        if on_disk:
            self.put(key, entry)
        return entry

    def add(self, key: bytes, entry: PassageEntry) -> None:
        self.put(key, entry)
        if self.disk is not None:
            self.disk.save(key, entry)
