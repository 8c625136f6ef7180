"""Crash-safe writes (specprefill_rag.durable) and the benchmarks' result files built on them.

A write cut short (an exception in the serialisation, a failed rename, a full disk, a SIGKILL)
must leave the previous file whole; a JSON-lines file torn by a crash mid-append must still be
read, and appended to, without losing its earlier rows.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from benchmarks.lib import results
from benchmarks.suites import evidence
from specprefill_rag import durable
from specprefill_rag.durable import atomic_open, write_atomic

ROOT = Path(__file__).resolve().parents[1]


def _child(code: str, *args: str, max_file_bytes: int | None = None, pipe: str = "stderr") -> subprocess.Popen[str]:
    """A Python child in the repository root running ``code`` (dedented) with ``args``, its
    ``pipe`` ("stdout" or "stderr") piped to the test. With
    ``max_file_bytes`` its files may not grow past that size: a write beyond it fails midway
    (EFBIG), as on a full disk (SIGXFSZ is ignored so that the write fails instead of killing it)."""
    prelude = "import sys\n"
    if max_file_bytes is not None:
        prelude += (
            "import resource, signal\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({max_file_bytes}, resource.RLIM_INFINITY))\n"
        )
    return subprocess.Popen([sys.executable, "-c", prelude + textwrap.dedent(code), *args], cwd=ROOT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE if pipe == "stdout" else None,
                            stderr=subprocess.PIPE if pipe == "stderr" else None)


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_public_api() -> None:
    assert set(durable.__all__) == {"atomic_open", "fsync_dir", "fsync_tree", "write_atomic"}
    assert all(hasattr(durable, name) for name in durable.__all__)


def test_write_atomic_replaces_the_file_whole_and_keeps_its_permissions(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    write_atomic(path, "first\n")
    assert path.read_text() == "first\n" and (path.stat().st_mode & 0o777) == 0o644  # not mkstemp's 0600
    path.chmod(0o600)
    write_atomic(path, b"second\n")
    assert path.read_text() == "second\n" and (path.stat().st_mode & 0o777) == 0o600
    assert _leftovers(tmp_path) == []


def test_a_serialisation_that_fails_midway_leaves_the_previous_file(tmp_path: Path) -> None:
    path = tmp_path / "capture.pt"
    with atomic_open(path) as handle:
        torch.save({"rows": torch.arange(4)}, handle)

    class Unpicklable:
        def __reduce__(self) -> tuple[object, ...]:
            raise KeyboardInterrupt  # an interrupt while torch.save is writing

    with pytest.raises(KeyboardInterrupt), atomic_open(path) as handle:
        torch.save({"rows": torch.arange(1 << 16), "later": Unpicklable()}, handle)
        assert handle.tell() > 0  # not reached; bytes of the new file were written by then
    assert torch.equal(torch.load(path)["rows"], torch.arange(4))
    assert _leftovers(tmp_path) == []


def test_a_failed_rename_leaves_the_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = results.write_results("r", {"rows": [1, 2]}, tmp_path / "r.json")

    def fail(src: str, dst: str) -> None:
        raise OSError("simulated: the rename never happened")

    monkeypatch.setattr(durable.os, "replace", fail)
    with pytest.raises(OSError, match="simulated"):
        results.write_results("r", {"rows": [1, 2, 3]}, path)
    assert json.loads(path.read_text())["rows"] == [1, 2]
    assert _leftovers(tmp_path) == []


def test_write_results_cut_short_by_a_full_disk_leaves_the_previous_file(tmp_path: Path) -> None:
    """Writing in place (truncate, then write) would leave the first 4 KiB of the new payload."""
    path = tmp_path / "quality.json"
    results.write_results("quality", {"rows": list(range(10))}, path)
    before = path.read_text()
    child = _child("""
        from benchmarks.lib.results import write_results
        try:
            write_results("quality", {"rows": list(range(100_000))}, sys.argv[1])
        except OSError as error:
            sys.exit(f"failed: {error}")
    """, str(path), max_file_bytes=4096)
    _, stderr = child.communicate(timeout=120)
    assert child.returncode != 0 and "failed: " in stderr and "File too large" in stderr, stderr
    assert path.read_text() == before and json.loads(before)["rows"] == list(range(10))
    assert _leftovers(tmp_path) == []


def test_a_write_killed_midway_leaves_the_previous_file(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    write_atomic(path, '{"rows": [1]}\n')
    child = _child("""
        import time
        from specprefill_rag.durable import atomic_open
        with atomic_open(sys.argv[1]) as handle:
            handle.write(b'{"rows": [' + b"1, " * (1 << 20))
            handle.flush()
            print("writing", flush=True)
            time.sleep(60)
    """, str(path), pipe="stdout")
    assert child.stdout is not None and child.stdout.readline() == "writing\n"
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    assert json.loads(path.read_text()) == {"rows": [1]}
    assert len(_leftovers(tmp_path)) == 1  # a killed writer leaves its hidden temporary file, nothing else


# -- JSON-lines files -------------------------------------------------------------------------


def test_a_torn_last_line_is_skipped_on_reading_and_cut_before_the_next_append(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "evidence.jsonl"
    for i in range(3):
        results.append_jsonl(path, {"id": i})
    with open(path, "ab") as handle:
        handle.write(b'{"id": 3, "results": {"library def')  # a crash mid-append
    assert results.read_jsonl(path) == [{"id": 0}, {"id": 1}, {"id": 2}]
    assert evidence.load_rows(path) == [{"id": 0}, {"id": 1}, {"id": 2}]
    assert "torn last line" in capsys.readouterr().err
    results.append_jsonl(path, {"id": 3})
    assert path.read_text() == "".join(json.dumps({"id": i}) + "\n" for i in range(4))
    assert results.read_jsonl(path) == [{"id": i} for i in range(4)]


def test_an_unterminated_last_line_that_parses_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text('{"id": 0}\n{"id": 1}')
    assert results.read_jsonl(path) == [{"id": 0}, {"id": 1}]
    results.append_jsonl(path, {"id": 2})
    assert results.read_jsonl(path) == [{"id": 0}, {"id": 1}, {"id": 2}]


def test_a_bad_line_before_the_last_is_an_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text('{"id": 0}\n{"id": \n{"id": 2}\n')
    with pytest.raises(ValueError, match=r"rows.jsonl, line 2: not a JSON record"):
        results.read_jsonl(path)


def test_an_append_cut_short_by_a_full_disk_is_repaired_on_resume(tmp_path: Path) -> None:
    path = tmp_path / "evidence.jsonl"
    rows = [{"task": "needle", "id": f"n{i}"} for i in range(5)]
    for row in rows:
        results.append_jsonl(path, row)
    child = _child("""
        from pathlib import Path
        from benchmarks.lib.results import append_jsonl
        try:
            append_jsonl(Path(sys.argv[1]), {"task": "needle", "id": "big", "results": ["x" * 9000]})
        except OSError as error:
            sys.exit(f"failed: {error}")
    """, str(path), max_file_bytes=path.stat().st_size + 100)
    _, stderr = child.communicate(timeout=120)
    assert child.returncode != 0 and "File too large" in stderr, stderr
    assert not path.read_bytes().endswith(b"\n")  # torn: 100 bytes of the big row
    assert evidence.load_rows(path) == rows  # the resume reads every earlier row
    results.append_jsonl(path, {"task": "needle", "id": "big"})
    assert evidence.load_rows(path) == [*rows, {"task": "needle", "id": "big"}]
    assert path.read_text().count("\n") == 6


def test_a_torn_cached_capture_is_captured_again(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    where = tmp_path / "needle-0123.pt"
    evidence.save_capture({"blocks": ["greedy"], "0max": torch.ones(2, 3)}, where)
    loaded = evidence.load_capture(where)
    assert loaded is not None and loaded["blocks"] == ["greedy"]
    where.write_bytes(where.read_bytes()[:100])  # a capture torn by a crash before saves were atomic
    assert evidence.load_capture(where) is None
    assert "unreadable cached capture" in capsys.readouterr().err
    assert evidence.load_capture(tmp_path / "absent.pt") is None
