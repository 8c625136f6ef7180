"""Resuming a ``bench quality`` result file: its earlier rows (by example, method and keep rate),
refused where they were measured in other dtypes or for other prompts under the same ids; the
full-prompt answers of another file reused (``--full-from``); the plan of every run it holds.
"""

from __future__ import annotations

import argparse
import collections
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.lib.datasets import Example
from benchmarks.lib.results import same_example

Earlier = dict[tuple[str, str], dict[tuple[str, float | None], dict[str, Any]]]  # (task, id) → (method, keep) → row


def recorded_dtypes(data: dict[str, Any]) -> dict[str, str]:
    """The dtypes a result file's models ran in; files written before they were recorded ran
    both models in float32."""
    return data.get("dtypes", {"main": "float32", "draft": "float32"})


def same_dtypes(before: dict[str, Any], dtypes: dict[str, str], path: Path) -> None:
    """Refuse to resume a result file measured in other dtypes (``recorded_dtypes``): one file,
    one pair of dtypes."""
    if not before.get("rows"):
        return
    found = recorded_dtypes(before)
    if found != dtypes:
        one = set(found.values())
        fix = (f"pass --dtype {one.pop()}" if len(one) == 1 else
               "no --dtype gives that pair any more (auto gives both models one precision since issue 47):")
        raise SystemExit(f"{path} was measured with {_pair(found)}, this run has {_pair(dtypes)}: {fix} "
                         "or pass another --out")


def same_prompts(engine: Any, examples: Sequence[Example], earlier: Earlier, path: Path) -> None:
    """Before any work: refuse to resume ``path`` where an example it holds now assembles to
    another prompt (``results.same_example``), so a cached full-prompt answer is never scored
    against another example's pruned ones."""
    from specprefill_rag import Passage

    for ex in examples:
        if (ex.task, ex.id) in earlier:
            prompt = engine.assemble(ex.question, [Passage(text, id=pid) for pid, text in ex.passages])
            same_example(list(earlier[(ex.task, ex.id)].values()), prompt, path)


def _pair(dtypes: dict[str, str]) -> str:
    return ", ".join(f"the {role} in {dtype}" for role, dtype in sorted(dtypes.items()))


def load_earlier(path: Path, fresh: bool) -> tuple[Earlier, dict[str, Any]]:
    """The rows of earlier runs in ``path``, for resuming, and that file's other fields (nothing
    with ``--fresh``)."""
    earlier: Earlier = collections.defaultdict(dict)
    if not path.exists() or fresh:
        return earlier, {}
    before = json.loads(path.read_text())
    for r in before.get("rows", []):
        earlier[(r["task"], r["id"])][(r["method"], r["keep_rate"])] = r
    print(f"resuming: {sum(map(len, earlier.values()))} rows of {len(earlier)} examples in {path}", flush=True)
    return earlier, before


def full_answers_from(source: Path, payload: dict[str, Any], args: argparse.Namespace) -> Earlier:
    """The full-prompt rows of ``source``, another result file: the full prompt's answer involves
    neither the draft nor the selection, so a run with another draft (or another selection) needs
    only its pruned rows. ``source`` must have the same main model, main dtype and answer length;
    its prompts are checked per example like a resumed file's (``same_prompts``). Each reused row
    says where it came from (``full_from``)."""
    other = json.loads(source.read_text())
    mine = (payload["models"]["main"], payload["dtypes"].get("main"), args.max_new_tokens)
    theirs = (other.get("models", {}).get("main"), recorded_dtypes(other)["main"],
              other.get("settings", {}).get("max_new_tokens"))
    if mine != theirs:
        raise SystemExit(f"--full-from {source}: its full-prompt answers were measured with main model, main dtype and "
                         f"--max-new-tokens {theirs}, this run has {mine}")
    found: Earlier = collections.defaultdict(dict)
    for r in other.get("rows", []):
        if r["method"] == "full":
            found[(r["task"], r["id"])][("full", None)] = {**r, "full_from": source.name}
    print(f"--full-from: full-prompt answers of {len(found)} examples in {source}", flush=True)
    return found


def merged_plan(payload: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """``payload`` with what the earlier runs in the same file asked for: every task's planned
    count (the largest asked for), every distinct command, in order, this one last, and
    the peers' scorers where an earlier run measured them and this one does not."""
    commands = [c for c in before.get("commands", [before.get("command")]) if c and c != payload["command"]]
    counts = dict(before.get("counts", {}))
    for task, n in payload["counts"].items():
        counts[task] = max(n, counts.get(task, 0))
    models = dict(payload["models"])
    for peer in ("llmlingua_scorer", "ragcompress_scorer"):
        if peer in models or peer in before.get("models", {}):
            models[peer] = models.get(peer) or before.get("models", {}).get(peer)
    return {**payload, "models": models, "counts": counts, "commands": [*commands, payload["command"]]}
