"""The draft's throughput under concurrency: prompts scored per second when concurrent requests
share draft passes (``DraftConfig.max_batch``), and what padding costs when their lengths differ.

For each prompt length L and batch size B, B prompts shaped like assembled RAG prompts (random
token ids, a protected head and question tail, ``gpu_pair.synthetic_prompt``) are scored three ways,
interleaved per repetition, nothing reused between repetitions (``cold``):

    alone    one ``score`` call per prompt, one after another (batch 1)
    padded   one ``score_many`` call: one right-padded pass (``batch_pad_limit=1``)
    buckets  one ``score_many`` call split into passes of near-equal lengths (``--pad-limit``)

With ``--spread`` s the lengths are drawn in [L(1 - s), L(1 + s)] (0: all L), as concurrent RAG
prompts differ. Each row gives prompts per second for each way, the ratio to alone, the share
of the padded pass that was padding, and the largest score difference from alone (float
rounding, not zero: a batch changes the shapes of the matrix products).

    python -m benchmarks.suites.draft_batch                  # CPU: the packaged 0.5B draft
    python -m benchmarks.suites.draft_batch --shape llama-1b --lengths 4096 8192 \\
        --batches 1 4 8 16 --spreads 0 0.25                  # GPU: a Llama-3.2-1B-shaped draft
    python -m benchmarks.suites.draft_batch --tiny --out /tmp/draft_batch.json
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from benchmarks.lib.gpu_pair import LLAMA_3_2_1B, QWEN2_5_0_5B, TINY_DRAFT, build, synthetic_prompt
from benchmarks.lib.machine import best_dtype, cold, command_line, machine_info, model_dtype_name, offline
from benchmarks.lib.results import write_results
from specprefill_rag import DraftConfig, DraftModel
from specprefill_rag.draft.probe import padding_share
from specprefill_rag.loading import DEFAULT_DRAFT

SHAPES = {"llama-1b": ("llama", LLAMA_3_2_1B), "qwen-0.5b": ("qwen2", QWEN2_5_0_5B), "tiny": ("llama", TINY_DRAFT)}
WAYS = ("alone", "padded", "buckets")


def load_draft(args: argparse.Namespace) -> DraftModel:
    """The draft: packaged weights by name (``--draft``), or random weights of ``--shape``."""
    config = cold(DraftConfig())
    if args.shape is None:
        return DraftModel.from_pretrained(args.draft, config, dtype=args.dtype, device=args.device)
    family, shape = SHAPES[args.shape]
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = "cpu" if device == "auto" else device
    dtype = getattr(torch, best_dtype(device) if args.dtype == "auto" else args.dtype)
    return DraftModel(build(family, shape, dtype, device, seed=2), None, config)


def batch_lengths(length: int, batch: int, spread: float, seed: int) -> list[int]:
    """``batch`` prompt lengths drawn uniformly within ``spread`` of ``length`` (seeded)."""
    rng = random.Random(seed)
    return [round(length * (1 + rng.uniform(-spread, spread))) for _ in range(batch)]


def sync(draft: DraftModel) -> None:
    if draft.device.type == "cuda":
        torch.cuda.synchronize()


def row(draft: DraftModel, length: int, batch: int, spread: float, args: argparse.Namespace) -> dict[str, Any]:
    """One (length, batch, spread) cell: each way's median seconds over ``args.reps``."""
    lengths = batch_lengths(length, batch, spread, seed=length * 31 + batch)
    vocab = int(draft.model.config.vocab_size)
    prompts = [synthetic_prompt(n, vocab, seed=i) for i, n in enumerate(lengths)]
    ids = [p[0] for p in prompts]
    questions = [torch.arange(n - 64, n) for n in lengths]
    contexts = [~p[1] for p in prompts]
    base = draft.config
    configs = {"padded": dataclasses.replace(base, batch_pad_limit=1.0),
               "buckets": dataclasses.replace(base, batch_pad_limit=args.pad_limit)}

    def score(way: str) -> list[Any]:
        if way == "alone":
            return [draft.score(i, question=q, context=c) for i, q, c in zip(ids, questions, contexts, strict=True)]
        return bucketed(draft, ids, questions, contexts, configs[way])

    seconds: dict[str, list[float]] = {way: [] for way in WAYS}
    scores: dict[str, list[Any]] = {}
    for rep in range(args.reps + 1):  # the first repetition warms up and is not timed
        for way in WAYS if rep % 2 else WAYS[::-1]:
            sync(draft)
            start = time.perf_counter()
            scores[way] = score(way)
            sync(draft)
            if rep:
                seconds[way].append(time.perf_counter() - start)
    med = {way: statistics.median(s) for way, s in seconds.items()}
    out: dict[str, Any] = {"length": length, "batch": batch, "spread": spread, "lengths": lengths,
                           "padding_share": padding_share(lengths), "seconds": med,
                           "prompts_per_s": {way: batch / s for way, s in med.items()},
                           "vs_alone": {way: med["alone"] / s for way, s in med.items()}}
    out["max_score_diff"] = {way: max(float((a.scores - b.scores).abs().max()) for a, b in
                                      zip(scores["alone"], scores[way], strict=True)) for way in WAYS[1:]}
    print(f"L={length} B={batch} spread={spread:g} (padding {out['padding_share']:.0%}): "
          + ", ".join(f"{way} {out['prompts_per_s'][way]:.2f} prompts/s ({out['vs_alone'][way]:.2f}x)"
                      for way in WAYS), flush=True)
    return out


def bucketed(draft: DraftModel, ids: Sequence[torch.Tensor], questions: Sequence[torch.Tensor],
             contexts: Sequence[torch.Tensor], config: DraftConfig) -> list[Any]:
    """The scorer's batch rule (``DraftScorer``: one padded pass per length bucket, ``in_buckets``)
    on bare token ids, results in order."""
    from specprefill_rag.draft.probe import in_buckets

    return in_buckets([int(i.numel()) for i in ids], config.batch_pad_limit, lambda group: draft.score_batch(
        [ids[i] for i in group], questions=[questions[i] for i in group], contexts=[contexts[i] for i in group],
        config=config))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="packaged draft (default %(default)s)")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="random weights of a published shape instead of --draft (the GPU runs)")
    p.add_argument("--tiny", action="store_true", help="a tiny random draft, short prompts (a quick check)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto: the device's fastest (bf16 where native)")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--spreads", type=float, nargs="+", default=[0.0, 0.25])
    p.add_argument("--pad-limit", type=float, default=DraftConfig().batch_pad_limit,
                   help="batch_pad_limit of the buckets way (default: the library's, %(default)s)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", default=None, help="result JSON (default benchmarks/results/draft_batch.json)")
    args = p.parse_args(argv)
    if args.tiny:
        args.shape, args.lengths = "tiny", [256]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    offline(args.threads)
    draft = load_draft(args)
    name = args.draft if args.shape is None else f"{args.shape}-shaped (random weights)"
    print(f"draft {name} on {draft.device} in {model_dtype_name(draft.model)}", flush=True)
    rows = [row(draft, length, batch, spread, args)
            for length in args.lengths for spread in args.spreads for batch in args.batches]
    payload = {"benchmark": "draft_batch", "command": command_line(argv, "benchmarks.suites.draft_batch"),
               "machine": machine_info(), "draft": name, "device": str(draft.device),
               "dtype": model_dtype_name(draft.model), "pad_limit": args.pad_limit, "reps": args.reps, "rows": rows}
    path = write_results("draft_batch", payload, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
