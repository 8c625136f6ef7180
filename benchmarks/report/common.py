"""What every section of the page shares: reading result files, formatting cells (seconds,
values with their confidence intervals, pass/fail marks), the run's provenance lines, the labels
of methods, metrics and dtypes, and the one legend under a figure's panels."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

METHOD_LABELS = {
    "full": "full prompt",
    "specprefill": "SpecPrefill",
    "reference": "reference scoring (look-ahead 8, all layers, 32-token chunks)",
    "contiguous": "SpecPrefill, contiguous positions (ablation)",
    "random": "random chunks",
    "llmlingua": "LongLLMLingua (same draft LM)",
    "text": "SpecPrefill text mode (compress(): kept sentences as an ordinary prompt)",
    "ragcompress": "ragcompress (attention scorer, same draft LM)",
}
METRIC_NAMES = {"f1": "F1", "acc": "accuracy", "em": "EM"}
DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
# Where the page says once what every table of a kind means; each table links to it.
READING = "[reading the tables](#reading-the-tables)"


def load(results: Path, name: str) -> dict[str, Any] | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def load_all(results: Path, benchmark: str) -> list[tuple[str, dict[str, Any]]]:
    """(file stem, data) of every ``benchmark*.json`` but the smoke runs' ``*_tiny.json``, plain name first."""
    found = []
    for path in sorted(results.glob(f"{benchmark}*.json")):
        if not path.stem.endswith("_tiny"):
            found.append((path.stem, json.loads(path.read_text())))
    return sorted(found, key=lambda item: item[0] != benchmark)


def pair(data: dict[str, Any]) -> str:
    """'draft → main' of a result file."""
    models = data.get("models", {})
    return f"{models.get('draft', '?')} → {models.get('main', '?')}"


def _ok(ratio: float | None, target: float, higher_is_better: bool) -> str:
    if ratio is None:
        return "–"
    met = ratio >= target if higher_is_better else ratio <= target
    return "✓" if met else "✗"


def _s(x: float | None, unit: str = "s") -> str:
    if x is None:
        return "–"
    return f"{x * 1e3:.0f} ms" if unit == "ms" else f"{x:.2f} s" if x < 10 else f"{x:.1f} s"


def _nan(x: Any) -> bool:
    return x is None or (isinstance(x, float) and x != x)


def _ci(x: float | None, ci: Sequence[float] | None = None, sign: bool = False, bold: bool = False) -> str:
    """'0.82 [0.71, 0.90]': a value with its 95% confidence interval ('–' when missing)."""
    if _nan(x):
        return "–"
    spec = "+.2f" if sign else ".2f"
    text = f"**{format(x, spec)}**" if bold else format(x, spec)
    if ci and len(ci) == 2 and not any(_nan(v) for v in ci):
        text += f" [{format(ci[0], spec)}, {format(ci[1], spec)}]"
    return text


def meta_lines(data: dict[str, Any]) -> list[str]:
    m = data.get("machine", {})
    machine = ", ".join(
        str(x)
        for x in (
            m.get("cpu"),
            f"{m.get('cpu_count')} cores" if m.get("cpu_count") else None,
            f"{m.get('ram_gib')} GiB RAM" if m.get("ram_gib") else None,
            m.get("gpu"),
        )
        if x
    )
    # Older files name it "load_avg_at_start", but it was always read when the results were written.
    load = m.get("load_avg_at_end", m.get("load_avg_at_start"))
    commands = data.get("commands") or [data.get("command")]
    lines = [
        f"- command: `{commands[-1]}`" if len(commands) == 1 else
        "- commands (resumed into one results file, last one last): " + "; ".join(f"`{c}`" for c in commands),
        f"- models: draft `{data['models']['draft']}` → main `{data['models']['main']}`",
        f"- machine: {machine}; torch {m.get('torch')}, transformers {m.get('transformers')}, "
        f"{m.get('torch_threads')} torch threads" + (f"; load average (1/5/15 min) at the end {load}" if load else ""),
        f"- run finished (UTC): {data.get('created_utc')}"
        + ("" if data.get("complete", True) else " — **incomplete run: only the rows below were measured**"),
    ]
    return lines


def dtype_parts(dtypes: dict[str, str], skip: str | None = None) -> list[str]:
    """A result file's ``{role: dtype}`` as short labels by role ("draft bf16", "main fp32"),
    leaving out roles in ``skip``'s dtype."""
    return [f"{role} {DTYPE_NAMES.get(d, d)}" for role, d in sorted(dtypes.items()) if d != skip]


def _bounds(value: float, ci: Sequence[float] | None) -> tuple[float, float]:
    """(low, high) of a CI, the value itself where there is none."""
    if not ci or len(ci) != 2 or any(_nan(v) for v in ci):
        return value, value
    return min(ci[0], value), max(ci[1], value)


def _legend_below(fig: Any, axes: Sequence[Any], ncol: int = 6, bottom: float = 0.1) -> None:
    """One legend under the panels, with every label of any panel once (methods differ per task).
    The panels keep at least ``bottom`` of the figure below them, more where the legend's rows need
    it (~0.17 inch a row at fontsize 7), so the legend never covers an axis's labels."""
    handles: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    rows = -(-len(handles) // ncol) if handles else 0
    fig.tight_layout(rect=(0, max(bottom, (0.17 * rows + 0.1) / fig.get_figheight()), 1, 1))
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(len(handles), ncol), fontsize=7,
                   frameon=False)
