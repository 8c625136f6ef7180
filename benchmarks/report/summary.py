"""docs/benchmarks.md, the page a person reads, cut from the full one (benchmarks/REPORT.md).

The full page tables every run the project keeps: each TTFT file (most of them with a baseline
that is not the main model at its best), each task and keep rate, each draft. The summary keeps
of it the headline, how the runs are made and how to read them, the time-to-first-token sections
whose baseline is fair, the answer quality of the default, the gateway under load and the
reproduction steps, in their order, each cut to its lead (its first table, the paragraph after it
and its figures), and lists every other section with a link into the full page. Nothing is
recomputed: the summary's tables are the full page's lines.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

# Top-level sections (their "## " titles) the summary keeps: these as they are, ...
WHOLE = ("Headline", "How these runs are made")
# ... these (and the fair TTFT sections) cut to their lead, ...
LEAD = ("Answer quality", "The gateway under concurrent load", "Request rate under a TTFT SLO (open-loop arrivals)")
INSTALL = "Install and reproduce"  # ... and this one last, after the index of the rest.
TTFT = "Time to first token"
_LINK = re.compile(r"\]\(([^)#\s][^)\s]*)\)")


def split_sections(lines: Sequence[str]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """(the lines before the first "## " heading, [(title, the section's lines), ...])."""
    head: list[str] = []
    sections: list[tuple[str, list[str]]] = []
    for line in lines:
        if line.startswith("## "):
            sections.append((line[3:].strip(), [line]))
        elif sections:
            sections[-1][1].append(line)
        else:
            head.append(line)
    return head, sections


def fair_ttft(title: str, body: Sequence[str]) -> bool:
    """A time-to-first-token section whose tables all have a fair baseline: no "### Backend"
    heading in it carries a qualifier ("— unverified baseline", "— unfair baseline")."""
    backends = [line for line in body if line.startswith("### Backend")]
    return title.startswith(TTFT) and bool(backends) and not any(" — " in line for line in backends)


def lead(body: Sequence[str]) -> list[str]:
    """A section cut to its lead: everything through its first table and the paragraph after it
    (the table's targets and key), then its figures; the whole when it has no table."""
    rows = [i for i, line in enumerate(body) if line.startswith("|")]
    if not rows:
        return list(body)
    end = next((i for i in range(rows[0], len(body)) if not body[i].startswith("|")), len(body))
    after = next((i for i in range(end + 1, len(body)) if body[i].strip() == "" and body[i - 1].strip()), len(body))
    figures = [line for line in body[after:] if line.startswith("![")]
    return list(body[:after]) + [line for figure in figures for line in ("", figure)] + [""]


def label(title: str) -> str:
    """How the index names a section: a TTFT section by its results file (their titles differ in
    it alone), any other by its title."""
    found = re.search(r"`benchmarks/results/([^`]+)`", title)
    return f"{TTFT}, `{found.group(1)}`" if title.startswith(TTFT) and found else title


def anchor(title: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def summary(lines: Sequence[str], full: str) -> list[str]:
    """The summary page of the full page's ``lines``; ``full``: the full page's path as a link
    from the summary."""
    head, sections = split_sections(lines)
    body: list[str] = []
    install: list[str] = []
    left: list[str] = []
    for title, part in sections:
        if title in WHOLE:
            body += part
        elif title == INSTALL:
            install += part
        elif title in LEAD or fair_ttft(title, part):
            cut = lead(part)
            more = [f"The rest of this section: [the full report]({full}#{anchor(title)}).", ""]
            body += cut + (more if len(cut) < len(part) else [])
        else:
            left.append(title)
    pointer = [f"The tables a reader needs. Every other table (each run, task, keep rate and draft) is in "
               f"[the full report]({full}), generated from the same files by the same command.", ""]
    index = [f"## Every other table ([the full report]({full}))", ""]
    index += [f"- [{label(title)}]({full}#{anchor(title)})" for title in left] + [""]
    return head + pointer + body + index + install


def relink(lines: Sequence[str], written_for: Path, at: Path) -> list[str]:
    """``lines`` written as a page in ``written_for`` links (relative file links: images, other
    pages), moved to a page in ``at``: each relative link re-pointed to the same file."""
    if written_for.resolve() == at.resolve():
        return list(lines)

    def moved(match: re.Match[str]) -> str:
        target = match.group(1)
        if "://" in target:
            return match.group(0)
        return f"]({Path(os.path.relpath(written_for / target, at)).as_posix()})"

    return [_LINK.sub(moved, line) for line in lines]
