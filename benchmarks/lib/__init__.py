"""What the suites share, one module per concept: ``machine`` (machine facts, dtypes, run
settings), ``results`` (result files, crash-safe appends), ``datasets`` (the eval data and its
examples), ``long_context`` (the 4k–32k-token tasks built from them), ``metrics`` (medians,
bootstrap intervals), ``lookahead`` (look-ahead variants, the TTFT table), ``tiny`` (tiny random
models for smoke runs), ``runner_v2_check`` (the plugin in vLLM's V2 runner, which ``gpu_ttft``
runs on a GPU).

The pieces of the larger suites, each named for its concept: ``answers`` (scoring an answer),
``quality_methods``, ``quality_resume`` and ``llmlingua_peer`` (``bench quality``);
``evidence_variants``, ``evidence_capture``, ``evidence_recall``, ``evidence_tasks`` and
``evidence_summary`` (``bench evidence`` and the benches that draw from it); ``essay_prompts``,
``ttft_timing`` and ``peak_memory`` (``bench ttft``); ``gpu_pair``, ``gpu_profile`` and
``gpu_extras`` (``gpu_ttft``); ``prefix_cache_summary`` (``bench prefix_cache``). Nothing here
measures anything on its own; the suites do."""

__all__: list[str] = []
