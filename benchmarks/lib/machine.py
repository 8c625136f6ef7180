"""Machine facts and run settings a results file records: the machine, the command, each
model's dtype, a draft config with nothing reused between repetitions."""

from __future__ import annotations

import os
import platform
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from specprefill_rag.loading import cpu_runs_bf16, resolve_dtype

__all__ = [
    "add_dtype_arg",
    "best_dtype",
    "cold",
    "command_line",
    "dtype_name",
    "machine_info",
    "model_dtype_name",
    "model_dtypes",
    "resolved_dtype",
    "served_dtype",
]


def offline(threads: int | None = None) -> None:
    """Set the process up as every bench runs: the model hub offline, tokenizers single-threaded
    (the benches fork), and ``threads`` torch CPU threads (None or 0: torch's choice)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if threads:
        torch.set_num_threads(threads)


def cold(draft: Any) -> Any:
    """``draft`` (a DraftConfig) with nothing reused between requests: no score memo, no prefix
    store. What the timing benchmarks measure, whose repetitions send the same prompt again."""
    import dataclasses

    return dataclasses.replace(draft, memo_entries=0, prefix_cache_entries=0)


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as results rows record it: "float32", "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def model_dtype_name(model: torch.nn.Module) -> str:
    """The dtype a model's weights are in, as results rows record it."""
    return dtype_name(next(model.parameters()).dtype)


def resolved_dtype(dtype: str, device: str = "auto") -> str:
    """``--dtype`` as a model on ``device`` runs in it (``loading.resolve_dtype``), as rows record it."""
    return dtype_name(resolve_dtype(dtype, device))


def best_dtype(device: str = "auto") -> str:
    """The fastest precision ``device`` offers here, what ``--dtype auto`` gives both models: a
    TTFT file records it so that the report can tell a baseline that ran slower than the machine
    allows (the baseline is the main model at its best: docs/configuration.md, ``SpecPrefillEngine``)."""
    return resolved_dtype("auto", device)


def served_dtype(server: Any) -> str | None:
    """The dtype a vLLM server started here (``VLLMServer`` with a ``log_path``) runs its model
    in, as vLLM logs its engine config ("dtype=torch.bfloat16"); else what it was asked for
    (``VLLMServer.dtype``; None where vLLM chose on a GPU and its log is not kept)."""
    log = getattr(server, "log_path", None)
    try:
        found = re.search(r"\bdtype=torch\.(\w+)", Path(log).read_text(errors="replace")) if log else None
    except OSError:
        found = None
    return found.group(1) if found else getattr(server, "dtype", None)


def add_dtype_arg(parser: Any, *, whose: str = "the main model and the draft") -> None:
    """``--dtype``: one precision for ``whose`` (auto: the fastest the device offers)."""
    from specprefill_rag.loading import DTYPES

    parser.add_argument(
        "--dtype", default="auto", choices=("auto", *DTYPES),
        help=f"dtype of {whose} (auto: the fastest the device offers, one for both: bfloat16 on a GPU and on a "
        "CPU that multiplies bf16 natively, else float32); result files record each side's (%(default)s)",
    )


def model_dtypes(engine: Any) -> dict[str, str]:
    """The dtypes the main model and the draft ran in, as result files record them (a served
    main model has no weights here: only the draft's)."""
    models = {"main": getattr(engine.backend, "model", None), "draft": getattr(engine.draft, "model", None)}
    return {role: model_dtype_name(m) for role, m in models.items() if m is not None}


def command_line(argv: Sequence[str] | None, module: str) -> str:
    """The command that reproduces a run, as a user would type it."""
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join(["specprefill-rag bench", module, *map(shlex.quote, args)])


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        # Whether bf16 is this CPU's fastest precision (``loading.cpu_runs_bf16``): the report refuses
        # to headline an fp32 baseline measured where bf16 ran faster.
        "cpu_native_bf16": cpu_runs_bf16(),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    try:
        import psutil

        info["ram_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
        # The 1/5/15-minute load averages when the results are written (the suites call this at
        # the end of a run): how busy the machine was during the last of it.
        info["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    except (ImportError, OSError):  # pragma: no cover
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:  # pragma: no cover
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_bf16"] = torch.cuda.is_bf16_supported()
    return info
