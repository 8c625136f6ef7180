"""Benchmarks (not part of the installed library): TTFT, answer quality, the GPU script, the report.

Run them as `specprefill-rag bench ttft|quality|report` or `python -m benchmarks.<name>`; see docs/benchmarks.md.
"""

__all__: list[str] = []
