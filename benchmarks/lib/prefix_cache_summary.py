"""The tables of ``bench prefix_cache``'s results files: per scenario what vLLM served from its
prefix cache and the TTFT speedups with bootstrap 95% intervals (``summarize``), per chat turn
SpecPrefill's speedup over full prefill, both warm (``summarize_chat``), and their lines.
"""

from __future__ import annotations

import math
from typing import Any

from benchmarks.lib.metrics import bootstrap_ci, paired_ratio_ci

SCENARIOS = ("sys_full", "sys_spec", "retry", "nosys_full", "nosys_spec")


def summarize_chat(rows: list[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """Per turn: TTFT speedup of SpecPrefill over full prefill (both warm), cached tokens, answers."""
    out = []
    for turn in sorted({t["turn"] for r in rows for t in r["turns"]}):
        cells = [t for r in rows for t in r["turns"] if t["turn"] == turn]
        out.append({
            "turn": turn, "n": len(cells),
            "full_ttft_s": bootstrap_ci([c["full"]["ttft_s"] for c in cells], seed=seed),
            "spec_ttft_s": bootstrap_ci([c["spec"]["ttft_s"] for c in cells], seed=seed),
            "speedup": paired_ratio_ci([c["full"]["ttft_s"] for c in cells], [c["spec"]["ttft_s"] for c in cells],
                                       seed=seed),
            "full_cached": bootstrap_ci([c["full"]["cached_tokens"] for c in cells], seed=seed),
            "spec_cached": bootstrap_ci([c["spec"]["cached_tokens"] for c in cells], seed=seed),
            # Rows from before the pruned-history arm lack it: counted over the turns that have it.
            "pruned_speedup": paired_ratio_ci([c["full"]["ttft_s"] for c in cells if "spec_pruned" in c],
                                              [c["spec_pruned"]["ttft_s"] for c in cells if "spec_pruned" in c],
                                              seed=seed),
            "pruned_cached": bootstrap_ci([c["spec_pruned"]["cached_tokens"] for c in cells if "spec_pruned" in c],
                                          seed=seed),
            "pruned_n": sum("spec_pruned" in c for c in cells),
            # The first chat run did not record answer lengths: NaN ("not recorded"), not 0.
            "answer_tokens": bootstrap_ci([c["full"]["answer_tokens"] for c in cells if "answer_tokens" in c["full"]],
                                          seed=seed),
            "prompt_tokens": bootstrap_ci([c["full"]["prompt_tokens"] for c in cells], seed=seed),
            "spec_faster": sum(c["spec"]["ttft_s"] <= c["full"]["ttft_s"] for c in cells),
            "same_as_cold": sum(bool(c["same_as_cold"]) for c in cells),
        })
    return out


def chat_lines(summary: list[dict[str, Any]]) -> list[str]:
    if not summary:
        return []
    lines = ["| turn | n | prompt tokens | answer tokens | cached: full / SpecPrefill | TTFT full | TTFT SpecPrefill "
             "| speedup | SpecPrefill faster | answer = cold | history pruned: n, cached, speedup |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        v, p = s["speedup"], s["pruned_speedup"]
        pruned = (f"{s['pruned_n']}, {s['pruned_cached'][0]:.0f}, {p[0]:.2f}× [{p[1]:.2f}, {p[2]:.2f}]"
                  if s["pruned_n"] and p[0] is not None else "not measured")
        answer = "not recorded" if math.isnan(s["answer_tokens"][0]) else f"{s['answer_tokens'][0]:.0f}"
        lines.append(f"| {s['turn']} | {s['n']} | {s['prompt_tokens'][0]:.0f} | {answer} | "
                     f"{s['full_cached'][0]:.0f} / {s['spec_cached'][0]:.0f} | {s['full_ttft_s'][0]:.1f} s | "
                     f"{s['spec_ttft_s'][0]:.1f} s | {v[0]:.2f}× [{v[1]:.2f}, {v[2]:.2f}] | "
                     f"{s['spec_faster']}/{s['n']} | {s['same_as_cold']}/{s['n']} | {pruned} |")
    return lines


def summarize(rows: list[dict[str, Any]], seed: int = 0) -> dict[str, Any]:
    """Means and 95% CIs: cached tokens, speedups over warm full prefill, the retry's draft cost."""
    def column(name: str, field: str) -> list[float]:
        return [float(r[name][field]) for r in rows]

    out: dict[str, Any] = {"n": len(rows)}
    for name in SCENARIOS:
        mean, low, high = bootstrap_ci(column(name, "cached_tokens"), seed=seed)
        out[f"{name}_cached"] = (mean, low, high)
        out[f"{name}_new_tokens"] = bootstrap_ci(
            [r[name]["sent_tokens"] - r[name]["cached_tokens"] for r in rows], seed=seed)
    out["speedup_sys"] = paired_ratio_ci(column("sys_full", "ttft_s"), column("sys_spec", "ttft_s"), seed=seed)
    out["speedup_nosys"] = paired_ratio_ci(column("nosys_full", "ttft_s"), column("nosys_spec", "ttft_s"), seed=seed)
    out["retry_over_prefill"] = paired_ratio_ci(column("retry", "ttft_s"), column("retry", "prefill_s"), seed=seed)
    out["retry_over_first_prefill"] = paired_ratio_ci(column("retry", "ttft_s"), column("sys_spec", "prefill_s"),
                                                      seed=seed)
    out["retry_memo_hits"] = sum(1 for r in rows if r["retry"]["memo_hit"])
    # Rows measured before the draft had a prefix store carry no draft_cached_tokens: 0.
    out["sys_spec_draft_cached"] = bootstrap_ci([r["sys_spec"].get("draft_cached_tokens", 0) for r in rows], seed=seed)
    out["system_tokens"] = rows[0].get("system_tokens") if rows else None
    return out


def summary_lines(s: dict[str, Any]) -> list[str]:
    """The summary as Markdown: one table row per request kind, then the ratios."""
    if not s["n"]:
        return ["Not measured yet: run `specprefill-rag bench prefix_cache`."]
    lines = [f"n = {s['n']} questions; system prompt {s['system_tokens']} tokens; means with 95% bootstrap CIs.", "",
             "| request | prompt tokens served from vLLM's cache | tokens vLLM prefilled |", "|---|---|---|"]
    for name in SCENARIOS:
        c, p = s[f"{name}_cached"], s[f"{name}_new_tokens"]
        lines.append(f"| {name} | {c[0]:.0f} [{c[1]:.0f}, {c[2]:.0f}] | {p[0]:.0f} [{p[1]:.0f}, {p[2]:.0f}] |")
    lines.append("")
    for key, label in (("speedup_sys", "TTFT speedup, shared system prompt, both warm"),
                       ("speedup_nosys", "TTFT speedup, no system prompt, both cold"),
                       ("retry_over_prefill", "retry TTFT / its own main prefill time"),
                       ("retry_over_first_prefill", "retry TTFT / the first send's main prefill time")):
        v = s[key]
        lines.append(f"- {label} (ratio of mean TTFTs): {v[0]:.2f}× [{v[1]:.2f}, {v[2]:.2f}]")
    lines.append(f"- retries served from the score memo: {s['retry_memo_hits']}/{s['n']}")
    d = s["sys_spec_draft_cached"]
    lines.append(f"- sys_spec draft tokens read from the draft's prefix store: {d[0]:.0f} [{d[1]:.0f}, {d[2]:.0f}]")
    return lines


def print_summary(s: dict[str, Any]) -> None:
    print("\n".join(summary_lines(s)))
