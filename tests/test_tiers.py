"""The two test tiers (`make test`, `make test-all`) are what the README and CI say they are.

`make test` runs ``-m "not full"`` in every pytest run of its recipe and no client-venv run;
`make test-all` runs every test, and is what ``.ci/run`` calls. The quick tier keeps one real
vLLM server case and the install check, and the README's Python blocks (the faces on real weights).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def recipe(target: str) -> list[str]:
    """The command lines of a Makefile target (tab-indented, continuations joined)."""
    lines = (ROOT / "Makefile").read_text(encoding="utf-8").splitlines()
    out: list[str] = []
    for start in (i for i, line in enumerate(lines) if line.startswith(f"{target}:")):  # rules and variables
        for line in lines[start + 1:]:
            if not line.startswith("\t"):
                break
            line = line.strip()
            if line.startswith("#"):
                continue
            if out and out[-1].endswith("\\"):
                out[-1] = out[-1][:-1] + " " + line
            else:
                out.append(line)
    return out


def test_make_test_is_the_quick_tier_and_ci_runs_everything():
    quick_lanes = recipe("test")  # two lanes too: the main suite, and the install check with the integrations
    assert len(quick_lanes) == 1 and "-j2" in quick_lanes[0] and quick_lanes[0].endswith("test-main test-rest")
    quick = [line for lane in ("test-main", "test-rest") for line in recipe(lane) if "pytest" in line]
    assert quick and all('-m "not full' in line for line in quick), quick
    main = sorted(line.rsplit("-m ", 1)[1] for line in quick if "integrations/" not in line)  # split, whole
    assert main == ['"not full and install"', '"not full and not install" --ignore=tests/test_readme.py',
                    '"not full" tests/test_readme.py'], main
    assert not any(".venv-client" in line or "CLIENT_VENV" in line for line in quick)
    lanes = recipe("test-all")  # two lanes side by side, each a target of its own
    assert len(lanes) == 1 and "-j2" in lanes[0] and lanes[0].endswith("test-all-main test-all-rest"), lanes
    everything = [line for lane in ("test-all-main", "test-all-rest") for line in recipe(lane) if "pytest" in line]
    assert everything and not any("full" in line for line in everything), everything
    assert any("client_tests" in line for line in everything)
    def path(line: str) -> str:  # what a pytest line runs: its last argument, else the main suite
        last = line.split()[-1]
        return last if "/" in last and not last.startswith(("tests/", "--ignore=tests/")) else "tests"

    assert {path(line) for line in quick} <= {path(line) for line in everything}  # each quick run, whole too
    ci = [line for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines() if line.startswith("make")]
    assert ci == ["make test-all"]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert re.search(r"^make test +#", readme, re.M) and re.search(r"^make test-all +#", readme, re.M)


def collected(marks: str) -> list[str]:
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-m", marks, "tests"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode in (0, 5), done.stdout[-2000:] + done.stderr[-2000:]
    return [line for line in done.stdout.splitlines() if "::" in line]


def test_the_quick_tier_keeps_one_vllm_server_case_the_install_and_the_readme():
    heavy = collected("not full and (vllm or install or real_model)")
    assert [t for t in heavy if "vllm" in t.split("::")[0]] == [
        "tests/test_vllm_server.py::test_plan_matches_transformers"]
    assert any(t.startswith("tests/test_install.py::") for t in heavy)
    assert any(t.startswith("tests/test_readme.py::test_python_block_runs_as_written") for t in heavy)
    assert not any(t.startswith("tests/test_router.py::") for t in heavy)
