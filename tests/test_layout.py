"""The layout around the library: tests share code through helper modules, never through one
another; the benchmarks run as modules of one package (no path set up by hand), ``lib/`` never
reaches up into a suite, ``bench SUITE`` finds every suite, and ``report.CURRENT`` names exactly
the results files the page is rendered from.

Imports are read with ``ast`` (inside functions too), so nothing here depends on what a module
happens to import at run time.
"""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
BENCHMARKS = REPO / "benchmarks"
# The names `specprefill-rag bench` takes.
BENCH_SUITES = ("ttft", "quality", "evidence", "guesses", "lookahead_cost", "windows", "gateway_load",
                "prefix_cache", "plugin_step", "serving", "draft_batch", "tool_rag", "report")


def imported_modules(path: Path) -> list[str]:
    """Every module an import statement in ``path`` names (relative ones with their dots)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names += [base] + ([f"{base}.{alias.name}" for alias in node.names] if not node.module else [])
    return names


def is_test_module(name: str) -> bool:
    return name.lstrip(".").split(".")[-1].startswith("test_") or name.startswith(("tests.test_", ".test_"))


def test_no_test_module_imports_another() -> None:
    """Nor does the client side's suite (client_tests/, its own venv) import one of tests/."""
    found = [(path.name, name) for path in sorted([*TESTS.rglob("*.py"), *(REPO / "client_tests").rglob("*.py")])
             for name in imported_modules(path) if is_test_module(name)]
    assert not found, f"move what they share into tests/helpers.py or tests/servers.py: {found}"


def test_no_benchmarks_module_touches_the_import_path() -> None:
    found = []
    for path in sorted(BENCHMARKS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                    and node.value.id == "sys"):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, f"run as modules (python -m benchmarks.suites.NAME) instead: {found}"


def test_every_benchmarks_module_imports_as_a_module() -> None:
    for path in sorted(BENCHMARKS.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))


def test_lib_never_imports_a_suite() -> None:
    """What the suites share sits below them: a suite may import lib/, never the other way."""
    found = [(path.name, name) for path in sorted((BENCHMARKS / "lib").glob("*.py"))
             for name in imported_modules(path) if name.startswith(("benchmarks.suites", "benchmarks.report"))]
    assert not found


def test_bench_runs_each_suite_as_its_module(monkeypatch: pytest.MonkeyPatch) -> None:
    from specprefill_rag.tools import cli

    calls: list[tuple[list[str], Path]] = []
    monkeypatch.setattr(subprocess, "call", lambda cmd, cwd: calls.append((cmd, Path(cwd))) or 0)
    for suite in BENCH_SUITES:
        assert cli.main(["bench", suite, "--n", "1"]) == 0, suite
    for suite, (cmd, cwd) in zip(BENCH_SUITES, calls, strict=True):
        assert cmd[0] == sys.executable and cmd[1] == "-m" and cmd[3:] == ["--n", "1"]
        assert cwd == REPO
        module = REPO / Path(*cmd[2].split("."))  # a module, or a package with a __main__.py (report)
        assert module.with_suffix(".py").is_file() or (module / "__main__.py").is_file(), cmd[2]
        assert cmd[2] == ("benchmarks.report" if suite == "report" else f"benchmarks.suites.{suite}")


def test_the_report_reads_exactly_the_current_results(tmp_path: Path) -> None:
    """``report.CURRENT`` lists what ``render`` opens under results/: nothing more (a file on the
    page is in the list), nothing less (a listed file is read), and every listed file is there."""
    pytest.importorskip("matplotlib")
    from benchmarks import report

    results = report.RESULTS_DIR.resolve()
    missing = [name for name in report.CURRENT if not (results / name).is_file()]
    assert not missing
    opened: set[str] = set()
    listening = [True]

    def hook(event: str, args: tuple[object, ...]) -> None:
        if listening[0] and event == "open" and isinstance(args[0], str | bytes | os.PathLike):
            path = Path(os.path.abspath(os.fsdecode(args[0])))
            if path.is_relative_to(results):
                opened.add(path.relative_to(results).as_posix())

    sys.addaudithook(hook)  # hooks cannot be removed: this one stops listening below
    try:
        report.render(results, tmp_path / "benchmarks.md", tmp_path / "images")
    finally:
        listening[0] = False
    assert opened == set(report.CURRENT)
