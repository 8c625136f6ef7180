"""The time-to-first-token sections: per results file, each backend's TTFT table against the
ideal 1/(r + k), its draft scoring cost, the batched and memory lines, the speedup figure, and
the GPU run after the CPU ones. What the tables' columns mean is said once (``TTFT_KEY``,
``DRAFT_COST_KEY``, on the page under "Reading the tables"); each table states its own targets."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

from benchmarks import figures
from benchmarks.report.common import DTYPE_NAMES, READING, _ok, _s, dtype_parts, meta_lines, pair
from benchmarks.report.fairness import unfair_baseline
from benchmarks.report.gpu import GPU_NOT_RUN, gpu_attention_section, label_eager_variants

TTFT_KEY = (
    "**Time to first token** (per backend, prompt length and keep rate; each table states its efficiency "
    "target): r = plain draft forward / plain main forward at the same length, both measured in the table's run "
    "(the main forward is the full-prefill baseline's prefill). "
    "A keep rate with a look-ahead named after it: the same run with that look-ahead instead of the "
    "default (the settings line names the default's): \"greedy 8\" = 7 sequential decode steps; \"full "
    "forward\" = after a prompt forward through every layer; \"early exit, upper layers read X%\" = the "
    "prompt's forward stops at the highest aggregated layer and the layers above read X% of the prompt "
    "to choose the tokens, in every step; \"siblings\" = the L − 1 likeliest next tokens in one forward "
    "(older runs' \"greedy 8\" and \"siblings, early exit\": full forward and 15%). A **reduced run** measured "
    "fewer lengths / keep rates / repetitions than the default command."
)
DRAFT_COST_KEY = (
    "**Draft scoring cost** (per backend and prompt length; each table states its capture-overhead target, "
    "a multiple of a plain draft forward): draft scoring is the "
    "library default's whole draft cost (prompt forward, look-ahead, scoring); r of the scoring = that cost "
    "over the plain main forward. \"capture, no look-ahead\" is the capture hooks alone; each other column "
    "scores with one look-ahead variant (`benchmarks/lib/lookahead.lookahead_variants`; in older runs: "
    "question-only scoring with early exit), as a multiple of a plain draft forward and as r."
)


def default_lookahead(settings: dict[str, Any]) -> str:
    """What the run's default look-ahead did: recorded by newer runs; older runs (greedy steps
    were full forwards then) are described from their look-ahead length."""
    if settings.get("lookahead_label"):
        return str(settings["lookahead_label"])
    config = settings.get("draft_config") or {}
    if config.get("lookahead_tokens") == "siblings":
        return "siblings"
    return f"greedy {settings.get('lookahead')}, full forward"


def _run_dtypes(data: dict[str, Any]) -> str:
    """The models' dtypes as a TTFT run recorded them per backend ("draft bf16, main fp32"), or
    the one dtype of files from before that record (their settings' ``dtype``)."""
    found = [", ".join(dtype_parts(run["dtypes"])) for run in data.get("runs", []) if run.get("dtypes")]
    one = str(data.get("settings", {}).get("dtype"))
    return "; ".join(dict.fromkeys(found)) or DTYPE_NAMES.get(one, one)


def ttft_section(data: dict[str, Any], title: str, unit: str = "s", said: Collection[str] = ()) -> list[str]:
    """One results file's TTFT section: its provenance, then per backend the TTFT and draft-cost
    tables; ``said``: the unfair-baseline labels the page already lists under "Fair baselines"
    (a table with one of them names it in its heading only)."""
    out = [f"## {title}", ""] + meta_lines(data)
    s = data.get("settings", {})
    out.append(
        f"- settings: lengths {s.get('lengths')}, keep rates {s.get('keep_rates')}, {s.get('reps')} "
        f"repetition(s) per cell (medians), look-ahead {s.get('lookahead')}, {_run_dtypes(data)} on {s.get('device')}"
    )
    out.append(f"- the default's look-ahead in this run: {default_lookahead(s)}")
    if data.get("reduced"):
        out.append(f"- **reduced run** ({READING})")
    targets = data.get("targets", {"efficiency": 0.85, "capture_overhead": 1.1, "memory": 1.15})
    out.append("")
    for run in data.get("runs", []):
        if run.get("status") == "skipped":
            out += [f"**Backend `{run['backend']}`: not measured** — {run['reason']}", ""]
        else:
            unfair = unfair_baseline(data, run)
            out += _ttft_table(run, targets, unit, unfair, unfair in said) + _draft_cost_table(run, targets, unit)
    conc = data.get("concurrency")
    if conc:
        out += [
            f"{conc['batch']} concurrent {conc['n_tokens']}-token requests scored in one batched draft pass "
            f"(`DraftConfig.max_batch`): {_s(conc['batch_s'], unit)} = **{conc['ratio']:.2f}×** one request's "
            f"{_s(conc['one_s'], unit)} (target ≤ 3×).",
            "",
        ]
    out += _attention_lines(data.get("attention"), unit)
    mem = data.get("memory")
    if mem and "error" not in mem:
        out += [_memory_line(mem, targets, data.get("memory_command")), ""]
    elif mem:
        out += [f"**Memory:** not measured ({mem['error']})", ""]
    return out


def _attention_lines(rows: list[dict[str, Any]] | None, unit: str) -> list[str]:
    """The default scoring with the look-ahead's attention through SDPA and through the short
    path (``specprefill_rag.attention``), side by side (``gpu_ttft.attention_rows``)."""
    if not rows:
        return []
    out = ["The look-ahead's attention (`specprefill_rag/draft/short_query_attention.py`): the default scoring "
           "with its few-token forwards through SDPA and through the short path, graphs captured for each, "
           "same run:", "",
           "| tokens | SDPA | short path | ratio | same look-ahead tokens | largest score difference |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['n_tokens']} | {_s(r['sdpa_s'], unit)} | {_s(r['short_s'], unit)} | **{r['ratio']:.2f}×** |"
                   f" {'yes' if r['same_lookahead_tokens'] else 'no'} | {r['max_score_diff']:.1e}"
                   f" (largest score {r['max_score']:.1e}) |")
    return out + [""]


def _ttft_table(run: dict[str, Any], targets: dict[str, float], unit: str, unfair: str | None = None,
                said: bool = False) -> list[str]:
    """One backend's TTFT per prompt length and keep rate, against the ideal 1/(r + k); ``unfair``:
    why its baseline is not the main model at its best (``unfair_baseline``), in the heading, and
    said first unless the page already ``said`` it under "Fair baselines"."""
    out = [f"### Backend `{run['backend']}`" + (f" — {unfair}" if unfair else ""), ""]
    if unfair and not said:  # the rule is said once, under "Fair baselines"
        out += [f"**Not headlined: {unfair}** ([fair baselines](#fair-baselines)).", ""]
    out += [
        "| prompt | keep | TTFT full | TTFT SpecPrefill | speedup | draft scoring | selection | main prefill "
        "| kept | r | ideal 1/(r+k) | efficiency |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in run["lengths"]:
        cells = [(f"{c['keep_rate']:.0%}", c) for c in row["cells"]]
        cells += [(f"{c['keep_rate']:.0%}, {row.get('compared_label')}", c) for c in row.get("cells_compared", [])]
        for keep, c in cells:
            out.append(
                f"| {row['n_tokens']} | {keep} | {_s(c['ttft_full_s'], unit)}"
                f" | {_s(c['ttft_spec_s'], unit)}"
                f" | **{c['speedup']:.2f}×** | {_s(c['draft_s'], unit)} | {_s(c['selection_s'], 'ms')}"
                f" | {_s(c['prefill_s'], unit)} | {c['keep_ratio']:.1%} | {row['r']:.3f} | {c['ideal']:.2f}×"
                f" | {c['efficiency']:.2f} {_ok(c['efficiency'], targets['efficiency'], True)} |"
            )
    return out + [
        "",
        f"Efficiency target ≥ {targets['efficiency']}; the columns, r and the look-ahead labels: {READING}.",
        "",
    ]


def _draft_cost_table(run: dict[str, Any], targets: dict[str, float], unit: str) -> list[str]:
    """One backend's draft scoring cost per prompt length, against a plain draft forward."""
    variants = list(dict.fromkeys(name for row in run["lengths"] for name in row.get("lookahead_scoring", {})))
    early = any(row.get("early_exit_overhead") is not None for row in run["lengths"])
    columns = [*variants, *(["early exit, question only"] if early else [])]
    out = [
        "| prompt | plain main forward | plain draft forward | draft scoring (default) | capture overhead "
        "| r of the scoring | capture, no look-ahead | " + "".join(f"{c}: cost / r | " for c in columns),
        "|---|---|---|---|---|---|---|" + "---|" * len(columns),
    ]
    for row in run["lengths"]:
        hook = row.get("hook_overhead")
        scoring = row.get("r_scoring", row["draft_scoring_s"] / row["main_plain_s"])
        cells = [row.get("lookahead_scoring", {}).get(name) for name in variants]
        shown = ["–" if v is None else f"{v['overhead']:.2f}× / {v['r']:.3f}" for v in cells]
        if early:
            e = row.get("early_exit_overhead")
            shown.append("–" if e is None else f"{e:.2f}× / {row['r_early_exit']:.3f}")
        out.append(
            f"| {row['n_tokens']} | {_s(row['main_plain_s'], unit)} | {_s(row['draft_plain_s'], unit)}"
            f" | {_s(row['draft_scoring_s'], unit)} | {row['capture_overhead']:.2f}× "
            f"{_ok(row['capture_overhead'], targets['capture_overhead'], False)} | {scoring:.3f}"
            f" | {'–' if hook is None else f'{hook:.2f}×'} | " + "".join(f"{c} | " for c in shown)
        )
    return out + [
        "",
        f"Capture-overhead target ≤ {targets['capture_overhead']}× a plain draft forward; the columns: {READING}.",
        "",
    ]


_MEMORY_SOURCES = {
    "rss": "process RSS sampled by psutil, each run in a fresh subprocess",
    "heap": "draft weights + the peak of what the run allocated, from glibc malloc statistics sampled "
    "every millisecond, each run in a fresh subprocess",
}


def _memory_line(mem: dict[str, Any], targets: dict[str, float], command: str | None) -> str:
    """Peak memory of draft scoring against a plain draft forward, in one paragraph."""
    plain, score = mem["plain"], mem["score"]
    src = _MEMORY_SOURCES.get(mem["source"], "torch.cuda.max_memory_allocated")
    verdict = f"{_ok(mem['peak_ratio'], targets['memory'], False)} (target ≤ {targets['memory']}×); "
    line = f"**Memory** at {mem['length']} tokens ({src}): "
    if "peak_bytes" in plain:
        line += (
            f"peak {plain['peak_bytes'] / 2**20:.0f} MiB for a plain draft forward vs "
            f"{score['peak_bytes'] / 2**20:.0f} MiB for scoring = **{mem['peak_ratio']:.2f}×** " + verdict
        )
    else:
        line += f"draft weights {mem['draft_weight_bytes'] / 2**20:.0f} MiB + activations: " \
                f"**{mem['peak_ratio']:.2f}×** " + verdict
    line += (
        f"memory added by the run itself: {plain['delta_bytes'] / 2**20:.0f} MiB vs "
        f"{score['delta_bytes'] / 2**20:.0f} MiB ({mem['delta_ratio']:.2f}×)."
    )
    if "rss_peak_bytes" in plain and mem["source"] != "rss":
        line += (
            f" Process RSS, for reference: {plain['rss_peak_bytes'] / 2**20:.0f} MiB vs "
            f"{score['rss_peak_bytes'] / 2**20:.0f} MiB."
        )
    if command:
        line += f" Measured separately: `{command}`."
    return line


def ttft_part(ttfts: list[tuple[str, dict[str, Any]]], gpu: dict[str, Any] | None, images: Path,
              gpu_attention: dict[str, Any] | None = None, said: Collection[str] = ()) -> list[str]:
    """The page's TTFT sections: every CPU file, the speedup-vs-length figure, then the GPU run
    (or why there is none); ``said`` as in ``ttft_section``."""
    lines: list[str] = []
    for stem, ttft in ttfts:
        lines += ttft_section(ttft, f"Time to first token: {pair(ttft)} (CPU, `benchmarks/results/{stem}.json`)",
                              said=said)
    if not ttfts:
        lines += ["## Time to first token", "", "Not measured yet: run `make bench-ttft`.", ""]
    shown = figures.speedup_vs_length(ttfts, gpu, images / "bench_speedup_vs_length.png", unfair=unfair_baseline)
    if shown:
        lines += [f"![TTFT speedup vs prompt length]({Path('images') / 'bench_speedup_vs_length.png'})", "",
                  figures.speedup_caption(shown), ""]
    if gpu:
        lines += ttft_section(label_eager_variants(gpu), "Time to first token at real model sizes (GPU, random "
                              "weights)", unit="ms", said=said)
        return lines + gpu_attention_section(gpu_attention)
    return lines + GPU_NOT_RUN
