"""Admission of planned requests: validation and refusal before a request reaches the engine.

- ``InputProcessor.process_inputs``: every request entering an engine (offline ``LLM`` and the
  server alike) has its plan validated (``ValueError`` → HTTP 400, never an engine crash) and
  the plan's hash appended to its ``cache_salt``: the fail-safe that isolates each plan's cached
  blocks. ``prefix_cache`` takes the plan's salt off again in the engine's block hasher and hashes
  positions instead, so blocks before the plan's first gap are shared. A plan the engine cannot
  honour (``plan_refusal``: speculative decoding, M-RoPE, models that use positions beyond rotary
  embeddings, KV-transfer connectors not keyed by vLLM's block hashes, and under the V2 runner
  prefill context parallelism and HiSparse) is refused there too, never silently run at
  contiguous positions.
- ``OpenAIServingCompletion.render_completion_request`` and ``OpenAIServingChat.render_chat_request``:
  validate and refuse once the prompt is rendered, before a stream starts, so streaming requests
  also get a plain HTTP 400 instead of an error event; and, before admitting a plan, require that
  every vLLM worker reported the position rewrite (``workers``: HTTP 503 otherwise).
- ``to_beam_search_params`` of the request models that carry ``vllm_xargs`` (completions, chat,
  transcription, translation): beam search rebuilds the sampling parameters without
  ``extra_args``, so a plan there is refused (HTTP 400) instead of dropped.
- ``OpenAIServingCompletion.completion_stream_generator`` and ``request_output_to_completion_response``:
  every JSON object of a planned ``/v1/completions`` answer carries the plan's proof
  (``wire.PROOF_FIELD``: ``wire.plan_proof`` of the rendered prompt ids and the admitted plan), which
  clients require before they accept a token (a replica without the plugin sends none).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator, Callable, Sequence
from http import HTTPStatus
from types import ModuleType
from typing import Any

from ..errors import PlanError
from ..wire import INVALID_PLAN, NEXT_POSITION_KEY, POSITIONS_KEY, PROOF_FIELD, PositionPlan, parse_plan, plan_proof
from .runner import MARK
from .workers import has_plan, worker_refusal

__all__ = [
    "BEAM_SEARCH_REFUSAL", "BLOCK_HASH_KV_CONNECTORS", "CHAT_SERVING_MODULE", "INPUT_PROCESSOR_MODULE", "PATCHES",
    "POSITION_DEPENDENT_ARCHITECTURES", "REQUEST_MODELS", "SERVING_MODULE", "max_positions", "plan_refusal",
]

INPUT_PROCESSOR_MODULE = "vllm.v1.engine.input_processor"
SERVING_MODULE = "vllm.entrypoints.openai.completion.serving"
CHAT_SERVING_MODULE = "vllm.entrypoints.openai.chat_completion.serving"


def max_positions(model_config: Any) -> int:
    """Positions a model accepts: vLLM's ``max_model_len``.

    Not the HF ``max_position_embeddings``: for rope-scaled models (YaRN, dynamic NTK, LongRoPE)
    that is the pre-scaling length, and vLLM sizes its rotary cache and checks ``max_model_len``
    against the scaled length itself.
    """
    return int(model_config.max_model_len)


# -- engines that cannot honour a plan --------------------------------------------------------

# Architectures whose vLLM 0.32 / 0.33 code reads positions for more than rotary embeddings: their
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
    # Step5 (new in 0.33) CSA tail ring and summary cache: ring row = position % capacity
    # (models/step5/nvidia/csa_tail_ring.py, ops/summary_update.py)
    "Step5ForCausalLM", "Step5ForConditionalGeneration",
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


def _v2_refusal(vllm_config: Any) -> str | None:
    """What the V2 runner's rewrite (``runner_v2``) does not cover."""
    parallel = getattr(vllm_config, "parallel_config", None)
    if (getattr(parallel, "prefill_context_parallel_size", 1) or 1) > 1:
        return ("SpecPrefill plans are not supported with prefill context parallelism in vLLM's V2 model runner: "
                "it partitions the batch before the slot mapping the plugin's rewrite follows")
    if getattr(vllm_config, "hisparse_config", None) is not None:
        return ("SpecPrefill plans are not supported with HiSparse: its sparse attention has not been checked "
                "against rewritten positions")
    return None


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


# KV-transfer connectors whose stores are keyed by vLLM's own block hashes (``request.block_hashes``,
# which ``prefix_cache`` makes position-aware, or which carry the plan's salt where it could not):
# vLLM's CPU offloading (``OffloadingConnector``: ``make_offload_key(block_hash, group)``;
# ``SimpleCPUOffloadConnector``: its CPU block pool's block hashes) and Mooncake's store
# (``MooncakeStoreConnector``: ``<prefix>@<block hash>``). Every other connector is refused:
# LMCache (both modes), HF3FS, FlexKV and the example connectors key by token ids (plus at most the
# salt), and the disaggregated-prefill connectors (NIXL, Mooncake, MoRIIO) load KV another instance
# computed, which this instance's proof cannot vouch for. Read in vLLM 0.32's source.
BLOCK_HASH_KV_CONNECTORS: frozenset[str] = frozenset({
    "OffloadingConnector", "SimpleCPUOffloadConnector", "MooncakeStoreConnector",
})


def _kv_connectors(config: Any) -> list[tuple[Any, Any]]:
    """(name, module path) of each connector a ``KVTransferConfig`` sets up (``MultiConnector``: its children)."""
    name, path = getattr(config, "kv_connector", None), getattr(config, "kv_connector_module_path", None)
    if name != "MultiConnector" or path:
        return [(name, path)]
    children = (getattr(config, "kv_connector_extra_config", None) or {}).get("connectors") or [{}]
    return [(c.get("kv_connector"), c.get("kv_connector_module_path")) if isinstance(c, dict) else (c, None)
            for c in children]


def _kv_connector_refusal(vllm_config: Any) -> str | None:
    """The refusal for a configured KV-transfer connector not keyed by vLLM's block hashes."""
    config = getattr(vllm_config, "kv_transfer_config", None)
    configured = getattr(config, "kv_connector", None)
    if configured is None:
        return None
    for name, path in _kv_connectors(config):
        if name in BLOCK_HASH_KV_CONNECTORS and not path:
            continue
        what = f"{name}{f' from {path}' if path else ''}{' (in MultiConnector)' if configured != name else ''}"
        return (f"SpecPrefill plans are not supported with the KV-transfer connector {what} (--kv-transfer-config, "
                "--kv-offloading-backend): it stores or loads KV by other keys than vLLM's position-aware block "
                "hashes (token ids, as LMCache does, or KV another instance computed), so KV computed at a plan's "
                "positions could be served to later requests, of any tenant, whose prompts start with the same token "
                f"ids. Allowed, keyed by vLLM's block hashes: {', '.join(sorted(BLOCK_HASH_KV_CONNECTORS))}")
    return None


def plan_refusal(vllm_config: Any) -> str | None:
    """Why an engine with this ``VllmConfig`` cannot honour SpecPrefill plans; None when it can.

    Reads configuration only (no vLLM import), so it runs on stubs in the tests.
    """
    if _uses_v2_runner(vllm_config) and (refusal := _v2_refusal(vllm_config)) is not None:
        return refusal
    if (refusal := _kv_connector_refusal(vllm_config)) is not None:
        return refusal
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
            next_position = extra.get(NEXT_POSITION_KEY)
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

    setattr(process_inputs, MARK, True)
    return process_inputs


def _validation_error(message: str) -> Exception:
    from vllm.exceptions import VLLMValidationError

    return VLLMValidationError(message, parameter="vllm_xargs")


def _parse_or_raise(extra: Any, *, prompt_len: int, max_tokens: int | None, max_len: int) -> PositionPlan | None:
    try:
        return parse_plan(extra, prompt_len=prompt_len, max_tokens=max_tokens, max_len=max_len)
    except PlanError as error:
        raise _validation_error(f"{INVALID_PLAN}: {error}") from None


def _patch_input_processor(module: ModuleType) -> None:
    cls = module.InputProcessor
    if not getattr(cls.process_inputs, MARK, False):
        cls.process_inputs = _wrap_process_inputs(cls.process_inputs)


def _completion_inputs(result: Any) -> list[Any] | None:
    """The engine inputs of ``render_completion_request``'s result (None: an error response)."""
    return result if isinstance(result, list) else None


def _chat_inputs(result: Any) -> list[Any] | None:
    """The engine inputs of ``render_chat_request``'s ``(conversation, engine_inputs)``."""
    return list(result[1]) if isinstance(result, tuple) and len(result) == 2 else None


def _completion_max_tokens(request: Any) -> int | None:
    return getattr(request, "max_tokens", None)


def _chat_max_tokens(request: Any) -> int | None:
    given = getattr(request, "max_completion_tokens", None)
    return given if given is not None else getattr(request, "max_tokens", None)


def _wrap_render(
    original: Callable[..., Any],
    engine_inputs: Callable[[Any], list[Any] | None],
    max_tokens: Callable[[Any], int | None],
) -> Callable[..., Any]:
    """Validate and refuse a plan once the prompt is rendered, before any response starts."""

    @functools.wraps(original)
    async def render(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        result = await original(self, request, *args, **kwargs)
        extra = getattr(request, "vllm_xargs", None)
        inputs = engine_inputs(result) if extra else None
        if not inputs:
            return result
        planned = False
        try:
            for engine_input in inputs:
                planned |= parse_plan(
                    extra,
                    prompt_len=int(self._extract_prompt_len(engine_input)),
                    max_tokens=max_tokens(request),
                    max_len=max_positions(self.model_config),
                ) is not None
        except PlanError as error:
            return self.create_error_response(f"{INVALID_PLAN}: {error}", param="vllm_xargs")
        engine_client = getattr(self, "engine_client", None)
        vllm_config = getattr(engine_client, "vllm_config", None)
        refusal = plan_refusal(vllm_config) if planned and vllm_config is not None else None
        if refusal is not None:
            return self.create_error_response(refusal, param="vllm_xargs")
        refusal = await worker_refusal(engine_client) if planned else None
        if refusal is not None:
            return self.create_error_response(refusal, err_type="ServiceUnavailableError",
                                              status_code=HTTPStatus.SERVICE_UNAVAILABLE, param="vllm_xargs")
        return result

    setattr(render, MARK, True)
    return render


# -- the proof in the answer -----------------------------------------------------------------


def _proof(request: Any, prompts: Sequence[Sequence[int] | None]) -> str | None:
    """The proof for a request admitted with a plan (None: no plan, or a prompt without token ids).

    Only called once rendering admitted the request, so the plan is valid."""
    extra = getattr(request, "vllm_xargs", None)
    if not extra or POSITIONS_KEY not in extra or any(ids is None for ids in prompts):
        return None
    return plan_proof([list(ids or ()) for ids in prompts], extra[POSITIONS_KEY], extra[NEXT_POSITION_KEY])


async def _with_proof(stream: AsyncGenerator[str, None], proof: str) -> AsyncGenerator[str, None]:
    """``stream``'s server-sent events with the proof as the first field of each JSON object."""
    head = f'data: {{"{PROOF_FIELD}":"{proof}",'
    try:
        async for chunk in stream:
            yield head + chunk[7:] if chunk.startswith('data: {"') else chunk
    finally:
        await stream.aclose()


def _wrap_stream_generator(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def completion_stream_generator(self: Any, request: Any, engine_inputs: Any, *args: Any, **kwargs: Any) -> Any:
        stream = original(self, request, engine_inputs, *args, **kwargs)
        prompts = [self._extract_prompt_components(e).token_ids for e in engine_inputs]
        proof = _proof(request, prompts)
        return stream if proof is None else _with_proof(stream, proof)

    setattr(completion_stream_generator, MARK, True)
    return completion_stream_generator


def _wrap_completion_response(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def request_output_to_completion_response(self: Any, final_res_batch: Any, request: Any, *args: Any,
                                              **kwargs: Any) -> Any:
        response = original(self, final_res_batch, request, *args, **kwargs)
        proof = _proof(request, [getattr(r, "prompt_token_ids", None) for r in final_res_batch])
        if proof is not None:
            setattr(response, PROOF_FIELD, proof)  # an extra field: vLLM's response models allow them
        return response

    setattr(request_output_to_completion_response, MARK, True)
    return request_output_to_completion_response


def _patch_serving(module: ModuleType) -> None:
    cls = module.OpenAIServingCompletion
    wrappers = {
        "render_completion_request": lambda f: _wrap_render(f, _completion_inputs, _completion_max_tokens),
        "completion_stream_generator": _wrap_stream_generator,
        "request_output_to_completion_response": _wrap_completion_response,
    }
    for name, wrap in wrappers.items():
        if not getattr(getattr(cls, name), MARK, False):
            setattr(cls, name, wrap(getattr(cls, name)))


def _patch_chat_serving(module: ModuleType) -> None:
    cls = module.OpenAIServingChat
    if not getattr(cls.render_chat_request, MARK, False):
        cls.render_chat_request = _wrap_render(cls.render_chat_request, _chat_inputs, _chat_max_tokens)


# -- paths that drop extra_args --------------------------------------------------------------

BEAM_SEARCH_REFUSAL = (
    "SpecPrefill plans are not supported with beam search (use_beam_search): vLLM's beam search runs every step "
    "as a new request whose sampling parameters carry no vllm_xargs, so the plan would be dropped and the prompt "
    "prefilled at contiguous positions. Send the plan without use_beam_search"
)
# Request models with ``vllm_xargs`` whose ``to_beam_search_params`` builds ``BeamSearchParams``
# (no ``extra_args``): module → class names. vLLM 0.32: completions, chat (the Anthropic
# messages endpoint builds a chat request without beam search), transcription and translation.
REQUEST_MODELS: dict[str, tuple[str, ...]] = {
    "vllm.entrypoints.openai.completion.protocol": ("CompletionRequest",),
    "vllm.entrypoints.openai.chat_completion.protocol": ("ChatCompletionRequest",),
    "vllm.entrypoints.speech_to_text.transcription.protocol": ("TranscriptionRequest",),
    "vllm.entrypoints.speech_to_text.translation.protocol": ("TranslationRequest",),
}


def _wrap_to_beam_search_params(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def to_beam_search_params(self: Any, *args: Any, **kwargs: Any) -> Any:
        if has_plan(getattr(self, "vllm_xargs", None)):
            raise _validation_error(BEAM_SEARCH_REFUSAL)
        return original(self, *args, **kwargs)

    setattr(to_beam_search_params, MARK, True)
    return to_beam_search_params


def _patch_request_models(module: ModuleType) -> None:
    for name in REQUEST_MODELS.get(module.__name__, ()):
        cls = getattr(module, name, None)
        original = getattr(cls, "to_beam_search_params", None)  # absent: no beam search, nothing dropped
        if cls is not None and original is not None and not getattr(original, MARK, False):
            cls.to_beam_search_params = _wrap_to_beam_search_params(original)


# vLLM module → the patch applied to it once vLLM imports it (``vllm_plugin.apply_patches``).
PATCHES: dict[str, Callable[[ModuleType], None]] = {
    INPUT_PROCESSOR_MODULE: _patch_input_processor,
    SERVING_MODULE: _patch_serving,
    CHAT_SERVING_MODULE: _patch_chat_serving,
    **{module: _patch_request_models for module in REQUEST_MODELS},
}
