"""Around the algorithm, not part of it: the command line and what it starts. A leaf: nothing in
the library imports ``tools``.

- ``cli``: the ``specprefill-rag`` command.
- ``vllm_process``: start and stop vLLM's OpenAI server with the plugin (``specprefill-rag serve``).
- ``retrieval``: documents → passages → a MiniLM retriever; the bundled demo collection.

The algorithm core is the package's top level (``prompt``: segments, rendering; the ``draft`` wing:
capture, scoring and cross-family mapping; ``selection``, ``engine``; ``loading`` finds model files); main
models are behind ``backends``; the vLLM side is ``vllm_plugin``; the OpenAI-compatible server is ``gateway``.
"""
