"""The vLLM functions the plugin wraps, each applied when vLLM imports its module.

- ``runner``: ``GPUModelRunner._prepare_inputs`` (the CPU runner inherits it) rewrites planned
  requests' positions each step; ``SpecPrefillWorkerExtension`` registers and checks workers.
- ``admission``: ``InputProcessor.process_inputs`` and the completion / chat renderers validate
  plans, refuse those the engine cannot honour, and salt the prefix cache.

This module applies them (``apply_patches``) and re-exports their public names. Only these three
modules touch vLLM internals; ``specprefill_rag.wire`` holds the rules.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from .admission import (
    CHAT_SERVING_MODULE,
    INPUT_PROCESSOR_MODULE,
    POSITION_DEPENDENT_ARCHITECTURES,
    SERVING_MODULE,
    _patch_chat_serving,
    _patch_input_processor,
    _patch_serving,
    max_positions,
    plan_refusal,
)
from .runner import (
    RUNNER_MODULE,
    WORKER_EXTENSION,
    SpecPrefillWorkerExtension,
    _patch_runner,
    planned_offsets,
    remap_positions,
    runner_patched,
)

__all__ = [
    "POSITION_DEPENDENT_ARCHITECTURES",
    "WORKER_EXTENSION",
    "SpecPrefillWorkerExtension",
    "apply_patches",
    "max_positions",
    "plan_refusal",
    "planned_offsets",
    "remap_positions",
    "runner_patched",
]


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


_PATCHES: dict[str, Callable[[ModuleType], None]] = {
    RUNNER_MODULE: _patch_runner,
    INPUT_PROCESSOR_MODULE: _patch_input_processor,
    SERVING_MODULE: _patch_serving,
    CHAT_SERVING_MODULE: _patch_chat_serving,
}


def apply_patches() -> None:
    """Patch the modules vLLM already imported; patch the others as they get imported."""
    pending = {}
    for name, patch in _PATCHES.items():
        module = sys.modules.get(name)
        if module is not None:
            patch(module)
        else:
            pending[name] = patch
    if pending and not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder(pending))
