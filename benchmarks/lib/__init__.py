"""What the suites share, one module per concept: ``machine`` (machine facts, dtypes, run
settings), ``results`` (result files, crash-safe appends), ``datasets`` (the eval data and its
examples), ``long_context`` (the 4k–32k-token tasks built from them), ``metrics`` (medians,
bootstrap intervals), ``lookahead`` (look-ahead variants, the TTFT table), ``tiny`` (tiny random
models for smoke runs), ``runner_v2_check`` (the plugin in vLLM's V2 runner, which ``gpu_ttft``
runs on a GPU). Nothing here measures anything; the suites do."""

__all__: list[str] = []
