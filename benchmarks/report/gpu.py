"""The GPU's own pieces of the TTFT sections: the placeholder where no GPU ran, the relabelling
of look-ahead variants that ran eagerly in older ``gpu_ttft.json`` runs, and one layer's
look-ahead attention per variant (``gpu_attention.json``). The GPU TTFT tables themselves are
``ttft.ttft_section``'s, in milliseconds."""

from __future__ import annotations

from typing import Any

GPU_NOT_RUN = [
        "## Time to first token at real model sizes (GPU)",
        "",
        "Not run: no GPU was available to this run. `benchmarks/suites/gpu_ttft.py` is ready for one H200 "
        "(torch + transformers, no vLLM, no network, no input files; about 3–5 minutes): it builds "
        "Llama-3.2-1B- and Llama-3.1-8B-shaped models with random bf16 weights and measures the same "
        "table at 8k/16k/32k, with the library's real capture path. It was dry-run on CPU with "
        "`--tiny` shapes.",
        "",
]


EAGER_NOTE = " (ran eagerly: this run captured no graphs of its shape)"


def label_eager_variants(gpu: dict[str, Any]) -> dict[str, Any]:
    """``gpu`` with its look-ahead variants relabelled where they ran eagerly under a "CUDA
    graphs" label: runs from before ``gpu_ttft.capture_variant_graphs`` (their ``graphs`` has no
    ``variant_shapes``) captured only the default's loop shape, guessed tokens per forward, so a
    graphed variant of one token per forward found no graph and ran eagerly."""
    if "variant_shapes" in (gpu.get("graphs") or {"variant_shapes": None}):
        return gpu

    def label(name: str) -> str:
        return name + EAGER_NOTE if "CUDA graphs" in name and "guesses per forward" not in name else name

    def relabel(row: dict[str, Any]) -> dict[str, Any]:
        return {**row, "lookahead_scoring": {label(k): v for k, v in row.get("lookahead_scoring", {}).items()}}

    runs = [{**run, "lengths": [relabel(row) for row in run.get("lengths", [])]} for run in gpu.get("runs", [])]
    return {**gpu, "runs": runs}


def gpu_attention_section(data: dict[str, Any] | None) -> list[str]:
    """One layer's attention of a 7-token look-ahead forward, per variant and cache length
    (``benchmarks/suites/gpu_attention.py``)."""
    if not data or not data.get("rows"):
        return []
    rows = data["rows"]
    variants = list(dict.fromkeys(name for r in rows for name in r["us"]))
    shapes = data.get("shapes", {})
    m = data.get("machine", {})
    out = ["### The look-ahead's attention, one layer (GPU)", "", f"- command: `{data.get('command')}`",
           f"- machine: {m.get('gpu')}; torch {m.get('torch')}; run finished (UTC): {data.get('created_utc')}",
           f"- {shapes.get('queries')} queries, {shapes.get('heads')} query / {shapes.get('kv_heads')} key-value heads "
           f"of {shapes.get('head_dim')}, {shapes.get('dtype')}; µs per call replayed from a CUDA graph",
           *([f"- {data['note']}"] if data.get("note") else []), "",
           "| variant | " + " | ".join(f"{r['n_keys']} keys" for r in rows) + " |",
           "|---|" + "---|" * len(rows)]
    for name in variants:
        cells = [f"{r['us'][name]:.0f}" if name in r["us"] else "–" for r in rows]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out + [""]
