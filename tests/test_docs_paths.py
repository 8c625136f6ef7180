"""The docs name files that exist, and only the repository's own.

``docs/architecture.md`` is where a newcomer learns where code lives: every path it names in
backticks exists (relative to the repository or to the package; a bare file name somewhere in
the repository; ``<suite>`` and ``*`` as wildcards). No page of docs/ or the README cites a file
that is not in the repository (the project's design notes live beside the checkout, not in it).
"""

from __future__ import annotations

import fnmatch
import functools
import os
import re
from pathlib import Path

import pytest

from benchmarks.report.summary import anchor

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
SKIP_DIRS = {".venv", ".venv-web", ".venv-client", ".git", "node_modules", "build", "dist"}
PATHLIKE = re.compile(r"\.(py|md|toml|json|jsonl|sh|txt|png|yaml)$")


def named_paths(text: str) -> list[str]:
    """Backticked tokens that read as paths: a slash, or a file extension; not URLs or flags."""
    tokens = re.findall(r"`([^`\s]+)`", text)
    return sorted({t for t in tokens if ("/" in t or PATHLIKE.search(t)) and not t.startswith(("http", "-", "~", "/"))
                   and "://" not in t and "=" not in t and "(" not in t})


@functools.cache
def file_names() -> frozenset[str]:
    """Every file and folder name in the repository's tree (virtualenvs and build output left out)."""
    names: set[str] = set()
    for _, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        names.update(files, dirs)
    return frozenset(names)


def exists(token: str) -> bool:
    pattern = re.sub(r"<[^>]+>", "*", token.split("::")[0].rstrip("/")).replace("(l)", "*")
    if "/" not in pattern:
        return any(fnmatch.fnmatch(name, pattern) for name in file_names())
    return any(list(base.glob(pattern)) for base in (REPO, REPO / "specprefill_rag"))


def test_every_path_architecture_names_exists():
    names = named_paths((REPO / "docs" / "architecture.md").read_text(encoding="utf-8"))
    assert len(names) > 40  # the page names the house's paths; a parsing slip would find few
    assert [name for name in names if not exists(name)] == []


def test_a_missing_path_is_found():
    assert not exists("specprefill_rag/no_such_module.py") and not exists("no_such_file.py")
    assert exists("tools/cli_parser.py") and exists("benchmarks/results/<suite>.json(l)")


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_no_page_cites_a_file_outside_the_repository(page: Path):
    text = page.read_text(encoding="utf-8")
    assert not re.search(r"\b(DESIGN|STYLE)\.md\b", text), page.name


MAX_DOCS_WORDS = 25_000  # docs/ in all: pages a person reads (tables beyond them: benchmarks/REPORT.md)
MAX_SUMMARY_WORDS = 5_000  # docs/benchmarks.md, the generated summary


def test_the_docs_stay_a_size_a_person_reads():
    words = {page.name: len(page.read_text(encoding="utf-8").split()) for page in (REPO / "docs").glob("*.md")}
    assert sum(words.values()) <= MAX_DOCS_WORDS, sorted(words.items(), key=lambda kv: -kv[1])
    assert words["benchmarks.md"] <= MAX_SUMMARY_WORDS


_LINK = re.compile(r"\]\(([^)\s]+)\)")


@functools.cache
def _anchors(page: Path) -> frozenset[str]:
    """The GitHub anchors of a page's headings (``bench report``'s rule; code fences skipped,
    repeats get -1, -2, ...)."""
    seen: dict[str, int] = {}
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        fenced ^= line.startswith("```")
        heading = re.match(r"#{1,6}\s+(.*)$", line)
        if heading and not fenced:
            slug = anchor(heading.group(1))
            seen[slug] = seen.get(slug, -1) + 1
    return frozenset(f"{slug}-{i}" if i else slug for slug, count in seen.items() for i in range(count + 1))


@pytest.mark.parametrize("page", [*DOCS, REPO / "benchmarks" / "REPORT.md"], ids=lambda p: p.name)
def test_every_relative_link_reaches_its_file_and_heading(page: Path):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    broken = []
    for target in _LINK.findall(text):
        if "://" in target or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page.resolve()
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in _anchors(dest)):
            broken.append(target)
    assert broken == [], f"{page.name}: {broken}"
