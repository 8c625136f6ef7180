"""Single timed measurements of ``bench ttft`` (and ``bench lookahead_cost``): a plain prefill, a
draft prefill with its capture hooks and no look-ahead, a scoring call; each synchronised on a
GPU, so the time is the device's too.
"""

from __future__ import annotations

import time
from typing import Any

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def plain_forward_s(model: Any, ids: torch.Tensor) -> float:
    """Seconds of one plain prefill (KV cache on, last logits only): what a server would run."""
    device = next(model.parameters()).device
    ids = ids.to(device).reshape(1, -1)
    _sync(device)
    start = time.perf_counter()
    model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1)
    _sync(device)
    return time.perf_counter() - start


def capture_only_s(draft: Any, ids: torch.Tensor) -> float:
    """Seconds of a draft prefill with capture on and no look-ahead (the hooks' own cost)."""
    from specprefill_rag.draft.probe import LookaheadSpec

    _sync(draft.device)
    start = time.perf_counter()
    draft.capture(ids, spec=LookaheadSpec(lookahead=1))
    _sync(draft.device)
    return time.perf_counter() - start


def scoring_s(engine: Any, prompt: Any, config: Any) -> float:
    """Seconds the draft takes to score ``prompt`` with ``config`` (a look-ahead variant)."""
    device = engine.draft.device
    _sync(device)
    start = time.perf_counter()
    engine.score(prompt, draft=config)
    _sync(device)
    return time.perf_counter() - start


def generation_config() -> Any:
    from specprefill_rag import GenerationConfig

    return GenerationConfig(max_new_tokens=1)
