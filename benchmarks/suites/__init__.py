"""What a user runs, one module per suite: ``python -m benchmarks.suites.NAME --help`` or
``specprefill-rag bench NAME``. Each writes one file under ``benchmarks/results/`` by default."""

__all__: list[str] = []
