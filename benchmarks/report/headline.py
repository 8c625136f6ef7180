"""The headline: one table of pinned rows, on the page and in the README.

Each row (``HEADLINE_ROWS``) names the TTFT cell and the quality task it comes from, so what the
page and the README claim is one list; a row never shows a speedup over an unfair baseline."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.lib.results import ROOT
from benchmarks.report.common import METRIC_NAMES, _ci, _nan, pair
from benchmarks.report.fairness import _short, run_precisions, unfair_baseline
from specprefill_rag.durable import write_atomic


@dataclass(frozen=True)
class HeadlineRow:
    """One row of the headline table: a TTFT cell named by its file of results/, prompt length and
    keep rate, and the answer quality at that keep rate from a quality file's task (or none)."""

    ttft: str  # a TTFT file of results/, e.g. "ttft_fair.json"
    n_tokens: int  # the prompt length of the cell, tokens
    keep: float  # keep rate of the cell, 0–1
    quality: str | None = None  # a quality file of results/, e.g. "quality_long_bf16.json"; None: "—"
    task: str | None = None  # its task, e.g. "hotpotqa_4k"
    readme: bool = False  # also a row of the README's results table (at most 4 rows)
    backend: str = "transformers"  # the run of the TTFT file

    def __post_init__(self) -> None:
        if self.n_tokens <= 0 or not 0 < self.keep < 1:
            raise ValueError(f"{self}: n_tokens must be > 0 and keep in (0, 1)")
        if (self.quality is None) != (self.task is None):
            raise ValueError(f"{self}: name both a quality file and its task, or neither")


# The page's headline and the README's results table, in this order: each row names the file it
# comes from, so what they claim is one list (a test holds the README equal to its render).
HEADLINE_ROWS = (
    HeadlineRow("ttft_fair.json", 2048, 0.1, "quality.json", "hotpotqa", readme=True),
    HeadlineRow("ttft_fair.json", 2048, 0.3, "quality.json", "hotpotqa"),
    HeadlineRow("ttft_fair.json", 4096, 0.1, "quality_long_bf16.json", "hotpotqa_4k", readme=True),
    HeadlineRow("ttft_fair.json", 4096, 0.3, "quality_long_bf16.json", "hotpotqa_4k"),
    HeadlineRow("gpu_ttft.json", 8192, 0.1, readme=True),
    HeadlineRow("gpu_ttft.json", 32768, 0.1, readme=True),
)
README = ROOT / "README.md"
README_MARKERS = ("<!-- results:start -->", "<!-- results:end -->")


def _machine(data: dict[str, Any], run: dict[str, Any]) -> str:
    """'2-core CPU, draft → main, both bf16': where and what a TTFT run measured."""
    m = data.get("machine", {})
    where = m.get("gpu") or (f"{m['cpu_count']}-core CPU" if m.get("cpu_count") else "CPU")
    dtypes = run_precisions(data, run)
    main, draft = _short(dtypes.get("main", "?")), _short(dtypes.get("draft", "?"))
    return f"{where}, {pair(data)}, " + (f"both {main}" if main == draft else f"draft {draft}, main {main}")


def _headline_cell(data: dict[str, Any], row: HeadlineRow) -> tuple[dict[str, Any], dict[str, Any]]:
    """The run and the cell ``row`` names; raises where the file has none, or where its baseline is
    not the main model at the machine's best (``unfair_baseline``): a headline never shows that."""
    runs = [r for r in data.get("runs", []) if r.get("backend") == row.backend and r.get("status") != "skipped"]
    if not runs:
        raise ValueError(f"{row}: {row.ttft} has no measured {row.backend} run")
    run = runs[0]
    unfair = unfair_baseline(data, run)
    if unfair:
        raise ValueError(f"{row}: {row.ttft} has an {unfair}; a headline shows only a speedup over the main "
                         "model at the machine's best precision")
    cells = [c for length in run.get("lengths", []) if length["n_tokens"] == row.n_tokens for c in length["cells"]]
    for cell in cells:
        if cell["keep_rate"] == row.keep:
            return run, cell
    raise ValueError(f"{row}: {row.ttft} has no cell at {row.n_tokens} tokens, keep {row.keep:.0%}")


def _quality_cell(data: dict[str, Any], row: HeadlineRow) -> str:
    """'1.00 [0.78, 1.29], n=60 (hotpotqa_4k F1, ~4.3k tokens, `quality_long_bf16.json`)': SpecPrefill's
    retention vs the full prompt on the row's task and keep rate, its summary recomputed from the rows."""
    from benchmarks.suites.quality import summarize

    rows = [r for r in data.get("rows", []) if r["task"] == row.task]
    summary = summarize(rows, data.get("settings", {}).get("seed", 0))
    found = [e for e in summary if e["method"] == "specprefill" and e["keep_rate"] == row.keep]
    if not found or _nan(found[0].get("retention_vs_full")):
        raise ValueError(f"{row}: {row.quality} has no SpecPrefill retention for {row.task} at keep {row.keep:.0%}")
    e = found[0]
    prompts = sorted(r["n_prompt"] for r in rows if r["method"] == "full" and r.get("n_prompt"))
    length = f", ~{prompts[len(prompts) // 2] / 1000:.1f}k tokens" if prompts else ""
    metric = METRIC_NAMES.get(e["metric"], e["metric"])
    return (f"{_ci(e['retention_vs_full'], e.get('retention_ci'))}, n={e['n']} "
            f"({row.task} {metric}{length}, `{row.quality}`)")


def headline_table(results: Path, rows: Sequence[HeadlineRow] = HEADLINE_ROWS) -> list[str]:
    """The markdown table of ``rows`` from the files of ``results``: the page's headline and (the
    rows marked ``readme``) the README's results. A row whose TTFT file is not in ``results`` is
    left out; anything else a row names and the files lack raises, as an unfair baseline does."""
    files: dict[str, dict[str, Any]] = {}

    def read(name: str) -> dict[str, Any] | None:
        if name not in files and (results / name).is_file():
            files[name] = json.loads((results / name).read_text())
        return files.get(name)

    out = ["| machine and models | prompt tokens | keep | TTFT speedup (ideal 1/(r+k)) "
           "| quality kept vs full [95% CI] |", "|---|---|---|---|---|"]
    for row in rows:
        ttft = read(row.ttft)
        if ttft is None:
            continue
        run, cell = _headline_cell(ttft, row)
        quality = "—"
        if row.quality is not None:
            data = read(row.quality)
            if data is None:
                raise ValueError(f"{row}: {row.quality} is not in {results}")
            quality = _quality_cell(data, row)
        out.append(f"| {_machine(ttft, run)} (`{row.ttft}`) | {row.n_tokens:,} | {row.keep:.0%} "
                   f"| **{cell['speedup']:.2f}×** ({cell['ideal']:.2f}×) | {quality} |")
    return out if len(out) > 2 else ["Not measured yet: none of the headline's files is in results/."]


HEADLINE_KEY = (
    "TTFT speedup: full prefill's time to first token over SpecPrefill's, measured side by side in one run "
    "(medians), the main model at the machine's best precision; in brackets the ideal 1/(r + k), r the draft's "
    "cost relative to the full prefill, k the share prefilled. Quality kept: SpecPrefill's answer score over "
    "the full prompt's on the same examples, with its bootstrap 95% interval, n examples, and the task, its "
    "median prompt length and file; — where the models have random weights. Each file has its own section below."
)


def headline(results: Path, rows: Sequence[HeadlineRow] = HEADLINE_ROWS) -> list[str]:
    """The page's opening section: the pinned table, its key, and where the prose lives."""
    return ["## Headline", "", *headline_table(results, rows), "", HEADLINE_KEY, "",
            "What the runs taught, and why each default is what it is: [findings.md](findings.md).", ""]


def readme_results(results: Path, rows: Sequence[HeadlineRow] = HEADLINE_ROWS) -> list[str]:
    """The README's results table: the headline's rows marked ``readme``."""
    return headline_table(results, [row for row in rows if row.readme])


def between_markers(text: str) -> str:
    """What ``text`` holds between the README's results markers (raises where they are missing)."""
    start, end = README_MARKERS
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise ValueError(f"expected one {start} before one {end}")
    return text[text.index(start) + len(start):text.index(end)]


def write_readme(results: Path, readme: Path, rows: Sequence[HeadlineRow] = HEADLINE_ROWS) -> Path:
    """Replace the table between ``README_MARKERS`` in ``readme`` with ``readme_results``."""
    text = readme.read_text(encoding="utf-8")
    block = "\n" + "\n".join(readme_results(results, rows)) + "\n"
    write_atomic(readme, text.replace(README_MARKERS[0] + between_markers(text), README_MARKERS[0] + block, 1))
    return readme
