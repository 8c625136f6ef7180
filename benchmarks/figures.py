"""The benchmark page's two at-a-glance figures: TTFT speedup and answer quality against prompt length.

Self-contained: the functions take result dicts as the benchmark files hold them (already
loaded) and a path to write a PNG to, and return the series they drew (``Series``) so that a
caller can caption what is there and a test can check what was left out. ``benchmarks/report/``
calls them; the fairness rule for a TTFT baseline stays there (``unfair_baseline`` in
``report/fairness.py``) and is passed in.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DPI = 120
KEEPS = (0.1, 0.3)  # keep rates drawn, where a file holds them
# (data, run) -> why the run's baseline is unfair, None when fair: report.unfair_baseline (report/fairness.py).
UnfairRule = Callable[[dict[str, Any], dict[str, Any]], "str | None"]


@dataclass(frozen=True)
class Series:
    """One line a figure drew: its legend label, panel and points."""

    label: str
    kind: str  # "measured", "ideal" (1/(r + k)) or "reference" (the 1× / full-prompt line)
    panel: str = ""  # "CPU" or "GPU" in the speedup figure
    keep: float | None = None
    x: tuple[float, ...] = ()  # prompt tokens
    y: tuple[float, ...] = ()  # speedup (×) or quality relative to the full prompt
    n: tuple[int, ...] = ()  # examples per point (quality)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _tokens(x: float) -> str:
    return f"{x / 1024:.1f}k".replace(".0k", "k") if x >= 1024 else f"{x:.0f}"


def _length_axis(ax: Any, xs: Sequence[float]) -> None:
    """log2 x axis over the measured lengths, a tick at each power of two ("2k", "16k")."""
    ax.set_xscale("log", base=2)
    low, high = min(xs) / 1.4, max(xs) * 1.4
    ticks = [2.0**i for i in range(math.ceil(math.log2(low)), math.floor(math.log2(high)) + 1)]
    ax.set_xticks(ticks, [_tokens(x) for x in ticks])
    ax.minorticks_off()
    ax.set_xlim(low, high)
    ax.set_xlabel("prompt tokens (log scale)")


# -- TTFT speedup ----------------------------------------------------------------------------


def _machine(data: dict[str, Any], run: dict[str, Any], panel: str) -> str:
    m, s = data.get("machine", {}), data.get("settings", {})
    dtypes = run.get("dtypes") or {"main": s.get("dtype"), "draft": s.get("dtype")}
    names = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
    precision = "both " + names.get(str(dtypes.get("main")), str(dtypes.get("main")))
    if dtypes.get("main") != dtypes.get("draft"):
        precision = f"main {dtypes.get('main')}, draft {dtypes.get('draft')}"
    where = m.get("gpu") if panel == "GPU" else f"{m.get('cpu', 'CPU')}, {m.get('cpu_count', '?')} cores"
    models = data.get("models", {})
    return f"{panel}: {where}, {precision}\n{models.get('draft', '?')} →\n{models.get('main', '?')}"


def _speedup_series(panel: str, name: str, run: dict[str, Any], keeps: Sequence[float]) -> list[Series]:
    rows = sorted(run["lengths"], key=lambda row: row["n_tokens"])
    out = []
    for k in keeps:
        cells = [(row["n_tokens"], c) for row in rows for c in row["cells"] if c["keep_rate"] == k]
        if not cells:
            continue
        xs = tuple(float(n) for n, _ in cells)
        tag = f"keep {k:.0%}" + (f" ({name})" if name else "")
        out.append(Series(tag, "measured", panel, k, xs, tuple(c["speedup"] for _, c in cells)))
        out.append(Series(f"{tag} ideal 1/(r + k)", "ideal", panel, k, xs, tuple(c["ideal"] for _, c in cells)))
    return out


def speedup_vs_length(
    cpu: Sequence[tuple[str, dict[str, Any]]],
    gpu: dict[str, Any] | None,
    path: Path,
    *,
    unfair: UnfairRule,
    keeps: Sequence[float] = KEEPS,
) -> list[Series]:
    """TTFT speedup vs full prefill against prompt length: a CPU panel from the CPU TTFT files
    (``(stem, data)``) and a GPU panel from gpu_ttft.json's default run, each from fair runs only
    (``unfair(data, run)`` is None: the main model at the machine's best precision). Solid: measured;
    dashed, same colour: the ideal 1/(r + k) of the same run. Writes ``path`` unless nothing is fair;
    returns the series drawn (the 1× line included)."""
    panels: dict[str, list[tuple[str, dict[str, Any], dict[str, Any]]]] = {}
    for label, sources in (("CPU", list(cpu)), ("GPU", [("", gpu)] if gpu else [])):
        for stem, data in sources:
            for run in data.get("runs", []):
                if run.get("status") != "skipped" and run.get("lengths") and unfair(data, run) is None:
                    panels.setdefault(label, []).append((stem, data, run))
    if not panels:
        return []
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.1 * len(panels), 4.5), squeeze=False, sharey=True)
    drawn: list[Series] = []
    for ax, (panel, runs) in zip(axes[0], panels.items(), strict=True):
        named = len(runs) > 1  # several fair files: name each line's file, a marker each
        series: list[Series] = []
        for i, (stem, _, run) in enumerate(runs):
            mine = _speedup_series(panel, stem if named else "", run, keeps)
            for s in mine:
                color = f"C{list(keeps).index(s.keep or 0.0)}"
                if s.kind == "ideal":
                    ax.plot(s.x, s.y, ls="--", color=color, lw=1.1, alpha=0.7, label=s.label)
                    continue
                ax.plot(s.x, s.y, marker="osD^v"[i % 5], ls="-", color=color, lw=1.8, label=s.label)
                first = s.keep == min(keeps)  # the lowest keep's values up-left of its points, others down-right
                for x, y in zip(s.x, s.y, strict=True):
                    ax.annotate(f"{y:.2f}×", (x, y), textcoords="offset points", xytext=(-5, 5) if first else (5, -11),
                                fontsize=7, ha="right" if first else "left", color=color)
            series += mine
        ax.axhline(1.0, color="grey", lw=0.9)
        _length_axis(ax, [x for s in series for x in s.x])
        ax.set_title(_machine(runs[0][1], runs[0][2], panel), fontsize=8)
        ax.grid(alpha=0.25)
        drawn += series + [Series("1× (no gain)", "reference", panel)]
    axes[0][0].set_ylabel("TTFT speedup vs full prefill (×)")
    axes[0][0].set_ylim(bottom=0)
    handles, labels = axes[0][0].get_legend_handles_labels()
    handles.append(axes[0][0].get_lines()[-1])
    labels.append("1× (no gain)")
    fig.suptitle("SpecPrefill TTFT speedup vs prompt length (fair baselines only)", fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 3), fontsize=7.5, frameon=False)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return drawn


def speedup_caption(series: Sequence[Series]) -> str:
    """What the speedup figure shows, with the lengths each panel measured."""
    parts = []
    for panel in dict.fromkeys(s.panel for s in series if s.kind == "measured"):
        xs = sorted({x for s in series if s.panel == panel and s.kind == "measured" for x in s.x})
        parts.append(f"{panel}: {len(xs)} lengths ({', '.join(_tokens(x) for x in xs)} tokens)")
    return ("Solid: measured TTFT speedup (median of the run's repetitions); dashed, same colour: the ideal "
            "1/(r + k) with r measured in the same run; grey: 1×. Only runs with a fair baseline (the main "
            "model at the machine's best precision) are drawn. Measured: " + "; ".join(parts) + ".")


# -- answer quality --------------------------------------------------------------------------


def _family(task: str) -> str:
    """The short task a long task pads: "needle_16k" -> "needle"."""
    return re.sub(r"_\d+k$", "", task)


def _mean_tokens(rows: Sequence[dict[str, Any]], task: str) -> float | None:
    """Mean prompt tokens of a task set (all its examples, whichever keep rates reached them)."""
    sizes = [r["n_prompt"] for r in rows if r["task"] == task and r["method"] == "full"]
    sizes = sizes or [r["n_prompt"] for r in rows if r["task"] == task]
    return sum(sizes) / len(sizes) if sizes else None


def quality_points(
    runs: Sequence[tuple[str, dict[str, Any]]], method: str = "specprefill", keeps: Sequence[float] = KEEPS
) -> list[dict[str, Any]]:
    """One point per (run, task, keep rate) of ``method``: family, task, keep, mean prompt tokens of
    its examples, n, and the score relative to the full prompt on the same examples with its 95% CI
    (the summary's ``retention_vs_full`` / ``retention_ci``). Entries without a retention are left out."""
    points = []
    for stem, data in runs:
        for e in data.get("summary", []):
            ret = e.get("retention_vs_full")
            if e["method"] != method or e["keep_rate"] not in keeps or ret is None or math.isnan(ret):
                continue
            tokens = _mean_tokens(data.get("rows", []), e["task"])
            if tokens is None:
                continue
            ci = e.get("retention_ci") or (ret, ret)
            points.append({"family": _family(e["task"]), "task": e["task"], "keep": e["keep_rate"], "tokens": tokens,
                           "n": e["n"], "value": ret, "ci": (min(ci[0], ret), max(ci[1], ret)), "file": stem})
    return sorted(points, key=lambda p: (p["family"], p["keep"], p["tokens"]))


Y_RANGE = (0.4, 1.6)  # quality relative to the full prompt: CIs past this are cut at the edge


def quality_vs_length(
    runs: Sequence[tuple[str, dict[str, Any]]],
    path: Path,
    *,
    title: str = "",
    method: str = "specprefill",
    keeps: Sequence[float] = KEEPS,
) -> list[Series]:
    """Answer quality relative to the full prompt (score / full prompt's on the same examples, 95%
    CI) against the mean prompt length of each task set: colour = keep rate, marker = task (a long
    task joins the short task it pads), n per point in the legend. Writes ``path`` unless there are
    no points; returns the series drawn."""
    points = quality_points(runs, method, keeps)
    if not points:
        return []
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5.2))
    families = list(dict.fromkeys(p["family"] for p in points))
    markers = {f: "osD^vP*X"[i % 8] for i, f in enumerate(families)}
    shift = {k: 1 + (i - (len(keeps) - 1) / 2) * 0.04 for i, k in enumerate(keeps)}  # keeps' error bars apart
    drawn: list[Series] = []
    for family in families:
        for k in keeps:
            mine = [p for p in points if p["family"] == family and p["keep"] == k]
            if not mine:
                continue
            xs = [p["tokens"] * shift[k] for p in mine]
            ys = [p["value"] for p in mine]
            yerr = [[y - p["ci"][0] for y, p in zip(ys, mine, strict=True)],
                    [p["ci"][1] - y for y, p in zip(ys, mine, strict=True)]]
            ax.errorbar(xs, ys, yerr=yerr, fmt=markers[family] + "-", color=f"C{list(keeps).index(k)}", capsize=3,
                        lw=1.2, elinewidth=0.9, ms=6, alpha=0.9)
            drawn.append(Series(f"{family}, keep {k:.0%}", "measured", keep=k,
                                x=tuple(p["tokens"] for p in mine), y=tuple(ys), n=tuple(p["n"] for p in mine)))
    ax.axhline(1.0, color="black", lw=1.2)
    drawn.append(Series("full prompt (= 1)", "reference"))
    _length_axis(ax, [p["tokens"] for p in points])
    lows = [p["ci"][0] for p in points]
    highs = [p["ci"][1] for p in points]
    ax.set_ylim(max(Y_RANGE[0], min(lows) - 0.05), min(Y_RANGE[1], max(highs) + 0.05))
    ax.set_ylabel("score relative to the full prompt (95% CI)")
    ax.grid(alpha=0.25)
    ax.set_title(title or "SpecPrefill answer quality vs prompt length", fontsize=9)
    fig.tight_layout(rect=(0, 0.13, 1, 1))
    fig.legend(handles=_quality_legend(plt, points, keeps, markers), loc="lower center", ncol=3, fontsize=7.5,
               frameon=False)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return drawn


def _quality_legend(plt: Any, points: Sequence[dict[str, Any]], keeps: Sequence[float], markers: dict[str, str]
                    ) -> list[Any]:
    """The quality figure's legend: colours say the keep rate, markers the task (``markers``: one
    per task family) with n per length (n at 10% | 30% where they differ)."""
    handles = [plt.Line2D([], [], color=f"C{i}", lw=2, label=f"keep {k:.0%}") for i, k in enumerate(keeps)]
    handles.append(plt.Line2D([], [], color="black", lw=1.2, label="full prompt (= 1)"))
    for family in markers:
        sizes = []
        for task in dict.fromkeys(p["task"] for p in points if p["family"] == family):
            mine = [p for p in points if p["task"] == task]
            ns = "|".join(str(p["n"]) for p in sorted(mine, key=lambda p: p["keep"]))
            ns = ns if len({p["n"] for p in mine}) > 1 else str(mine[0]["n"])
            sizes.append(f"{ns} @{_tokens(mine[0]['tokens'])}")
        handles.append(plt.Line2D([], [], color="grey", marker=markers[family], ls="none",
                                  label=f"{family}: n={', '.join(sizes)}"))
    return handles


def quality_caption(series: Sequence[Series], sources: Sequence[str]) -> str:
    """What the quality figure shows: the lengths each task was measured at and at which keep rates."""
    tasks: dict[str, dict[float, list[str]]] = {}
    for s in series:
        if s.kind == "measured" and s.keep is not None:
            family = s.label.rsplit(", keep", 1)[0]
            for x in s.x:
                tasks.setdefault(family, {}).setdefault(x, []).append(f"{s.keep:.0%}")
    parts = []
    for family, lengths in tasks.items():
        where = [f"{_tokens(x)} ({', '.join(k)})" for x, k in sorted(lengths.items())]
        parts.append(f"{family} at {len(where)} length{'s' * (len(where) > 1)}: {', '.join(where)}")
    return ("SpecPrefill's score over the full prompt's on the same examples (F1 or accuracy), with bootstrap 95% "
            "CIs, at the mean prompt length of each task set; a task's longer sets pad its prompts with other "
            "examples' passages. Few lengths are measured per task — " + "; ".join(parts) + " (tokens; keep rates). "
            f"From {', '.join(f'`{s}`' for s in sources)}; intervals past {Y_RANGE[0]}–{Y_RANGE[1]} are cut.")


# -- serving: p95 TTFT against the request rate ---------------------------------------------

SIDE_LABELS = {"direct": "vLLM alone (full prefill)", "gateway": "gateway (SpecPrefill)",
               "gateway_skip": "gateway, --skip-draft-when-slower", "gateway_apart": "gateway, passages read apart"}


def serving_vs_rate(data: dict[str, Any], out: Path) -> list[Series]:
    """p95 TTFT of each side of a ``bench serving`` file against the request rate, the SLO dashed;
    the series drawn. A rate where a side left requests unanswered is drawn at the top of the axis."""
    per_rate, slo = data["summary"]["per_rate"], data["summary"]["slo_s"]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.2, 4.6), dpi=DPI)
    series = []
    for side, rates in per_rate.items():
        xs = sorted(float(r) for r in rates)
        ys = [rates[_rate_key(rates, x)]["p95_ttft_s"] for x in xs]
        n = [rates[_rate_key(rates, x)]["answered"] for x in xs]
        ax.plot(xs, ys, marker="o", label=SIDE_LABELS.get(side, side))
        series.append(Series(SIDE_LABELS.get(side, side), "measured", x=tuple(xs), y=tuple(ys), n=tuple(n)))
    ax.axhline(slo, linestyle="--", color="gray", label=f"SLO: p95 TTFT ≤ {slo:.1f} s")
    series.append(Series("SLO", "reference", y=(slo,)))
    ax.set_xlabel("request rate (requests/s, Poisson arrivals)")
    ax.set_ylabel("p95 TTFT (s)")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return series


def _rate_key(rates: dict[str, Any], x: float) -> str:
    return next(k for k in rates if float(k) == x)
