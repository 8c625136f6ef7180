"""Main model on transformers: exact position ids, CPU or GPU.

Prefill feeds the kept tokens with ``position_ids`` = their original positions; the KV cache
stays contiguous and only RoPE sees the original positions. Decoding continues at
``plan.next_position``.

Gaps in ``position_ids`` must never reach transformers' mask code without a cache: with no
``past_key_values`` and no 2-D mask, ``masking_utils`` reads gaps as packed sequences (a
block-diagonal mask, silently wrong logits). Every forward here passes a cache (a new
``DynamicCache`` for a prefill), and for the attention implementations in ``MASK_FREE`` no
mask at all: transformers then neither reads the positions nor builds a mask, and SDPA runs
``is_causal`` (prefill) or unmasked (decode), the same kernel call as with the all-ones mask
this backend used to pass, minus that mask's kernels and the host synchronisation its
all-ones test cost per forward. Other implementations (flash attention reads ``position_ids``
for packed sequences when it has no mask) keep the explicit all-ones mask. Inputs reach a CUDA
device from pinned memory without blocking; a prefill waits for the device nowhere (tested:
no host synchronisation inside ``prefill``; the first token's ``int()`` is the first).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch

from ..config import DraftConfig, GenerationConfig
from ..draft import CAPTURE_ATTENTION, DraftModel
from ..grammar import GrammarMatcher
from ..loading import eos_ids
from ..types import PrefillPlan
from .base import BackendCapabilities, ModelIdentity, check_window, max_new_tokens

__all__ = ["MASK_FREE", "PrefillState", "TransformersBackend", "sample_token", "to_device"]

# Attention implementations that prefill and decode with no mask at non-contiguous positions
# (checked in transformers' masking_utils, tested against a reference): given a cache, the mask
# code skips packed-sequence detection; SDPA then gets None (``is_causal`` for a prefill) and
# eager a causal mask built from the cache's sizes. The draft's capture wrapper is SDPA outside
# a capture (a self-drafting main model runs on it).
MASK_FREE = frozenset({"sdpa", "eager", CAPTURE_ATTENTION})


@dataclass
class PrefillState:
    """KV cache and next-token logits after a prefill or a decode step."""

    logits: torch.Tensor  # (vocab,) float32, for the next token
    cache: Any  # transformers Cache
    n_cached: int  # tokens in the cache
    next_position: int  # position id of the next token fed


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``; a CPU tensor reaches a CUDA device through pinned memory without
    blocking (a pageable copy would wait for every kernel queued before it)."""
    if tensor.device == device:
        return tensor
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def sample_token(logits: torch.Tensor, generation: GenerationConfig, generator: torch.Generator | None) -> int:
    """Greedy when ``generation.greedy`` (temperature below ``GREEDY_BELOW``), else temperature /
    top-k / top-p sampling."""
    if generation.greedy:
        return int(logits.argmax())
    logits = logits.float() / generation.temperature
    if generation.top_k:
        kth = torch.topk(logits, min(generation.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if generation.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Drop tokens once the mass before them already reaches top_p, always keeping the first: a
        # top_p below float32's smallest number (1e-300 is valid JSON and > 0) compares as 0 here.
        drop = sorted_probs.cumsum(0) - sorted_probs >= generation.top_p
        drop[0] = False
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


class TransformersBackend(ModelIdentity):
    """A transformers causal LM serving prefill plans in-process (and ``SelfDrafting``)."""

    name = "transformers"
    capabilities = BackendCapabilities(exact_positions=True, grammar=True)

    def __init__(self, model: Any, tokenizer: Any, *, name: str | None = None) -> None:
        self.model = model.eval()
        self._tokenizer = tokenizer
        self._name = name or str(getattr(model.config, "_name_or_path", "") or type(model).__name__)
        self._max_context = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        generation_config = getattr(model, "generation_config", None)
        self.eos_token_ids = eos_ids(getattr(generation_config, "eos_token_id", None), tokenizer)

    @classmethod
    def from_pretrained(
        cls, name_or_path: str, *, dtype: str | torch.dtype = "auto", device: str | torch.device = "auto"
    ) -> TransformersBackend:
        """Load the main model by packaged short name, HF directory or GGUF path; ``"auto"``: the
        device and precision ``loading.load_model`` chooses (CUDA + bfloat16 when torch sees a GPU)."""
        from ..loading import load_model

        model, tokenizer = load_model(name_or_path, dtype=dtype, device=device)
        return cls(model, tokenizer, name=str(name_or_path))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def as_draft(self, config: DraftConfig) -> DraftModel:
        """This model as its own draft (``SelfDrafting``): the capture is inert outside scoring."""
        return DraftModel(self.model, self.tokenizer, config)

    @property
    def mask_free(self) -> bool:
        """Whether forwards pass no attention mask (``MASK_FREE``); read per call, since a
        self-drafting main model is switched to the draft's capture wrapper later."""
        config = getattr(self.model.config, "text_config", None) or self.model.config
        return getattr(config, "_attn_implementation", None) in MASK_FREE

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: Any, n_cached: int) -> Any:
        """ids, positions (1, n_new) on the device; ``cache`` holds ``n_cached`` tokens (None: a
        prefill, into a new cache). Never without a cache: see the module's docstring."""
        if cache is None:
            from transformers import DynamicCache

            cache = DynamicCache(config=self.model.config)
        mask = None
        if not self.mask_free:
            mask = torch.ones(1, n_cached + ids.shape[1], dtype=torch.int64, device=ids.device)
        return self.model(input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=cache,
                          use_cache=True, logits_to_keep=1)

    @torch.inference_mode()
    def prefill(self, plan: PrefillPlan) -> PrefillState:
        """Run the main model over the plan's kept tokens at the plan's positions."""
        check_window(plan, self.max_context)
        device = self.device
        ids = to_device(plan.token_ids.reshape(1, -1), device)
        positions = to_device(plan.position_ids.reshape(1, -1), device)
        out = self._forward(ids, positions, None, 0)
        return PrefillState(out.logits[0, -1].float(), out.past_key_values, plan.n_kept, plan.next_position)

    @torch.inference_mode()
    def decode_step(self, state: PrefillState, token_id: int) -> PrefillState:
        """Feed one token at ``state.next_position``; returns the state after it."""
        device = self.device  # filled on the device: no host-to-device copy
        ids = torch.full((1, 1), token_id, dtype=torch.int64, device=device)
        positions = torch.full((1, 1), state.next_position, dtype=torch.int64, device=device)
        out = self._forward(ids, positions, state.cache, state.n_cached)
        return PrefillState(out.logits[0, -1].float(), out.past_key_values, state.n_cached + 1, state.next_position + 1)

    def stream_tokens(self, plan: PrefillPlan, generation: GenerationConfig) -> Generator[int, None, None]:
        generator = None
        if not generation.greedy and generation.seed is not None:
            generator = torch.Generator().manual_seed(generation.seed)
        max_new = max_new_tokens(plan, generation, self.max_context)
        state = self.prefill(plan)
        matcher = None
        if generation.grammar is not None:
            matcher = GrammarMatcher(generation.grammar, self.tokenizer, state.logits.shape[-1], self.eos_token_ids,
                                     namespace=generation.cache_salt)  # compiled by the engine's check
        for step in range(max_new):
            logits = state.logits if matcher is None else matcher.mask(state.logits)
            token = sample_token(logits, generation, generator)
            if token in self.eos_token_ids:
                return
            yield token
            if matcher is not None:
                matcher.accept(token)
                if matcher.done:
                    return
            if step + 1 < max_new:
                state = self.decode_step(state, token)
