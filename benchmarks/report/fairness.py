"""Fair baselines: a speedup counts only against the main model at its best.

Which precisions a TTFT run's models ran in, the fastest one its machine offered, and so whether
its baseline is fair; the rule, said once on the page, and the tables it keeps out of the headline,
listed once under it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks.report.common import DTYPE_NAMES

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


FAIR_BASELINES = [
    "### Fair baselines",
    "",
    "A speedup counts only against full prefill of the main model at the fastest precision the machine offers, "
    f"measured in the same run ({BF16_GAIN}). A table whose file shows a slower baseline (an unfair one), or "
    "does not record whether the machine multiplies bf16 natively (an unverified one), says so in its heading "
    "and is never headlined.",
    "",
]


def unfair_runs(files: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, list[str]]:
    """``{label: ["`file` (backend)", ...]}`` of the measured TTFT runs in ``files`` (``(file name,
    data)``) whose baseline is not the main model at its best (``unfair_baseline``), in page order."""
    found: dict[str, list[str]] = {}
    for name, data in files:
        for run in data.get("runs", []):
            label = None if run.get("status") == "skipped" else unfair_baseline(data, run)
            if label:
                found.setdefault(label, []).append(f"`{name}` ({run['backend']})")
    return found


def not_headlined_lines(unfair: dict[str, list[str]]) -> list[str]:
    """What ``unfair_runs`` found, said once under the rule: each label and the tables it heads
    (their headings name the label again; their speedups are shown, never headlined)."""
    if not unfair:
        return []
    return ["Not headlined on this page (each table's heading names its label): "
            + "; ".join(f"{label}: {', '.join(files)}" for label, files in unfair.items()) + ".", ""]
