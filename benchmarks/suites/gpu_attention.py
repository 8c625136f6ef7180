"""One layer's attention of a look-ahead forward on one GPU: SDPA against the short path.

A look-ahead forward feeds 7 tokens (1 + 6 guesses, the default on CUDA) that attend to a whole
prompt's keys under a mask. Per cache length (4k … 32k keys, Llama-3.2-1B's 32 query and 8
key/value heads of 64, bf16), each replayed 50 times from a CUDA graph as the look-ahead replays
it: transformers' SDPA path (what the draft used before 2026-12-04), the library's
``draft.attend_short_queries`` with its values product in one piece and in blocks of 256 /
512 / 2048 keys, the logits in bf16 (timing only: the library keeps them in float32), and the
two products alone; each output's largest difference from float32 SDPA. The whole scoring
through either path is ``benchmarks/suites/gpu_ttft.py``'s attention table.

    python -m benchmarks.suites.gpu_attention            # one GPU, ~15 s; writes benchmarks/results/gpu_attention.json
    python -m benchmarks.suites.gpu_attention --tiny     # CPU dry run (plain timing, small shapes)
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from benchmarks.lib.machine import machine_info
from benchmarks.lib.results import write_results

GUESSED = 7  # tokens per look-ahead forward (1 + 6 guesses)
EXTRA = 49  # the loop's own columns after the prompt (7 forwards of 7)


class _Module(torch.nn.Module):
    """What transformers' SDPA wrapper reads off an attention module."""

    def __init__(self, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal, self.layer_idx = heads // kv_heads, True, 0


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
         scaling: float | None) -> torch.Tensor:
    """(batch, q, heads, head_dim): transformers' SDPA path (``repeat_kv`` + the fused kernel), what
    the draft's look-ahead used before ``draft.attend_short_queries``; the reference of its tests."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = _Module(query.shape[1], key.shape[1])
    return sdpa_attention_forward(module, query, key, value, mask, dropout=0.0, scaling=scaling)[0]


def time_us(fn: Callable[[], Any], cuda: bool, iters: int = 50) -> float:
    """Microseconds per call: replayed from a CUDA graph on a GPU, plain calls on a CPU."""
    if not cuda:
        fn()
        start = time.perf_counter()
        for _ in range(3):
            fn()
        return (time.perf_counter() - start) / 3 * 1e6
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / iters * 1e3


def bf16_logits(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Timing only: the short path with its logits in the cache's dtype (no float32 keys)."""
    batch, heads, q, dim = query.shape
    kv_heads, k = key.shape[1], key.shape[2]
    group = heads // kv_heads
    logits = torch.matmul(query.reshape(batch, kv_heads, group * q, dim), key.transpose(-1, -2)).float()
    logits = logits.mul_(dim**-0.5).view(batch, kv_heads, group, q, k).masked_fill_(~mask.unsqueeze(2), -1e30)
    probs = logits.softmax(-1).view(batch, kv_heads, group * q, k).to(value.dtype)
    return torch.matmul(probs, value)


@torch.inference_mode()
def length_row(n: int, heads: int, kv_heads: int, dim: int, device: str) -> dict[str, Any]:
    from specprefill_rag.draft.probe import attend_short_queries

    cuda, cols, scale = device == "cuda", n + EXTRA, dim**-0.5
    gen = torch.Generator(device=device).manual_seed(n)
    q = torch.randn(1, heads, GUESSED, dim, device=device, dtype=torch.bfloat16, generator=gen)
    key, value = (torch.randn(1, kv_heads, cols, dim, device=device, dtype=torch.bfloat16, generator=gen)
                  for _ in range(2))
    mask = torch.zeros(1, 1, GUESSED, cols, dtype=torch.bool, device=device)
    mask[..., : n - 100] = True  # the prompt (its padded tail unread) ...
    mask[0, 0, :, n : n + GUESSED] = torch.ones(GUESSED, GUESSED, dtype=torch.bool, device=device).tril()  # ... itself
    probs = torch.rand(1, kv_heads, heads // kv_heads * GUESSED, cols, device=device).softmax(-1).to(torch.bfloat16)
    variants: dict[str, Callable[[], Any]] = {
        "sdpa": lambda: sdpa(q, key, value, mask, scale),
        "short, one values product": lambda: attend_short_queries(q, key, value, mask, scale, block=1 << 30),
        **{f"short, values in blocks of {b}": functools.partial(attend_short_queries, q, key, value, mask, scale, b)
           for b in (256, 512, 2048)},
        "short, bf16 logits (timing only)": lambda: bf16_logits(q, key, value, mask),
        "piece: float32 keys + logits": lambda: torch.matmul(
            q.reshape(1, kv_heads, -1, dim).float(), key.float().transpose(-1, -2)),
        "piece: probs x values, one product": lambda: torch.matmul(probs, value),
    }
    row: dict[str, Any] = {"n_keys": n, "us": {name: time_us(fn, cuda) for name, fn in variants.items()}}
    want = sdpa(q.float(), key.float(), value.float(), mask, scale)
    compared = ("sdpa", "short, one values product", "short, values in blocks of 512")
    outputs = {name: variants[name]() for name in compared}
    row["max_diff_vs_float32"] = {name: float((out.float() - want).abs().max()) for name, out in outputs.items()}
    print(f"{n} keys: " + ", ".join(f"{name} {us:.0f} µs" for name, us in row["us"].items()), flush=True)
    return row


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU dry run with small shapes")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        print("no GPU: run with --tiny for a CPU dry run", file=sys.stderr)
        return 2
    heads, kv_heads, dim = (8, 2, 16) if args.tiny else (32, 8, 64)
    lengths = (256, 1024) if args.tiny else (4096, 8192, 16384, 32768)
    rows = [length_row(n, heads, kv_heads, dim, "cuda" if cuda else "cpu") for n in lengths]
    command = "python -m benchmarks.suites.gpu_attention" + (" --tiny" * args.tiny)
    payload = {"benchmark": "gpu_attention", "command": command,
               "machine": machine_info(), "shapes": {"heads": heads, "kv_heads": kv_heads, "head_dim": dim,
                                                     "queries": GUESSED, "dtype": "bfloat16"}, "rows": rows}
    path = write_results("gpu_attention_tiny" if args.tiny else "gpu_attention", payload, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
