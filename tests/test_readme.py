"""The README as a newcomer meets it: every ```python block runs as written, every relative link
and anchor resolves, and it stays a five-minute read.

A block that needs a running server says so on its first line (``# needs: ...``); those are
compiled but not run, and the list of them is pinned here so a new one is a visible choice.
The other blocks load the packaged Qwen2.5-Coder pair (``real_model``: minutes on a CPU) and run
in a fresh interpreter from the repository root, exactly as pasted.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

NEEDS = "# needs: "
# The blocks that cannot run here, by their first line, in README order.
EXPECTED_NEEDS = [
    "# needs: a running vLLM server (specprefill-rag serve ... --port 8000)",
    "# needs: a running gateway (specprefill-rag serve ... --gateway-port 8080)",
]
EXPECTED_RUNNABLE = 3  # "Use it from Python", LlamaIndex, LangChain
MAX_WORDS = 1300
MAX_RESULT_ROWS = 4

_FENCE = re.compile(r"^```(\w*)\s*$")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _blocks(text: str) -> list[tuple[str, int, str]]:
    """(language, first line number, code) of every fenced block."""
    out, lang, start, lines = [], None, 0, []
    for number, line in enumerate(text.splitlines(), 1):
        match = _FENCE.match(line)
        if lang is None and match:
            lang, start, lines = match.group(1), number + 1, []
        elif lang is not None and line.startswith("```"):
            out.append((lang, start, "\n".join(lines) + "\n"))
            lang = None
        elif lang is not None:
            lines.append(line)
    assert lang is None, "an unclosed code fence"
    return out


def _python_blocks() -> list[tuple[int, str]]:
    return [(start, code) for lang, start, code in _blocks(README.read_text(encoding="utf-8")) if lang == "python"]


def _runnable() -> list[tuple[int, str]]:
    return [(start, code) for start, code in _python_blocks() if not code.startswith(NEEDS)]


def _prose(text: str) -> str:
    """The text outside fenced blocks."""
    out, inside = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            inside = not inside
        elif not inside:
            out.append(line)
    return "\n".join(out)


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file: lower case, punctuation dropped, spaces → '-'."""
    seen: dict[str, int] = {}
    for line in _prose(path.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        if seen[slug]:
            seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def test_blocks_that_cannot_run_here_are_exactly_the_listed_ones():
    needs = [code.splitlines()[0] for _, code in _python_blocks() if code.startswith(NEEDS)]
    assert needs == EXPECTED_NEEDS
    assert len(_runnable()) == EXPECTED_RUNNABLE


@pytest.mark.parametrize("start, code", _python_blocks(), ids=lambda v: f"line{v}" if isinstance(v, int) else "")
def test_every_python_block_compiles(start, code):
    compile(code, f"README.md:{start}", "exec")


@pytest.mark.real_model
@pytest.mark.parametrize("start, code", _runnable(), ids=lambda v: f"line{v}" if isinstance(v, int) else "")
def test_python_block_runs_as_written(start, code):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800
    )
    assert done.returncode == 0, f"README.md:{start} failed:\n{done.stderr[-4000:]}"
    assert done.stdout.strip(), f"README.md:{start} printed nothing"


def test_relative_links_and_anchors_resolve():
    broken = []
    for target in _LINK.findall(_prose(README.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (README.parent / path).resolve() if path else README
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (file.suffix != ".md" or anchor not in _anchors(file)):
            broken.append(f"{target}: no heading #{anchor}")
    assert not broken, broken


def test_anchor_slugs_follow_github(tmp_path):
    path = tmp_path / "anchors.md"
    path.write_text("# Drafts from another family\n## Time to first token: a → b (CPU, `x.json`)\n## Notes\n"
                    "## Notes\n```\n# not a heading\n```\n", encoding="utf-8")
    assert _anchors(path) == {"drafts-from-another-family", "time-to-first-token-a--b-cpu-xjson", "notes", "notes-1"}


def test_readme_stays_a_five_minute_read():
    text = README.read_text(encoding="utf-8")
    assert len(text.split()) <= MAX_WORDS
    results = text.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in results.splitlines() if line.startswith("|")]
    assert len(rows) - 2 <= MAX_RESULT_ROWS  # header and rule
