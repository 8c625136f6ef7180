"""Where a model runs: the device and the dtype ``"auto"`` resolves to, one rule for every model."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch

from ..errors import ConfigError

__all__ = ["DTYPES", "cpu_runs_bf16", "resolve_device", "resolve_dtype"]

# Names a dtype may be given by (the CLI's --dtype, config files); torch.dtype values pass as they are.
DTYPES: Mapping[str, torch.dtype] = MappingProxyType({
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
})


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``"auto"``: the first CUDA device when torch sees one, else the CPU; anything else is
    read as torch reads it (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``). ``ConfigError`` for a
    name torch does not know, or for CUDA asked of a torch that has none."""
    if isinstance(device, torch.device):
        resolved = device
    elif device == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    else:
        try:
            resolved = torch.device(device)
        except (RuntimeError, TypeError) as error:
            raise ConfigError(
                f"device {device!r} is not a device torch knows ('auto', 'cpu', 'cuda', 'cuda:1', ...)"
            ) from error
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {str(device)!r}: this torch sees no CUDA device (use 'auto' or 'cpu')")
    return resolved


def resolve_dtype(dtype: str | torch.dtype = "auto", device: str | torch.device = "auto") -> torch.dtype:
    """``"auto"``: the fastest precision ``device`` offers, one for the draft and the main model
    alike: bfloat16 on a CUDA device that supports it (float16 on one that does not), bfloat16 on
    a CPU that multiplies it natively (``cpu_runs_bf16``: AVX512-BF16 or AMX), float32 elsewhere.
    A name of ``DTYPES`` or a ``torch.dtype`` is taken as given.

    One rule for both models, so that a speedup is measured against the main model at its best
    (docs/configuration.md, ``SpecPrefillEngine``): on the 2-core AVX512-BF16 EPYC the main model
    runs ~4.8x faster in bf16 than in fp32, and the Qwen 0.5B draft scored 2k-token prompts 2.8x
    faster with the same evidence kept (docs/benchmarks.md).
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        place = resolve_device(device)
        if place.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if place.type == "cpu" and cpu_runs_bf16() else torch.float32
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one of 'auto', {', '.join(repr(d) for d in DTYPES)}")
    return DTYPES[dtype]


def cpu_runs_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices natively (AVX512-BF16 or AMX), where torch's
    oneDNN bf16 products outrun fp32 ones; False where torch cannot tell."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)
