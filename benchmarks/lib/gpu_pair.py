"""The draft → main pairs ``gpu_ttft`` (and ``draft_batch``) time: their published shapes built
with random weights directly on the device, the synthetic RAG prompt they read, and a pair built
behind the library's classes (``Context``) with what it computes in (``precision``).
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.lib.gpu_timing import TimedPrompt, full_prefill_s, plan_of, pruned_ttft
from benchmarks.lib.lookahead import lookahead_variants
from benchmarks.lib.machine import cold, dtype_name

# Published shapes (config.json of meta-llama/Llama-3.2-1B and Llama-3.1-8B).
LLAMA_3_2_1B: dict[str, Any] = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
    head_dim=64, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)
LLAMA_3_1_8B: dict[str, Any] = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, vocab_size=128256, tie_word_embeddings=False, max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)
# Published shapes (config.json of Qwen/Qwen2.5-0.5B-Instruct and Qwen2.5-32B-Instruct; q/k/v
# projections with biases, as in every Qwen2).
QWEN2_5_0_5B: dict[str, Any] = dict(
    hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
    vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768, rms_norm_eps=1e-6,
    use_sliding_window=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)
QWEN2_5_32B: dict[str, Any] = dict(
    hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
    vocab_size=152064, tie_word_embeddings=False, max_position_embeddings=32768, rms_norm_eps=1e-6,
    use_sliding_window=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)
TINY_DRAFT: dict[str, Any] = dict(  # 8 layers: its early exit sits below its last, so it reads passages apart
    hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=512, tie_word_embeddings=True, max_position_embeddings=8192,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
TINY_MAIN: dict[str, Any] = dict(TINY_DRAFT, hidden_size=128, intermediate_size=256, num_hidden_layers=4, head_dim=32)


@dataclass(frozen=True)
class Pair:
    """A draft → main pair: model family and the two shapes."""

    key: str
    draft_name: str
    main_name: str
    family: str  # "llama" or "qwen2"
    draft: dict[str, Any]
    main: dict[str, Any]
    extras: bool  # also the earlier runs' measurements (look-ahead variants, concurrency, ...)


PAIRS = (
    Pair("llama-1b-8b", "Llama-3.2-1B-shaped (random bf16)", "Llama-3.1-8B-shaped (random bf16)", "llama",
         LLAMA_3_2_1B, LLAMA_3_1_8B, extras=True),
    Pair("qwen-0.5b-32b", "Qwen2.5-0.5B-shaped (random bf16)", "Qwen2.5-32B-shaped (random bf16)", "qwen2",
         QWEN2_5_0_5B, QWEN2_5_32B, extras=False),
)
TINY_PAIRS = (
    Pair("llama-1b-8b", "tiny-llama (random)", "tiny-llama (random)", "llama", TINY_DRAFT, TINY_MAIN, extras=True),
    Pair("qwen-0.5b-32b", "tiny-qwen2 (random)", "tiny-qwen2 (random)", "qwen2",
         dict(TINY_DRAFT, head_dim=16), dict(TINY_MAIN, head_dim=32), extras=False),
)

INSTRUCTION_TOKENS = 32  # protected head of the prompt (system instructions)
QUESTION_TOKENS = 64  # protected tail (question + generation prompt)
PASSAGE_TOKENS = 512  # passage size; chunks never cross a passage boundary
HEADROOM = 256  # positions left after the prompt (look-ahead, answer) where a window caps a length


def build(family: str, shape: dict[str, Any], dtype: torch.dtype, device: str, seed: int) -> Any:
    """A causal LM of ``family`` with ``shape`` and random weights, built directly on ``device``
    in ``dtype`` (no float32 copy: a 32B model's bf16 weights alone fill most of one GPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    config_class, model_class = classes[family]
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_class._from_config(config_class(**shape), dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def synthetic_prompt(n: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token ids, protected mask, segment index) shaped like an assembled RAG prompt."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n,), generator=g)
    protected = torch.zeros(n, dtype=torch.bool)
    protected[:INSTRUCTION_TOKENS] = True
    protected[-QUESTION_TOKENS:] = True
    segment = torch.arange(n) // PASSAGE_TOKENS + 1
    segment[:INSTRUCTION_TOKENS] = 0
    segment[-QUESTION_TOKENS:] = int(segment.max()) + 1
    return ids, protected, segment


@dataclass
class Context:
    """One pair, built: the main model behind the library's backend, the draft, its plain-forward
    backend (the draft's weights served like the main model, for r) and the vocabulary."""

    pair: Pair
    main: Any  # TransformersBackend
    draft: Any  # DraftModel
    draft_plain: Any  # TransformersBackend over the draft's weights
    vocab: int
    window: int  # the longest prompt both models take, with HEADROOM positions after it

    @property
    def device(self) -> torch.device:
        return self.draft.device


def spec_ttft(ctx: Context, ids: torch.Tensor, protected: torch.Tensor, segment: torch.Tensor, keep: float,
              config: Any = None) -> dict[str, Any]:
    """SpecPrefill's TTFT at ``keep`` with the draft's config (or ``config``), phase by phase;
    nothing read from a store (repetitions send the same prompt)."""
    n = ids.numel()
    prompt = TimedPrompt(ids, protected, segment, torch.arange(n - QUESTION_TOKENS, n))
    return pruned_ttft(ctx.draft, ctx.main, prompt, keep, cold(config or ctx.draft.config))


def scoring_s(draft: Any, ids: torch.Tensor, protected: torch.Tensor, config: Any) -> float:
    """Seconds of the draft's scoring with ``config`` (a look-ahead variant)."""
    n = ids.numel()
    start = time.perf_counter()
    draft.score(ids, question=torch.arange(n - QUESTION_TOKENS, n), context=~protected, config=cold(config))
    return time.perf_counter() - start  # .cpu() at the end of scoring synchronises


def build_pair(pair: Pair, args: argparse.Namespace, device: str, dtype: torch.dtype) -> Context:
    """The pair on ``device`` in ``dtype`` behind the library's classes, warmed up."""
    from specprefill_rag import DraftConfig
    from specprefill_rag.backends.transformers import TransformersBackend
    from specprefill_rag.draft import DraftModel

    print(f"[{pair.key}] building {pair.draft_name} → {pair.main_name} on {device} ...", flush=True)
    main = TransformersBackend(build(pair.family, pair.main, dtype, device, seed=1), None, name=pair.main_name)
    config = DraftConfig() if args.lookahead is None else DraftConfig(lookahead=args.lookahead)
    draft = DraftModel(build(pair.family, pair.draft, dtype, device, seed=2), None, config)
    window = min(draft.max_context, main.max_context) - HEADROOM
    ctx = Context(pair, main, draft, TransformersBackend(draft.model, None, name=pair.draft_name),
                  min(int(pair.draft["vocab_size"]), int(pair.main["vocab_size"])), window)
    n = min(min(args.lengths), window)
    ids, protected, segment = synthetic_prompt(n, ctx.vocab, seed=0)
    full_prefill_s(ctx.main, ids)
    spec_ttft(ctx, ids, protected, segment, args.keep_rates[0])
    full_prefill_s(ctx.draft_plain, ids)
    if pair.extras and args.extras:
        for variant in lookahead_variants(ctx.device.type).values():  # kernels chosen before timing
            scoring_s(draft, ids, protected, variant)
    return ctx


def precision(ctx: Context) -> dict[str, Any]:
    """Every dtype the run computes in: weights, KV caches, the scoring's softmax, TF32, SDPA's
    kernels allowed."""
    state = ctx.main.prefill(plan_of(torch.zeros(8, dtype=torch.int64), torch.arange(8), 8))
    out: dict[str, Any] = {
        "main_weights": dtype_name(next(ctx.main.model.parameters()).dtype),
        "draft_weights": dtype_name(next(ctx.draft.model.parameters()).dtype),
        "main_kv_cache": dtype_name(state.cache.layers[0].keys.dtype),
        "main_logits": dtype_name(state.logits.dtype),
        "scoring": "float32 (the library's logits and softmax)",
        "attention": ctx.main.model.config._attn_implementation,
        "draft_attention": ctx.draft.model.config._attn_implementation,
    }
    if ctx.device.type == "cuda":
        out["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
        out["sdpa_backends"] = {"flash": torch.backends.cuda.flash_sdp_enabled(),
                                "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                                "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
                                "math": torch.backends.cuda.math_sdp_enabled()}
    return out


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()
