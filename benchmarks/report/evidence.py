"""The evidence-recall section (draft only, ``bench evidence``): per task and keep rate, how
much of the gold evidence the pinned variants and the best others keep, with the figure of the
pinned ones. The cheap proxy for answer quality: no main model runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.common import _bounds, _ci, _legend_below

# Evidence variants always shown (matched by prefix), and the one in bold.
EVIDENCE_DEFAULT = "library default"
EVIDENCE_TOP = 10  # best other variants shown per task and keep rate


def evidence_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``benchmarks.suites.evidence.summarize`` of the variants the page shows: the pinned ones and the
    ``EVIDENCE_TOP`` best others by mean recall per task and keep rate (bootstrapping all ~150
    variants would take a minute)."""
    from benchmarks.suites import evidence

    return evidence.summarize(evidence.top_variants(rows, EVIDENCE_TOP))


def evidence_section(rows: list[dict[str, Any]], summary: list[dict[str, Any]] | None = None) -> list[str]:
    """Evidence recall per task: the pinned variants and the best others, from ``bench evidence`` rows."""
    summary = evidence_summary(rows) if summary is None else summary
    n_variants = len({key.rsplit("@", 1)[0] for r in rows for key in r["results"]})
    out = ["## Evidence recall (draft only)", ""]
    tasks = sorted({r["task"] for r in rows})
    parts = []
    for t in tasks:
        mine = [r for r in rows if r["task"] == t]
        sizes = [r["n_context"] for r in mine if r.get("n_context")]
        parts.append(f"{t} {len(mine)}" + (f" (mean context {sum(sizes) / len(sizes):.0f} tokens)" if sizes else ""))
    counts = ", ".join(parts)
    out += [
        "- command: `specprefill-rag bench evidence --n 200` (results: `benchmarks/results/evidence.jsonl`, "
        "appended one example at a time; an unfinished run shows the examples done so far)",
        f"- examples: {counts}",
        f"- variants: {n_variants} scoring/selection configurations, all from one "
        f"capture of the draft's attention per example; shown per keep rate: the reference, random and oracle "
        f"baselines, the library default (bold) and the {EVIDENCE_TOP} best other variants by recall",
        "",
    ]
    for task in tasks:
        out += _evidence_table(task, [e for e in summary if e["task"] == task])
    out += [
        "Recall = share of the gold evidence tokens kept (HotpotQA: the supporting-fact sentences; SQuAD: the "
        "answer span; needle: the needle sentence; near-miss: the evidence sentence). Complete = every key span "
        "kept (HotpotQA: both supporting sentences at least 50% kept, \"both hops\"; SQuAD: the whole answer "
        "span; needle: the whole number; near-miss: the whole evidence sentence). Keep rate and context kept = "
        "share of the context tokens (protected instructions, question and tail come on top). Brackets: bootstrap "
        "95% confidence intervals over the examples; where every example scored 1 (or 0), the exact binomial "
        "interval of n in n (0.87 for 27 of 27) instead. No main model runs here: this is the cheap proxy for answer "
        "quality, on many more examples than the quality benchmark.",
        "",
        "Variant names: *reference* = the reference implementation's scoring (look-ahead 8, all layers, max over "
        "heads) with 32-token chunks; `w=` the weight of the look-ahead queries against the question's, then the "
        "layers, the head reduction (`max`/`mean`), `norm` = attention renormalised over the context; after `|` "
        "the selection unit (32-token chunks or sentences) and its options; *oracle sentences* keep the gold "
        "evidence first (an upper bound for sentence selection); *library default* = `DraftConfig()` and "
        "`SelectionConfig()` as shipped.",
        "",
    ]
    return out


def _evidence_table(task: str, summary: list[dict[str, Any]]) -> list[str]:
    """One task's evidence recall per keep rate: the pinned variants and the best others."""
    from benchmarks.suites import evidence

    out = [
        f"### {task}",
        "",
        "| keep | variant | n | recall [95% CI] | complete [95% CI] | context kept |",
        "|---|---|---|---|---|---|",
    ]
    for keep in sorted({e["keep_rate"] for e in summary}):
        at = sorted((e for e in summary if e["keep_rate"] == keep), key=lambda e: -e["recall"])
        others = [e for e in at if not evidence.pinned(e["variant"])][:EVIDENCE_TOP]
        shown = sorted([e for e in at if evidence.pinned(e["variant"])] + others, key=lambda e: -e["recall"])
        for e in shown:
            bold = e["variant"] == EVIDENCE_DEFAULT
            name = e["variant"].replace("|", "\\|")
            out.append(
                f"| {keep:.0%} | {f'**{name}**' if bold else name} | {e['n']}"
                f" | {_ci(e['recall'], e.get('recall_ci'), bold=bold)}"
                f" | {_ci(e['complete'], e.get('complete_ci'))} | {e['context_kept']:.1%} |"
            )
    return out + [""]


EVIDENCE_PLOTTED = ("library default", "reference", "random chunks", "random sentences", "oracle sentences")


def plot_evidence(summary: list[dict[str, Any]], path: Path) -> bool:
    """Recall with its CI of the pinned variants, per task and keep rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({e["task"] for e in summary})
    if not tasks:
        return False
    fig, axes = plt.subplots(1, len(tasks), figsize=(3.8 * len(tasks), 3.6), squeeze=False)
    width = 0.8 / len(EVIDENCE_PLOTTED)
    for ax, task in zip(axes[0], tasks, strict=True):
        mine = [e for e in summary if e["task"] == task]
        keeps = sorted({e["keep_rate"] for e in mine})
        for i, prefix in enumerate(EVIDENCE_PLOTTED):
            xs, ys, lows, highs = [], [], [], []
            for j, keep in enumerate(keeps):
                e = next((e for e in mine if e["keep_rate"] == keep and e["variant"].startswith(prefix)), None)
                if e is None:
                    continue
                lo, hi = _bounds(e["recall"], e.get("recall_ci"))
                xs.append(j + (i - (len(EVIDENCE_PLOTTED) - 1) / 2) * width)
                ys.append(e["recall"])
                lows.append(e["recall"] - lo)
                highs.append(hi - e["recall"])
            if xs:
                label = "reference (look-ahead 8, all layers, chunks 32)" if prefix == "reference" else prefix
                ax.bar(xs, ys, width, yerr=[lows, highs], color=f"C{i}", label=label, capsize=2,
                       error_kw={"elinewidth": 0.8})
        n = max((e["n"] for e in mine), default=0)
        ax.set_xticks(range(len(keeps)), [f"keep {k:.0%}" for k in keeps])
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("evidence recall (95% CI)")
        ax.set_title(f"{task} (n={n})", fontsize=9)
    _legend_below(fig, axes[0])
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def evidence_part(results: Path, images: Path) -> list[str]:
    """The section from ``evidence.jsonl`` and its figure, or what to run where it is missing."""
    from benchmarks.suites import evidence

    rows = evidence.load_rows(results / "evidence.jsonl")
    if not rows:
        return ["## Evidence recall (draft only)", "", "Not measured yet: run `specprefill-rag bench evidence`.", ""]
    shown = evidence_summary(rows)
    lines = evidence_section(rows, shown)
    if plot_evidence(shown, images / "bench_evidence.png"):
        lines += [
            f"![Evidence recall per task and keep rate]({Path('images') / 'bench_evidence.png'})",
            "",
            "Recall of the library default, the reference scoring, random chunks and sentences, and the "
            "oracle, with 95% confidence intervals.",
            "",
        ]
    return lines
