"""The three vLLM functions the plugin wraps, each applied when vLLM imports its module.

- ``GPUModelRunner._prepare_inputs`` (the CPU runner inherits it): after vLLM filled the
  positions tensor with contiguous indices, planned requests get their original positions.
  Slot mapping (KV placement) was already computed from the contiguous indices and stays so.
- ``InputProcessor.process_inputs``: every request entering an engine (offline ``LLM`` and the
  server alike) has its plan validated (``ValueError`` → HTTP 400, never an engine crash) and
  its prefix cache salted with the plan's hash. A plan the engine cannot honour (``plan_refusal``:
  V2 runner, speculative decoding, M-RoPE, models that use positions beyond rotary embeddings) is
  refused there too, never silently run at contiguous positions.
- ``OpenAIServingCompletion.render_completion_request``: validates and refuses before a stream
  starts, so streaming requests also get a plain HTTP 400 instead of an error event.

Only this module touches vLLM internals; ``protocol`` holds the rules.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from .protocol import PlanError, PositionPlan, parse_plan

__all__ = ["POSITION_DEPENDENT_ARCHITECTURES", "apply_patches", "max_positions", "plan_refusal", "remap_positions"]

logger = logging.getLogger(__name__)

_MARK = "__specprefill_wrapped__"
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
INPUT_PROCESSOR_MODULE = "vllm.v1.engine.input_processor"
SERVING_MODULE = "vllm.entrypoints.openai.completion.serving"


def remap_positions(slots: torch.Tensor, kept: torch.Tensor, next_position: int) -> torch.Tensor:
    """Original positions for vLLM's contiguous slot indices of one request.

    slots: (n,) int64 indices into the request's sequence; kept: (k,) int64 prompt positions.
    Slot i < k → kept[i]; slot i >= k (generated tokens) → next_position + (i - k).
    """
    k = kept.numel()
    prompt = kept[slots.clamp(max=k - 1)]  # (n,)
    return torch.where(slots < k, prompt, slots + (next_position - k))


def max_positions(model_config: Any) -> int:
    """Positions a model accepts: vLLM's max_model_len, capped by max_position_embeddings."""
    limit = int(model_config.max_model_len)
    hf_config = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    embeddings = getattr(hf_config, "max_position_embeddings", None)
    return min(limit, int(embeddings)) if isinstance(embeddings, int) and embeddings > 0 else limit


# -- engines that cannot honour a plan --------------------------------------------------------

# Architectures whose vLLM 0.32 code reads positions for more than rotary embeddings: their
# cache layout, sparse-attention bounds or state windows are computed from positions, so
# rewritten positions would place or read KV at the wrong slots (docs/vllm.md, "Refusals").
POSITION_DEPENDENT_ARCHITECTURES: frozenset[str] = frozenset({
    # DeepSeek-V3.2 lightning indexer: k-pool slot = block * kpool + position % kpool
    # (v1/attention/backends/mla/indexer.py, compute_kpool_tail_slot_mapping)
    "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM",
    # the same indexer (SparseAttnIndexer) in other model families
    "Dots3NoteForCausalLM", "HYV4ForCausalLM", "KimiK3ForConditionalGeneration",
    # DeepSeek-V4/V4.1 KV compressors: cache rows from position // compress_ratio
    "DeepseekV4ForCausalLM", "DeepseekV4ForConditionalGeneration", "DeepseekV41ForCausalLM",
    # GLM-5-Next sparse indexer: causal top-k bounds and k-pool slots from positions
    "Glm5NextForCausalLM", "Glm5NextForConditionalGeneration",
    # MiniMax-M3 sparse indexer: per-token causal page count = position // page + 1
    "MiniMaxM3SparseForCausalLM", "MiniMaxM3SparseForConditionalGeneration",
    # Inkling short convolution: paged conv-state window addressed by absolute position
    "InklingForCausalLM", "InklingForConditionalGeneration",
    # Qwen4-Exp QSA: compressed side cache addressed by position % state size
    "Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration",
})
# A config field that switches a DeepSeek-V2-family model (DeepseekV3, Glm4MoeLite, LongCat,
# Mistral-Large-3, ...) onto the DeepSeek-V3.2 indexer (model_executor/models/deepseek_v2.py).
_SPARSE_INDEXER_FIELD = "index_topk"


def _uses_v2_runner(vllm_config: Any) -> bool:
    """vLLM's own decision (``VllmConfig.use_v2_model_runner``: the environment variable, or a
    feature that forces V2 such as HiSparse or watermarking). Undecidable counts as V2."""
    try:
        return bool(getattr(vllm_config, "use_v2_model_runner", False))
    except Exception:  # the property raises on contradictory settings
        return True


def _position_dependent(model_config: Any) -> str | None:
    """The architecture name when the model reads positions beyond rotary embeddings."""
    names = [getattr(model_config, "architecture", None), *(getattr(model_config, "architectures", None) or ())]
    for name in names:
        if name in POSITION_DEPENDENT_ARCHITECTURES:
            return str(name)
    for config in (getattr(model_config, "hf_config", None), getattr(model_config, "hf_text_config", None)):
        if config is not None and getattr(config, _SPARSE_INDEXER_FIELD, None) is not None:
            return f"{next((n for n in names if n), 'this model')} with the DeepSeek-V3.2 sparse indexer"
    return None


def plan_refusal(vllm_config: Any) -> str | None:
    """Why an engine with this ``VllmConfig`` cannot honour SpecPrefill plans; None when it can.

    Reads configuration only (no vLLM import), so it runs on stubs in the tests.
    """
    if _uses_v2_runner(vllm_config):
        return ("SpecPrefill plans are not supported with vLLM's V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1, "
                "or a feature that requires it such as HiSparse or watermarking): the plugin rewrites positions "
                "in the V1 runner only")
    if getattr(vllm_config, "speculative_config", None) is not None:
        return ("SpecPrefill plans are not supported with speculative decoding (--speculative-config: EAGLE, "
                "MTP, draft model, n-gram): draft steps derive their positions and KV slots from the rewritten "
                "positions")
    model_config = getattr(vllm_config, "model_config", None)
    if getattr(model_config, "uses_mrope", False):
        return "SpecPrefill plans are not supported for M-RoPE models"
    name = _position_dependent(model_config)
    if name is not None:
        return (f"SpecPrefill plans are not supported for {name}: it derives KV-cache slots or sparse-attention "
                "bounds from positions, not only rotary embeddings")
    return None


# -- model runner ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _CachedPlan:
    extra_args: dict[str, Any]  # the request's own dict, compared by identity (held, so never reused)
    prompt_len: int  # prompt tokens of the request state it was checked against
    plan: tuple[torch.Tensor, int] | None  # kept positions on the runner's device, next position


class _PlanCache:
    """Per-runner device tensors of kept positions, by request id, parsed once per request.

    An entry is valid only for the ``extra_args`` dict it was parsed from and the prompt length
    it was checked against, so a new request under a reused id (new ``SamplingParams``) or a
    streaming-input update is parsed afresh. Finished requests are forgotten.
    """

    def __init__(self) -> None:
        self.plans: dict[str, _CachedPlan] = {}

    def forget(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.plans.pop(req_id, None)

    def get(self, runner: Any, req_id: str, extra_args: dict[str, Any], prompt_len: int
            ) -> tuple[torch.Tensor, int] | None:
        cached = self.plans.get(req_id)
        if cached is not None and cached.extra_args is extra_args and cached.prompt_len == prompt_len:
            return cached.plan
        if len(self.plans) > 4 * max(1, len(runner.requests)) + 64:  # finished outside our steps
            self.plans = {r: p for r, p in self.plans.items() if r in runner.requests}
        plan: tuple[torch.Tensor, int] | None = None
        try:
            parsed = parse_plan(extra_args, prompt_len=prompt_len, max_tokens=None, max_len=1 << 62)
            if parsed is not None:
                kept = torch.tensor(parsed.positions, dtype=torch.int64, device=runner.positions.device)
                plan = (kept, parsed.next_position)
        except PlanError as error:  # process_inputs validated it; never crash the engine over it
            logger.error("SpecPrefill plan of request %s not applied, its positions stay contiguous: %s",
                         req_id, error)
        self.plans[req_id] = _CachedPlan(extra_args, prompt_len, plan)
        return plan


def _prompt_len(state: Any) -> int:
    """Prompt tokens of a runner's request state (``CachedRequestState.num_prompt_tokens``)."""
    n = getattr(state, "num_prompt_tokens", None)
    return int(n) if isinstance(n, int) else len(getattr(state, "prompt_token_ids", None) or ())


def _wrap_prepare_inputs(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _prepare_inputs(self: Any, scheduler_output: Any, num_scheduled_tokens: Any) -> Any:
        result = original(self, scheduler_output, num_scheduled_tokens)
        cache = self.__dict__.get("_specprefill_plans")
        if cache is not None:
            cache.forget(getattr(scheduler_output, "finished_req_ids", None) or ())
        batch = self.input_batch
        starts = None
        for i, req_id in enumerate(batch.req_ids[: batch.num_reqs]):
            state = self.requests.get(req_id)
            extra = getattr(getattr(state, "sampling_params", None), "extra_args", None)
            if not extra or "specprefill_positions" not in extra:
                continue
            cache = self.__dict__.setdefault("_specprefill_plans", _PlanCache())
            entry = cache.get(self, req_id, extra, _prompt_len(state))
            if entry is None or entry[0].numel() == 0:
                continue
            if starts is None:
                starts = self.query_start_loc.np
            start, end = int(starts[i]), int(starts[i + 1])
            if end > start:
                slots = self.positions[start:end]
                slots.copy_(remap_positions(slots, entry[0], entry[1]))
        return result

    setattr(_prepare_inputs, _MARK, True)
    return _prepare_inputs


def _patch_runner(module: ModuleType) -> None:
    runner = module.GPUModelRunner
    original = runner._prepare_inputs
    if getattr(original, _MARK, False):
        return
    params = list(original.__code__.co_varnames[: original.__code__.co_argcount])
    if params != ["self", "scheduler_output", "num_scheduled_tokens"]:
        raise RuntimeError(
            f"specprefill-rag: GPUModelRunner._prepare_inputs{tuple(params)} is not the shape this "
            "plugin was written for (vLLM 0.32); refusing to patch"
        )
    runner._prepare_inputs = _wrap_prepare_inputs(original)


# -- request admission -----------------------------------------------------------------------


def _wrap_process_inputs(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def process_inputs(self: Any, request_id: str, prompt: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        extra = getattr(params, "extra_args", None)
        max_tokens_given = getattr(params, "max_tokens", None)
        request = original(self, request_id, prompt, params, *args, **kwargs)
        if not extra or request.sampling_params is None:
            return request
        limit = max_positions(self.model_config)
        if max_tokens_given is None:  # vLLM filled in max_model_len - prompt_len: fit our positions
            next_position = extra.get("specprefill_next_position")
            if isinstance(next_position, int) and 0 <= next_position < limit:
                request.sampling_params.max_tokens = min(request.sampling_params.max_tokens, limit - next_position)
        plan = _parse_or_raise(
            request.sampling_params.extra_args,
            prompt_len=len(request.prompt_token_ids or ()),
            max_tokens=request.sampling_params.max_tokens,
            max_len=limit,
        )
        if plan is not None:
            refusal = plan_refusal(self.vllm_config)
            if refusal is not None:
                raise _validation_error(refusal)
            salt = plan.salt
            if request.cache_salt is None:
                request.cache_salt = salt
            elif not request.cache_salt.endswith(salt):
                request.cache_salt = f"{request.cache_salt}-{salt}"
        return request

    setattr(process_inputs, _MARK, True)
    return process_inputs


def _validation_error(message: str) -> Exception:
    from vllm.exceptions import VLLMValidationError

    return VLLMValidationError(message, parameter="vllm_xargs")


def _parse_or_raise(extra: Any, *, prompt_len: int, max_tokens: int | None, max_len: int) -> PositionPlan | None:
    try:
        return parse_plan(extra, prompt_len=prompt_len, max_tokens=max_tokens, max_len=max_len)
    except PlanError as error:
        raise _validation_error(f"invalid SpecPrefill plan in vllm_xargs: {error}") from None


def _patch_input_processor(module: ModuleType) -> None:
    cls = module.InputProcessor
    if not getattr(cls.process_inputs, _MARK, False):
        cls.process_inputs = _wrap_process_inputs(cls.process_inputs)


def _wrap_render(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    async def render_completion_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        result = await original(self, request, *args, **kwargs)
        extra = getattr(request, "vllm_xargs", None)
        if not extra or not isinstance(result, list):
            return result
        planned = False
        try:
            for engine_input in result:
                planned |= parse_plan(
                    extra,
                    prompt_len=int(self._extract_prompt_len(engine_input)),
                    max_tokens=request.max_tokens,
                    max_len=max_positions(self.model_config),
                ) is not None
        except PlanError as error:
            return self.create_error_response(f"invalid SpecPrefill plan in vllm_xargs: {error}", param="vllm_xargs")
        vllm_config = getattr(getattr(self, "engine_client", None), "vllm_config", None)
        refusal = plan_refusal(vllm_config) if planned and vllm_config is not None else None
        if refusal is not None:
            return self.create_error_response(refusal, param="vllm_xargs")
        return result

    setattr(render_completion_request, _MARK, True)
    return render_completion_request


def _patch_serving(module: ModuleType) -> None:
    cls = module.OpenAIServingCompletion
    if not getattr(cls.render_completion_request, _MARK, False):
        cls.render_completion_request = _wrap_render(cls.render_completion_request)


# -- applying patches when vLLM imports the modules ------------------------------------------


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Runs a patch right after a module executes, so the plugin never imports it eagerly."""

    def __init__(self, patches: dict[str, Callable[[ModuleType], None]]) -> None:
        self.patches = patches

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original_exec(module)
            patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_PATCHES: dict[str, Callable[[ModuleType], None]] = {
    RUNNER_MODULE: _patch_runner,
    INPUT_PROCESSOR_MODULE: _patch_input_processor,
    SERVING_MODULE: _patch_serving,
}


def apply_patches() -> None:
    """Patch the modules vLLM already imported; patch the others as they get imported."""
    pending = {}
    for name, patch in _PATCHES.items():
        module = sys.modules.get(name)
        if module is not None:
            patch(module)
        else:
            pending[name] = patch
    if pending and not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder(pending))
