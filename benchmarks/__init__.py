"""Benchmarks (not part of the installed library): ``suites/`` what a user runs, ``lib/`` what
the suites share, ``report/`` the renderer of REPORT.md and docs/benchmarks.md, ``results/``
what it reads.

Run a suite as ``specprefill-rag bench SUITE`` or ``python -m benchmarks.suites.SUITE``, the
report as ``specprefill-rag bench report`` or ``python -m benchmarks.report``; see benchmarks/README.md.
"""

__all__: list[str] = []
