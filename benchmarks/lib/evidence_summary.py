"""The tables of a ``bench evidence`` results file (``--summary``): mean recall, "complete" and
context kept per task, variant and keep rate with bootstrap 95% intervals, the best variants
beside the pinned baselines (``--top``), or each variant paired against one (``--paired``), that
one possibly from another results file (``--against``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from benchmarks.lib.evidence_recall import METRICS
from benchmarks.lib.evidence_tasks import load_rows
from benchmarks.lib.metrics import bootstrap_ci, share_ci

PINNED = ("library default", "reference", "random chunks", "random sentences", "oracle sentences")


def show_summary(args: argparse.Namespace, path: Path) -> int:
    """Print the table ``args`` asks for (``--top``, ``--paired``, ``--against``) of ``path``."""
    rows = load_rows(path)
    if args.against:
        rows, args.paired = joined(rows, load_rows(Path(args.against[0])), *args.against)
    if args.paired:
        print_paired(paired(rows, args.paired, args.seed), args.paired)
        return 0
    print_summary(summarize(top_variants(rows, args.top) if args.top is not None else rows, args.seed))
    return 0


def summarize(rows: list[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """Mean recall / complete / context kept per (task, variant@keep), with bootstrap 95% CIs."""
    out = []
    tasks = sorted({r["task"] for r in rows})
    for task in tasks:
        mine = [r for r in rows if r["task"] == task]
        names = list(dict.fromkeys(k for r in mine for k in r["results"]))
        for name in names:
            have = [r["results"][name] for r in mine if name in r["results"]]
            variant, keep = name.rsplit("@", 1)
            entry: dict[str, Any] = {"task": task, "variant": variant, "keep_rate": float(keep), "n": len(have)}
            for column, metric in enumerate(METRICS):
                values = [float(h[column]) for h in have]
                mean, lo, hi = share_ci(values, seed=seed)
                entry[metric] = mean
                entry[f"{metric}_ci"] = [lo, hi]
            out.append(entry)
    return out


def paired(rows: list[dict[str, Any]], base: str, seed: int = 0) -> list[dict[str, Any]]:
    """Per (task, variant, keep rate): the mean difference in recall and in "complete" to the
    variant ``base`` on the same examples (those that hold both), with bootstrap 95% CIs."""
    out = []
    for task in sorted({r["task"] for r in rows}):
        mine = [r["results"] for r in rows if r["task"] == task]
        for name in dict.fromkeys(k for r in mine for k in r):
            variant, keep = name.rsplit("@", 1)
            reference = f"{base}@{keep}"
            pairs = [(r[name], r[reference]) for r in mine if name in r and reference in r]
            if variant == base or not pairs:
                continue
            entry: dict[str, Any] = {"task": task, "variant": variant, "keep_rate": float(keep), "n": len(pairs),
                                     "base": sum(float(b[0]) for _, b in pairs) / len(pairs)}
            for column, metric in enumerate(METRICS[:2]):
                mean, lo, hi = bootstrap_ci([float(a[column]) - float(b[column]) for a, b in pairs], seed=seed)
                entry[f"{metric}_diff"], entry[f"{metric}_diff_ci"] = mean, [lo, hi]
            out.append(entry)
    return out


def joined(rows: list[dict[str, Any]], others: list[dict[str, Any]], file: str, variant: str
           ) -> tuple[list[dict[str, Any]], str]:
    """``rows`` of the examples ``others`` also holds, each with ``variant``'s results from there
    under the name ``"<file's name>: <variant>"`` (returned): what ``paired`` compares against."""
    name = f"{Path(file).name}: {variant}"
    theirs = {(r["task"], r["id"]): r["results"] for r in others}
    out = []
    for row in rows:
        found = theirs.get((row["task"], row["id"]), {})
        extra = {f"{name}@{key.rsplit('@', 1)[1]}": value for key, value in found.items()
                 if key.rsplit("@", 1)[0] == variant}
        if extra:
            out.append({**row, "results": {**row["results"], **extra}})
    return out, name


def print_paired(entries: list[dict[str, Any]], base: str) -> None:
    print(f"paired against {base!r}: difference in recall, in complete")
    for e in sorted(entries, key=lambda e: (e["task"], e["keep_rate"], e["variant"])):
        (lo, hi), (clo, chi) = e["recall_diff_ci"], e["complete_diff_ci"]
        print(f"  {e['task']:<12} keep {e['keep_rate']:<4g} n={e['n']:<4} base {e['base']:.3f}  "
              f"recall {e['recall_diff']:+.3f} [{lo:+.3f}, {hi:+.3f}]  "
              f"complete {e['complete_diff']:+.3f} [{clo:+.3f}, {chi:+.3f}]  {e['variant']}")


def pinned(variant: str) -> bool:
    """Baselines every table shows whatever their rank."""
    return variant.startswith(PINNED)


def top_variants(rows: list[dict[str, Any]], top: int) -> list[dict[str, Any]]:
    """``rows`` restricted to the pinned variants and the ``top`` others with the best mean
    recall, per task and keep rate (so only those need bootstrapping)."""
    shown: set[tuple[str, str]] = set()
    for task in {r["task"] for r in rows}:
        recalls: dict[str, list[float]] = {}
        for r in rows:
            if r["task"] == task:
                for key, values in r["results"].items():
                    recalls.setdefault(key, []).append(float(values[0]))
        by_keep: dict[str, list[tuple[float, str]]] = {}
        for key, values in recalls.items():
            variant, keep = key.rsplit("@", 1)
            if pinned(variant):
                shown.add((task, key))
            else:
                by_keep.setdefault(keep, []).append((sum(values) / len(values), key))
        for ranked in by_keep.values():
            shown |= {(task, key) for _, key in sorted(ranked, key=lambda x: -x[0])[:top]}
    return [{**r, "results": {k: v for k, v in r["results"].items() if (r["task"], k) in shown}} for r in rows]


def print_summary(summary: list[dict[str, Any]]) -> None:
    for task in sorted({e["task"] for e in summary}):
        mine = sorted((e for e in summary if e["task"] == task), key=lambda e: (e["keep_rate"], -e["recall"]))
        print(f"\n{task}")
        for e in mine:
            lo, hi = e["recall_ci"]
            clo, chi = e["complete_ci"]
            print(
                f"  keep {e['keep_rate']:<4g} n={e['n']:<4} recall {e['recall']:.3f} [{lo:.3f}, {hi:.3f}]  "
                f"complete {e['complete']:.2f} [{clo:.2f}, {chi:.2f}]  ctx {e['context_kept']:.3f}  {e['variant']}"
            )
