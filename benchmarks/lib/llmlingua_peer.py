"""LongLLMLingua (``llmlingua``), the peer ``bench quality`` and ``bench peer_evidence`` compare
SpecPrefill against, run offline on the draft's already-loaded model (``LinguaCompressor``).

    pip install --no-deps llmlingua==0.2.2     # see docs/benchmarks.md
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

LLMLINGUA_VERSION = "0.2.2"  # the version whose PromptCompressor internals LinguaCompressor relies on


class _LegacyCacheModel:
    """llmlingua 0.2.2 slices ``past_key_values`` as a list of (key, value) pairs, the cache
    format transformers 5 no longer returns: convert to a DynamicCache on the way in and back
    to pairs on the way out. Everything else is the wrapped model."""

    def __init__(self, model: Any) -> None:
        self._model = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, *args: Any, past_key_values: Any = None, **kwargs: Any) -> Any:
        from transformers import DynamicCache

        if isinstance(past_key_values, (list, tuple)):
            past_key_values = DynamicCache(
                ddp_cache_data=[(k, v) for k, v in past_key_values], config=self._model.config
            )
        out = self._model(*args, past_key_values=past_key_values, **kwargs)
        cache = getattr(out, "past_key_values", None)
        if cache is not None and hasattr(cache, "layers"):
            out.past_key_values = [[layer.keys, layer.values] for layer in cache.layers]
        return out


class LinguaCompressor:
    """LongLLMLingua (llmlingua.PromptCompressor) scoring with an already-loaded causal LM.

    Offline deviations from a stock ``PromptCompressor(model_name)``:
    - its constructor calls ``tiktoken.encoding_for_model("gpt-3.5-turbo")``, which downloads
      cl100k_base from openaipublic.blob.core.windows.net: token counts use the draft's own
      tokenizer instead (budgets are then in the same tokens as ours);
    - it would load a second copy of the model: it gets the draft's model object instead.
    """

    def __init__(self, model: Any, tokenizer: Any, model_name: str) -> None:
        import importlib.metadata

        try:
            from llmlingua import PromptCompressor
        except ImportError:
            raise SystemExit(
                "llmlingua is missing: pip install --no-deps llmlingua==0.2.2 (see docs/benchmarks.md)"
            ) from None
        version = importlib.metadata.version("llmlingua")
        if version != LLMLINGUA_VERSION:
            print(f"warning: llmlingua {version} (written for {LLMLINGUA_VERSION}); internals may differ", flush=True)

        class _Counter:  # stands in for the tiktoken encoding
            def encode(self, text: str, **_: Any) -> list[int]:
                return list(tokenizer.encode(text, add_special_tokens=False))

            def decode(self, ids: Sequence[int], **_: Any) -> str:
                return str(tokenizer.decode(list(ids)))

        pc = PromptCompressor.__new__(PromptCompressor)
        pc.model_name = model_name
        pc.use_llmlingua2 = False
        pc.retrieval_model = None
        pc.retrieval_model_name = None
        pc.open_api_config = {}
        pc.cache_bos_num = 10
        pc.prefix_bos_num = 100
        pc.oai_tokenizer = _Counter()
        pc.tokenizer = tokenizer
        pc.model = _LegacyCacheModel(model)
        pc.device = str(next(model.parameters()).device)
        pc.context_idxs = []
        pc.max_position_embeddings = model.config.max_position_embeddings
        self._pc = pc
        self._tokenizer = tokenizer

    def compress(self, passages: Sequence[str], question: str, target_tokens: int) -> tuple[str, float]:
        """LongLLMLingua's recommended settings; returns (compressed context, seconds)."""
        tok = self._tokenizer
        padding_side, pad_id = tok.padding_side, tok.pad_token_id
        tok.padding_side = "left"
        if tok.pad_token_id is None:
            tok.pad_token_id = tok.eos_token_id
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                out = self._pc.compress_prompt(
                    list(passages),
                    question=question,
                    target_token=max(int(target_tokens), 8),
                    condition_in_question="after_condition",
                    reorder_context="sort",
                    dynamic_context_compression_ratio=0.3,
                    condition_compare=True,
                    context_budget="+100",
                    rank_method="longllmlingua",
                    concate_question=False,
                )
        finally:
            tok.padding_side, tok.pad_token_id = padding_side, pad_id
        return str(out["compressed_prompt"]), time.perf_counter() - start
