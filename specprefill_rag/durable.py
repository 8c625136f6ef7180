"""Crash-safe file writes: a file is replaced whole or not at all.

A write goes to a hidden temporary file in the target's directory, is flushed and fsynced, and
is then renamed over the target (``os.replace``, atomic on POSIX); the directory is fsynced too,
so that the rename itself survives a power cut. An exception, a kill or a crash at any point
leaves the previous file (or none), never a truncated one; at worst a stray ``.<name>.*.tmp``
next to it after a kill. ``loading`` builds its model cache with these, and the benchmarks write
their result files and caches with them.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

__all__ = ["atomic_open", "fsync_dir", "fsync_tree", "write_atomic"]

_NEW_FILE_MODE = 0o644  # mkstemp makes 0600 files; a result file or a shared cache wants 644


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str]) -> Iterator[IO[bytes]]:
    """A binary handle whose content replaces ``path`` when the block ends without an error
    (``torch.save(obj, handle)``, ``handle.write(data)``); on an error ``path`` is left as it was.
    The new file keeps the old one's permissions (644 for a new file)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        try:
            mode = stat.S_IMODE(path.stat().st_mode)
        except FileNotFoundError:
            mode = _NEW_FILE_MODE
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def write_atomic(path: str | os.PathLike[str], data: bytes | str) -> None:
    """Replace ``path`` with ``data`` (a str is written as UTF-8), crash-safely (``atomic_open``)."""
    with atomic_open(path) as handle:
        handle.write(data.encode("utf-8") if isinstance(data, str) else data)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory, so that the entries made or renamed in it survive a crash. Does
    nothing where the platform or file system cannot (Windows, some network file systems)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike[str]) -> None:
    """fsync every file and directory under ``root`` (and ``root``), before it is renamed into
    place: a rename is only as durable as the data it publishes."""
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(directory)
