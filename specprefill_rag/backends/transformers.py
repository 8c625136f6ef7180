"""Main model on transformers: exact position ids, CPU or GPU.

Prefill feeds the kept tokens with ``position_ids`` = their original positions and an explicit
all-ones attention mask (without it, gaps in ``position_ids`` can be read as packed
sequences). The KV cache stays contiguous; only RoPE sees the original positions. Decoding
continues at ``plan.next_position``.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch

from ..config import DraftConfig, GenerationConfig
from ..draft import DraftModel
from ..loading import eos_ids
from ..types import PrefillPlan
from .base import BackendCapabilities, ModelIdentity, check_window, max_new_tokens

__all__ = ["PrefillState", "TransformersBackend", "sample_token"]


@dataclass
class PrefillState:
    """KV cache and next-token logits after a prefill or a decode step."""

    logits: torch.Tensor  # (vocab,) float32, for the next token
    cache: Any  # transformers Cache
    n_cached: int  # tokens in the cache
    next_position: int  # position id of the next token fed


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
        # Drop tokens once the mass before them already reaches top_p (always keep the first).
        drop = sorted_probs.cumsum(0) - sorted_probs >= generation.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


class TransformersBackend(ModelIdentity):
    """A transformers causal LM serving prefill plans in-process (and ``SelfDrafting``)."""

    name = "transformers"
    capabilities = BackendCapabilities(exact_positions=True)

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
        """Load the main model by packaged short name, HF directory or GGUF path; ``"auto"``:
        CUDA + bfloat16 when torch sees a GPU, else CPU + float32 (``loading.resolve_device``)."""
        from ..loading import load_model

        model, tokenizer = load_model(name_or_path, dtype=dtype, device=device)
        return cls(model, tokenizer, name=str(name_or_path))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def as_draft(self, config: DraftConfig) -> DraftModel:
        """This model as its own draft (``SelfDrafting``): the capture is inert outside scoring."""
        return DraftModel(self.model, self.tokenizer, config)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: Any, n_cached: int) -> Any:
        n_new = ids.numel()
        return self.model(
            input_ids=ids.to(self.device).reshape(1, n_new),
            position_ids=positions.to(self.device).reshape(1, n_new),
            attention_mask=torch.ones(1, n_cached + n_new, dtype=torch.int64, device=self.device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )

    @torch.inference_mode()
    def prefill(self, plan: PrefillPlan) -> PrefillState:
        """Run the main model over the plan's kept tokens at the plan's positions."""
        check_window(plan, self.max_context)
        out = self._forward(plan.token_ids, plan.position_ids, None, 0)
        return PrefillState(out.logits[0, -1].float(), out.past_key_values, plan.n_kept, plan.next_position)

    @torch.inference_mode()
    def decode_step(self, state: PrefillState, token_id: int) -> PrefillState:
        """Feed one token at ``state.next_position``; returns the state after it."""
        out = self._forward(
            torch.tensor([token_id]), torch.tensor([state.next_position]), state.cache, state.n_cached
        )
        return PrefillState(out.logits[0, -1].float(), out.past_key_values, state.n_cached + 1, state.next_position + 1)

    def stream_tokens(self, plan: PrefillPlan, generation: GenerationConfig) -> Generator[int, None, None]:
        generator = None
        if not generation.greedy and generation.seed is not None:
            generator = torch.Generator().manual_seed(generation.seed)
        max_new = max_new_tokens(plan, generation, self.max_context)
        state = self.prefill(plan)
        for step in range(max_new):
            token = sample_token(state.logits, generation, generator)
            if token in self.eos_token_ids:
                return
            yield token
            if step + 1 < max_new:
                state = self.decode_step(state, token)
