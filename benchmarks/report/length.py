"""Evidence recall vs prompt length: the library default's draft-only recall at every length
measured so far, per task family, draft and reading (one pass or windows), pooled from the files
in ``LENGTH_SOURCES`` and windows.jsonl, as a table and a figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.common import DTYPE_NAMES, _ci, _legend_below

# Evidence files and the variant in each that scores as today's default does (a file named
# ``…_draft-NAME.jsonl`` holds that draft's rows), and windows.jsonl's one-pass/windowed pairs.
# "library default" of a file is the default of its run: the SmolLM2 files' runs did not stop
# the look-ahead at the draft's end, which changes nothing for SmolLM2 (it never ended within
# the 7 tokens, 0 of 86 prompts); evidence_long.jsonl's did not either (an earlier default).
LENGTH_SOURCES = (  # (results file, the variant that scores as today's default, draft)
    ("evidence_draft-bf16.jsonl", "library default", "qwen2.5-coder-0.5b-instruct"),
    ("evidence_draft-smollm2-135m-instruct-bf16.jsonl", "library default", "smollm2-135m-instruct"),
    ("evidence_long_bf16.jsonl", "library default", "qwen2.5-coder-0.5b-instruct"),
    ("evidence_multikey_bf16.jsonl", "library default", "qwen2.5-coder-0.5b-instruct"),
    ("evidence_long_draft-smollm2-135m-instruct.jsonl", "library default", "smollm2-135m-instruct"),
    ("evidence_long_draft-smollm2-135m-instruct-bf16.jsonl", "library default", "smollm2-135m-instruct"),
    # SQuAD-long at n=60 per length: its padding differs from evidence_long_bf16's (it depends on
    # --n-long), and its rows replace that file's rows of the same questions.
    ("evidence_squad_long_bf16.jsonl", "library default", "qwen2.5-coder-0.5b-instruct"),
    # SQuAD-long 4k at n=72 (the same 60 questions first, other padding): replaces the above at 4k.
    ("evidence_squad_long72_bf16.jsonl", "library default", "qwen2.5-coder-0.5b-instruct"),
    # The needle at 32k: past the draft's 32k window, read in windows.
    ("evidence_needle32k_bf16.jsonl", "library default", "qwen2.5-coder-0.5b-instruct"),
    # SmolLM2 on SQuAD-long and the multi-key needle, the Qwen files' commands with its own tokens.
    ("evidence_squad_long_draft-smollm2-135m-instruct-bf16.jsonl", "library default", "smollm2-135m-instruct"),
    ("evidence_multikey_draft-smollm2-135m-instruct-bf16.jsonl", "library default", "smollm2-135m-instruct"),
)
LENGTH_KEEPS = (0.1, 0.3)
LENGTH_AXIS = (512, 40_000)  # tokens: one x range for every panel, up to the 32k tasks


def length_rows(results: Path) -> list[dict[str, Any]]:
    """One record per (example, draft, reading) of the library default: family, task, draft,
    reading, prompt tokens, the file it came from, and per keep rate [recall, complete, context
    kept]. Where two files hold the same example (task and id) for the same draft and reading,
    the later file in ``LENGTH_SOURCES`` replaces the earlier one's row."""
    from benchmarks.suites import evidence, quality
    from specprefill_rag.loading import SMALL_MODEL

    out: dict[tuple[str, str, str, str], dict[str, Any]] = {}

    def add(r: dict[str, Any], draft: str, windows: int, metrics: dict[float, Any], source: str) -> None:
        if all(m is not None for m in metrics.values()):  # rows without the variant are left out
            dtype = r.get("draft_dtype", "float32")  # rows from before the field: fp32
            rec = {"family": quality.task_kind(r["task"]), "task": r["task"],
                   "draft": f"{draft}, {DTYPE_NAMES.get(dtype, dtype)}",
                   "reading": f"{windows} windows" if windows > 1 else "one pass", "n_prompt": r["n_prompt"],
                   "file": source, "metrics": metrics}
            out[(rec["task"], str(r["id"]), rec["draft"], rec["reading"])] = rec

    for name, variant, draft in LENGTH_SOURCES:
        for r in evidence.load_rows(results / name):
            metrics = {k: r["results"].get(f"{variant}@{k:g}") for k in LENGTH_KEEPS}
            add(r, draft, r.get("windows", 1), metrics, name)
    for r in evidence.load_rows(results / "windows.jsonl"):  # SmolLM2 (bench windows' default draft)
        for arm in ("one pass", "windows"):
            got = r.get(arm, {})
            metrics = {k: got.get("metrics", {}).get(f"{k:g}") for k in LENGTH_KEEPS}
            add(r, SMALL_MODEL, got.get("windows", 1), metrics, "windows.jsonl")
    return list(out.values())


def length_summary(records: list[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """Per (family, task, draft, reading): n, prompt tokens (mean, min, max), and per keep rate the
    mean recall and "complete" with 95% CIs (``metrics.share_ci``); sorted by family, draft and length."""
    from benchmarks.lib.metrics import share_ci

    groups: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
    for rec in records:
        groups.setdefault((rec["family"], rec["task"], rec["draft"], rec["reading"]), []).append(rec)
    out = []
    for (family, task, draft, reading), recs in groups.items():
        sizes = [rec["n_prompt"] for rec in recs]
        entry: dict[str, Any] = {"family": family, "task": task, "draft": draft, "reading": reading, "n": len(recs),
                                 "tokens": sum(sizes) / len(sizes), "min": min(sizes), "max": max(sizes),
                                 "files": sorted({rec["file"] for rec in recs})}
        for k in LENGTH_KEEPS:
            for i, metric in enumerate(("recall", "complete")):
                mean, lo, hi = share_ci([float(rec["metrics"][k][i]) for rec in recs], seed=seed)
                entry[f"{metric}@{k:g}"] = (mean, lo, hi)
        out.append(entry)
    return sorted(out, key=lambda e: (e["family"], e["draft"], e["reading"] != "one pass", e["reading"], e["tokens"]))


def length_section(summary: list[dict[str, Any]]) -> list[str]:
    """The quality-vs-length table of the library default, per task family, draft and reading."""
    if not summary:
        return []
    out = [
        "## Evidence recall vs prompt length (library default)",
        "",
        "The library default's draft-only evidence recall at each prompt length measured so far, per task and "
        "draft (the short tasks' own lengths; the long tasks pad them with other examples' passages, "
        "`benchmarks/lib/long_context.py`). Sources (in `benchmarks/results/`): "
        + ", ".join(f"`{name}`" for name, _, _ in LENGTH_SOURCES)
        + ", and `windows.jsonl` (the SmolLM2 draft read in one pass and, for the same prompts, in windows of 3k "
        "tokens). Every row scores with today's default look-ahead (stopped at the draft's end; SmolLM2 never ended "
        "within the 7 tokens). The draft column names the draft's dtype: bf16 is today's `auto` on a GPU and on a "
        "CPU with native bf16 (this one); the SmolLM2 rows past 8k and `windows.jsonl` ran in fp32, which kept the "
        "same evidence as bf16 where both were paired (HotpotQA n=200 per draft). A prompt longer than the draft's "
        "window is read in windows, as the engine reads it (reading: \"N windows\"). Brackets: bootstrap 95% CIs "
        "(exact binomial where all n scored 1); complete as in the evidence table below. From: the files a row's "
        "examples come from (a later source replaces an earlier one's row of the same example).",
        "",
        "| task | draft | reading | n | prompt tokens (min–max) | recall @10% | complete @10% | recall @30% "
        "| complete @30% | from |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in summary:
        cells = []
        for k in LENGTH_KEEPS:
            for metric in ("recall", "complete"):
                mean, lo, hi = e[f"{metric}@{k:g}"]
                cells.append(_ci(mean, (lo, hi)))
        files = ", ".join(f"`{name.removesuffix('.jsonl')}`" for name in e.get("files", ()))
        out.append(f"| {e['task']} | {e['draft']} | {e['reading']} | {e['n']} | {e['tokens']:,.0f} "
                   f"({e['min']:,}–{e['max']:,}) | " + " | ".join(cells) + f" | {files} |")
    return out + [""]


def plot_length(summary: list[dict[str, Any]], path: Path) -> bool:
    """Recall (95% CI) against mean prompt length: a panel per task family, a colour per (draft,
    reading), solid at keep 10% and dashed at 30%."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = sorted({e["family"] for e in summary})
    if not families:
        return False
    readers = sorted({(e["draft"], e["reading"]) for e in summary})
    fig, axes = plt.subplots(1, len(families), figsize=(3.6 * len(families), 4.4), squeeze=False)
    for ax, family in zip(axes[0], families, strict=True):
        for i, reader in enumerate(readers):
            points = [e for e in summary if e["family"] == family and (e["draft"], e["reading"]) == reader]
            for k, style in zip(LENGTH_KEEPS, ("o-", "s--"), strict=True):
                if not points:
                    continue
                mean, lo, hi = zip(*(e[f"recall@{k:g}"] for e in points), strict=True)
                ax.errorbar([e["tokens"] for e in points], mean,
                            yerr=[[m - low for m, low in zip(mean, lo, strict=True)],
                                  [high - m for m, high in zip(mean, hi, strict=True)]],
                            fmt=style, color=f"C{i % 10}", capsize=2, lw=1.1, elinewidth=0.8,
                            label=f"{reader[0]}" + ("" if reader[1] == "one pass" else f", {reader[1]}")
                            + f", keep {k:.0%}")
        ax.set_xscale("log", base=2)
        ax.set_xlim(LENGTH_AXIS)
        ax.set_xlabel("prompt tokens (mean of the set)")
        ax.set_ylabel("evidence recall (95% CI)")
        ax.set_ylim(-0.05, 1.05)
        ax.set_title(family, fontsize=9)
    _legend_below(fig, axes[0], ncol=4)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def length_part(results: Path, images: Path) -> list[str]:
    """The section and its figure; nothing where no source has a row yet."""
    summary = length_summary(length_rows(results))
    lines = length_section(summary)
    if lines and plot_length(summary, images / "bench_length.png"):
        lines += [f"![Evidence recall vs prompt length]({Path('images') / 'bench_length.png'})", ""]
    return lines
