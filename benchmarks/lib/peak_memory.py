"""Peak memory of scoring against a plain draft forward, each measured in a fresh process (the
``--_memory-child`` of ``bench ttft``): on a GPU ``torch.cuda.max_memory_allocated``; on a CPU
the same quantity, the weights plus the peak of what the run allocated (glibc malloc statistics
sampled every millisecond; the process's RSS beside it, used where glibc is missing).
``--memory-only`` puts a new measurement into an existing result file (``replace_memory``).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.lib.essay_prompts import essay_passages_ids
from benchmarks.lib.results import RESULTS_DIR, ROOT, write_results
from benchmarks.lib.tiny import tiny_engine
from benchmarks.lib.ttft_timing import plain_forward_s


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")
    ]


def heap_reader() -> Any:
    """A function returning the bytes malloc has handed out and not freed (glibc), or None elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2

    def in_use() -> int:
        info = mallinfo2()
        return int(info.uordblks + info.hblkhd)  # arena chunks in use + mmap-ed chunks (large tensors)

    return in_use


class PeakMemory:
    """Samples this process's heap in use (glibc malloc, where torch's CPU tensors live) and its RSS
    in a thread; ``heap_peak`` / ``rss_peak`` are the highest seen. The heap figure counts what was
    allocated, like CUDA's allocator statistics; RSS also moves with the page cache and mmap-ed
    weight files, so it is kept only for reference."""

    def __init__(self, interval_s: float = 0.001) -> None:
        import psutil

        self._proc = psutil.Process()
        self._heap = heap_reader()
        self._interval = interval_s
        self._stop = threading.Event()
        self.rss_baseline = self.rss_peak = self._proc.memory_info().rss
        self.heap_baseline = self.heap_peak = self._heap() if self._heap else None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        self.rss_peak = max(self.rss_peak, self._proc.memory_info().rss)
        if self._heap and self.heap_peak is not None:
            self.heap_peak = max(self.heap_peak, self._heap())

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self._interval)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def memory_child(kind: str, draft_name: str, length: int, tiny: bool, device: str,
                 dtype: str = "auto") -> dict[str, Any]:
    """Run in a fresh process: peak memory of one plain draft forward or one scoring run."""
    if tiny:
        draft = tiny_engine().draft
    else:
        from specprefill_rag.draft import DraftModel

        draft = DraftModel.from_pretrained(draft_name, device=device, dtype=dtype)
    vocab = int(draft.model.config.vocab_size)
    ids = torch.randint(0, min(vocab, 30000), (length,), generator=torch.Generator().manual_seed(0))
    if not tiny:
        ids = torch.tensor(essay_passages_ids(draft.tokenizer, length))
    # Warm up on a short input so one-time allocations are not counted.
    plain_forward_s(draft.model, ids[:64])
    draft.score(ids[:64]) if kind == "score" else None
    gc.collect()
    on_gpu = draft.device.type == "cuda"
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    with PeakMemory() as mem:
        start = time.perf_counter()
        if kind == "plain":
            plain_forward_s(draft.model, ids)
        else:
            draft.score(ids)
        seconds = time.perf_counter() - start
    out: dict[str, Any] = {"kind": kind, "length": length, "seconds": seconds}
    out.update(rss_peak_bytes=mem.rss_peak, rss_baseline_bytes=mem.rss_baseline)
    if on_gpu:
        out.update(peak_bytes=torch.cuda.max_memory_allocated(), baseline_bytes=before, source="cuda")
    elif mem.heap_peak is not None and mem.heap_baseline is not None:
        # Like CUDA's statistics: the weights, plus the most the run had allocated at once.
        weights = sum(t.nbytes for t in (*draft.model.parameters(), *draft.model.buffers()))
        out.update(peak_bytes=weights + mem.heap_peak - mem.heap_baseline, baseline_bytes=weights, source="heap")
    else:
        out.update(peak_bytes=mem.rss_peak, baseline_bytes=mem.rss_baseline, source="rss")
    out["delta_bytes"] = out["peak_bytes"] - out["baseline_bytes"]
    return out


def measure_memory(draft_name: str, length: int, tiny: bool, device: str, dtype: str = "auto") -> dict[str, Any]:
    """Peak memory of scoring vs a plain draft forward at ``length``, each in its own process."""
    rows = {}
    for kind in ("plain", "score"):
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.suites.ttft",
            "--_memory-child",
            kind,
            "--draft",
            draft_name,
            "--device",
            device,
            "--dtype",
            dtype,
            "--lengths",
            str(length),
        ] + (["--tiny"] if tiny else [])
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            cwd=ROOT,  # the checkout: the child runs as a module
            env={**os.environ, "TQDM_DISABLE": "1"},
        )
        if proc.returncode != 0:
            return {"error": f"{kind} child failed: {proc.stderr.strip()[-500:]}"}
        rows[kind] = json.loads(proc.stdout.strip().splitlines()[-1])
    plain, score = rows["plain"], rows["score"]
    return {
        "length": length,
        "source": plain["source"],
        "plain": plain,
        "score": score,
        "peak_ratio": score["peak_bytes"] / plain["peak_bytes"],  # whole process: weights + activations
        "delta_ratio": score["delta_bytes"] / max(plain["delta_bytes"], 1),  # what the run itself added
    }


def memory_run(args: argparse.Namespace, length: int) -> dict[str, Any]:
    """Peak memory of a plain draft forward vs scoring at ``length`` tokens, printed as it is measured."""
    print(f"Peak memory at {length} tokens: plain draft forward vs scoring (fresh subprocesses) ...", flush=True)
    memory = measure_memory(args.draft, length, args.tiny, args.device, args.dtype)
    if "error" in memory:
        print(f"  {memory['error']}")
    else:
        print(
            f"  peak {memory['plain']['peak_bytes'] / 2**20:.0f} MiB vs {memory['score']['peak_bytes'] / 2**20:.0f}"
            f" MiB ({memory['peak_ratio']:.2f}x); added by the run {memory['delta_ratio']:.2f}x",
            flush=True,
        )
    return memory


def replace_memory(name: str, payload: dict[str, Any], command: str, out: str | None) -> int:
    """``--memory-only``: put the new memory entry into the existing result file (or a new one)."""
    path = Path(out) if out else RESULTS_DIR / f"{name}.json"
    data = json.loads(path.read_text()) if path.exists() else payload
    data.update(memory=payload["memory"], memory_command=command)
    print(f"\nwrote {write_results(name, data, out)}")
    return 0
