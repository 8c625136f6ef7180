"""Result files: where they go, their names, crash-safe JSON writes and JSON-lines appends, and
the digest that lets a resumed run check it is reusing the same example."""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

import torch

from specprefill_rag.durable import write_atomic
from specprefill_rag.loading import DEFAULT_DRAFT, DEFAULT_MAIN

__all__ = [
    "RESULTS_DIR",
    "ROOT",
    "append_jsonl",
    "prompt_digest",
    "read_jsonl",
    "result_name",
    "same_example",
    "write_results",
]

ROOT = Path(__file__).resolve().parents[2]  # the repository
RESULTS_DIR = ROOT / "benchmarks" / "results"


def result_name(
    benchmark: str,
    *,
    main: str = DEFAULT_MAIN,
    draft: str = DEFAULT_DRAFT,
    backends: Sequence[str] = ("transformers",),
    tiny: bool = False,
    quick: bool = False,
) -> str:
    """File stem under ``benchmarks/results/``; only the default models and backend get the plain name.

    ``ttft``, ``ttft_vllm_server``, ``quality_quick``, ``quality_draft-smollm2-135m-instruct``, ...:
    a run with another draft, main model or backend never overwrites the default results.
    """
    if tiny:
        return f"{benchmark}_tiny"
    parts = [benchmark]
    if quick:
        parts.append("quick")
    if main != DEFAULT_MAIN:
        parts.append(f"main-{_slug(main)}")
    if draft != DEFAULT_DRAFT:
        parts.append(f"draft-{_slug(draft)}")
    if list(backends) != ["transformers"]:
        parts.append("-".join(backends))
    return "_".join(parts)


def _slug(model: str) -> str:
    """A model name, directory or GGUF path as a file-name piece."""
    name = Path(model.rstrip("/")).name
    return re.sub(r"[^A-Za-z0-9.]+", "-", name.removesuffix(".gguf")).strip("-").lower() or "model"


def write_results(name: str, payload: dict[str, Any], out: str | Path | None = None) -> Path:
    """Write ``payload`` as JSON to ``out`` or ``benchmarks/results/<name>.json``, crash-safely
    (``write_atomic``): a resumable run rewrites its file after every example, and an interrupt
    mid-write must leave the previous version whole."""
    path = Path(out) if out else RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"created_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M:%S"), **payload}
    write_atomic(path, json.dumps(payload, indent=1, default=str) + "\n")
    return path


def prompt_digest(prompt: Any) -> str:
    """A short digest of an assembled prompt's token ids: what a results row records so that a
    resumed run can tell it is reusing the same example (``same_example``)."""
    return hashlib.sha1(prompt.token_ids.to(torch.int64).numpy().tobytes()).hexdigest()[:12]


def same_example(rows: Sequence[dict[str, Any]], prompt: Any, where: str | Path) -> None:
    """Refuse to reuse an earlier run's rows of an example whose prompt has changed since they
    were written: a row's ``prompt_sha`` (rows before it: its ``n_prompt``) must match ``prompt``.

    An id names a task, length and depth, not its text: the needle and multi-key haystacks are
    drawn from one seeded stream over every (length, depth) asked, in order, so the same id from
    another list of lengths or depths is another haystack.
    """
    digest = prompt_digest(prompt)
    for row in rows:
        if "prompt_sha" in row:
            same = row["prompt_sha"] == digest
        else:
            same = row.get("n_prompt", prompt.n_tokens) == prompt.n_tokens
        if not same:
            raise SystemExit(
                f"{where} holds {row['task']} {row['id']} for another prompt ({row.get('n_prompt')} tokens, this run "
                f"builds {prompt.n_tokens}): the examples changed since it was written (needle and multi-key "
                "haystacks depend on the whole list of lengths and depths, in order); resume it with the command "
                "that wrote it, or pass another --out"
            )

# -- JSON-lines result files, appended one example at a time --------------------------------


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append ``record`` to ``path`` as one JSON line and fsync it. A torn last line (a crash
    mid-append, which ``read_jsonl`` skips) is cut off first, so the new line stands on its own;
    an unterminated last line that parses is kept and terminated."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab+") as handle:  # appends go to the end whatever the position
        end = handle.seek(0, os.SEEK_END)
        start = _last_line_start(handle, end)
        if start < end:
            handle.seek(start)
            tail = handle.read()
            if _parses(tail):
                handle.write(b"\n")
            else:
                print(f"warning: {path}: cutting a torn last line ({end - start} bytes) before appending",
                      file=sys.stderr, flush=True)
                handle.truncate(start)
        handle.write((json.dumps(record) + "\n").encode())
        handle.flush()
        os.fsync(handle.fileno())


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (none if it does not exist). An unterminated last line
    that does not parse is a crash mid-append: skipped with a warning (``append_jsonl`` cuts it
    off). Any other line that does not parse is an error naming it."""
    if not path.exists():
        return []
    data = path.read_bytes()
    lines = data.split(b"\n")
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError as error:
            if number == len(lines):  # after the last newline: torn
                print(f"warning: {path}: skipping a torn last line ({len(line)} bytes; an interrupted append)",
                      file=sys.stderr, flush=True)
                continue
            raise ValueError(f"{path}, line {number}: not a JSON record ({error})") from error
    return rows


def _last_line_start(handle: BinaryIO, end: int) -> int:
    """The offset just past the last newline of a binary file of ``end`` bytes (0 if none)."""
    position = end
    while position > 0:
        step = min(position, 1 << 16)
        handle.seek(position - step)
        found = handle.read(step).rfind(b"\n")
        if found >= 0:
            return position - step + found + 1
        position -= step
    return 0


def _parses(line: bytes) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True
