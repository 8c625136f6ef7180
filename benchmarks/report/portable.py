"""Portable (text) mode against position mode and the peers (LongLLMLingua, ragcompress): end to
end from ``quality_text*.json`` with issue 51's targets, what each compressor keeps of the gold as
text (``peer_evidence*.jsonl``), and each method's compression time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.common import _ci
from benchmarks.report.quality import quality_section

# Issue 51's targets for text (portable) mode.
TEXT_RETENTION_AT_30 = 0.95


def _mark(ok: bool | None) -> str:
    return "–" if ok is None else "✓" if ok else "✗"


def _text_target(e: dict[str, Any], keep: float) -> str:
    """Issue 51's target for text mode at ``keep``, met (✓) or not (✗): retention at 30% and above,
    at lower rates a tie with position mode and a lead on LongLLMLingua (``e``: its summary entry)."""
    if keep >= 0.3:
        ok = None if e.get("retention_vs_full") is None else e["retention_vs_full"] >= TEXT_RETENTION_AT_30
        return f"retention ≥ {TEXT_RETENTION_AT_30} {_mark(ok)}"
    pos_ci, lingua_ci = e.get("vs_specprefill_ci"), e.get("vs_llmlingua_ci")
    return (f"as position {_mark(None if not pos_ci else pos_ci[1] >= 0)}, "  # holds 0, or lies above it
            f"ahead of LongLLMLingua {_mark(None if not lingua_ci else lingua_ci[0] > 0)}")


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

        target = _text_target(e, keep)
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
