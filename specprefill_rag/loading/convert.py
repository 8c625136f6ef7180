"""GGUF → HF directory: dequantise to fp32, save, and check that the saved model reloads equal."""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>")  # extra eos ids, if in vocab
_LOGIT_ATOL = 1e-4  # converted vs GGUF-loaded model, max |Δ logit|


def _convert_gguf(gguf: Path, out_dir: Path, *, progress: bool) -> None:
    """Dequantise `gguf` to fp32 and write an HF directory into `out_dir`; verify it reloads equal."""
    start = time.perf_counter()
    logger.info("converting %s (dequantising to fp32; takes a while)", gguf)
    with _gguf_loading(progress):
        diff = _write_hf_dir(gguf, out_dir)
    logger.info("converted %s in %.1f s (max |Δ logit| %.1e)", gguf.name, time.perf_counter() - start, diff)


def _write_hf_dir(gguf: Path, out_dir: Path) -> float:
    """Load `gguf`, save it as an HF directory, reload that; the max |Δ logit| between the two.

    Call inside `_gguf_loading`.
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),  # plain fp32 weights, never packed
        local_files_only=True,
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    probe = torch.tensor([[i % model.config.vocab_size for i in range(1, 17)]])  # (1, 16)
    with torch.no_grad():
        reference = model(probe).logits  # (1, 16, vocab)

    save_file(_unique_state_dict(model), out_dir / "model.safetensors", metadata={"format": "pt"})
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.dtype = torch.float32
    config.save_pretrained(out_dir)
    _generation_config(model, tokenizer).save_pretrained(out_dir)
    tokenizer.model_max_length = config.max_position_embeddings  # the GGUF states no limit
    for key in ("local_files_only", "is_local"):  # how we loaded it, not part of the tokenizer
        tokenizer.init_kwargs.pop(key, None)
    tokenizer.save_pretrained(out_dir)
    del model
    gc.collect()

    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        diff = (reloaded(probe).logits - reference).abs().max().item()
    if diff > _LOGIT_ATOL:
        raise RuntimeError(f"converted {gguf.name} does not reproduce its logits (max |diff| {diff:.3g})")
    if AutoTokenizer.from_pretrained(out_dir, local_files_only=True).chat_template != tokenizer.chat_template:
        raise RuntimeError(f"converted {gguf.name}: the chat template did not survive saving")
    if not tokenizer.chat_template:
        logger.warning("%s carries no chat template", gguf.name)
    return diff


@contextlib.contextmanager
def _gguf_loading(progress: bool) -> Iterator[None]:
    """Silence transformers' de-quantising progress bar when ``progress`` is False."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    saved_tqdm, bars_on = gguf_utils.tqdm, hf_logging.is_progress_bar_enabled()
    if not progress:
        gguf_utils.tqdm = functools.partial(tqdm, disable=True)
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        gguf_utils.tqdm = saved_tqdm
        if bars_on:
            hf_logging.enable_progress_bar()


def _unique_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with each shared tensor once (tied lm_head goes; transformers re-ties it)."""
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            logger.debug("not writing %s: same tensor as %s", name, seen[key])
            continue
        seen[key] = name
        tensors[name] = tensor.contiguous()
    return tensors


def _generation_config(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> GenerationConfig:
    """Greedy-by-default generation config whose eos ids include the chat turn-end tokens."""
    from transformers import GenerationConfig

    eos: list[int] = []
    candidates: list[object] = [tokenizer.eos_token_id, model.config.eos_token_id]
    candidates += [tokenizer.convert_tokens_to_ids(t) for t in _STOP_TOKENS if t in tokenizer.get_vocab()]
    for item in candidates:
        for token_id in item if isinstance(item, list) else [item]:
            if isinstance(token_id, int) and token_id not in eos:
                eos.append(token_id)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else None)
    return GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos or None, pad_token_id=pad)
