"""Start vLLM's OpenAI-compatible server with the SpecPrefill plugin active.

``specprefill-rag serve MODEL`` (or ``VLLMServer(...)`` from Python) resolves MODEL (packaged
short name, HF directory or .gguf) to an HF directory, then runs
``python -m vllm.entrypoints.openai.api_server`` on it. The plugin loads through the
``vllm.general_plugins`` entry point in every vLLM process, so nothing else is needed. On a
machine without CUDA the CPU settings (eager, 1 GiB KV cache unless set) are added, and the
dtype is the fastest the CPU offers, as for the draft (``server_dtype``: bfloat16 on a CPU that
multiplies it natively, else float32). See docs/vllm.md.
"""

from __future__ import annotations

import http.client
import importlib.metadata
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import IO, Any, Self

from ..backends.vllm_offline import CPU_ENGINE_ARGS, CPU_KV_CACHE_GIB, on_cpu, require_vllm
from ..errors import ConfigError, ServerStartError, UnsupportedVLLMError
from ..types import is_int

__all__ = [
    "LaunchOptions", "ManagedProcess", "VLLMServer", "cpu_binding", "numa_nodes", "parallel_ranks", "plugin_installed",
    "serve", "server_command", "server_dtype", "server_env",
]

logger = logging.getLogger(__name__)

PLUGIN_ENTRY_POINT = "specprefill_rag.vllm_plugin:register"

def plugin_installed() -> bool:
    """True when the ``vllm.general_plugins`` entry point of this package is installed."""
    return any(ep.value == PLUGIN_ENTRY_POINT for ep in importlib.metadata.entry_points(group="vllm.general_plugins"))


def _require_plugin(python: str | None = None) -> None:
    """Raise ``ServerStartError`` unless vLLM would load and apply the plugin (in the environment
    of the interpreter ``python``; default: this one)."""
    if python is not None and os.path.abspath(python) != os.path.abspath(sys.executable):  # venvs share a binary
        code = "from specprefill_rag.tools.vllm_process import _require_plugin; _require_plugin()"
        check = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
        if check.returncode != 0:
            lines = (check.stderr or check.stdout).strip().splitlines()
            raise ServerStartError(f"cannot start vLLM with {python}: {lines[-1] if lines else check.returncode}")
        return
    require_vllm("serving with vLLM")
    if not plugin_installed():
        raise ServerStartError(
            "the specprefill-rag vLLM plugin entry point is not installed in this environment: "
            "reinstall the package (pip install -e '.[vllm]') so vLLM loads it"
        )
    import vllm

    from ..vllm_plugin import check_vllm_version

    try:
        check_vllm_version(vllm.__version__)
    except UnsupportedVLLMError as error:
        raise ServerStartError(str(error)) from error


def cli_flags(args: Mapping[str, Any]) -> list[str]:
    """vLLM command-line flags for engine arguments (``enforce_eager=True`` → ``--enforce-eager``)."""
    flags: list[str] = []
    for name, value in args.items():
        flag = "--" + name.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags


def server_dtype(dtype: str = "auto", *, cpu: bool | None = None) -> str | None:
    """vLLM's ``--dtype`` for a server started here. ``"auto"``: on a machine without CUDA the
    fastest precision its CPU offers, the rule the draft and a transformers main model follow
    (``loading.resolve_dtype``: bfloat16 on a CPU with native bf16, else float32), so that a
    SpecPrefill speedup is measured against the main model at its best; on a GPU None, vLLM's
    own ``auto`` (bfloat16, float16 on a GPU without it, for the float32 checkpoints this package
    converts). Another name of ``loading.DTYPES`` is given as vLLM spells it ("bf16" → "bfloat16")."""
    from ..loading import resolve_dtype

    if dtype != "auto":
        return str(resolve_dtype(dtype)).removeprefix("torch.")
    if on_cpu() if cpu is None else cpu:
        return str(resolve_dtype("auto", "cpu")).removeprefix("torch.")
    return None


@dataclass(frozen=True)
class LaunchOptions:
    """Where and how a managed server process runs: the address it listens on, the interpreter
    it is started with, its environment and its log (``VLLMServer``, ``VLLMRouter``, ``server_command``)."""

    host: str = "127.0.0.1"
    port: int = 8000
    python: str | None = None  # the interpreter of the environment to run in (None: this one)
    env: Mapping[str, str] | None = None  # the environment to start from (None: this process's)
    log_path: str | os.PathLike[str] | None = None  # where stdout and stderr go (None: discarded)

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ConfigError(f"host must be a non-empty string, got {self.host!r}")
        if not is_int(self.port) or not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be an int from 0 to 65535, got {self.port!r}")
        if self.env is not None:
            object.__setattr__(self, "env", MappingProxyType(dict(self.env)))
        if self.log_path is not None:
            object.__setattr__(self, "log_path", Path(self.log_path))


DEFAULT_LAUNCH = LaunchOptions()


def server_command(
    model_dir: str | os.PathLike[str],
    *,
    launch: LaunchOptions = DEFAULT_LAUNCH,
    served_model_name: str | None = None,
    max_model_len: int | None = None,
    extra_args: Sequence[str] = (),
    cpu: bool | None = None,
    dtype: str | None = None,
) -> list[str]:
    """The command line that starts vLLM's OpenAI server on ``model_dir`` (at ``launch.host`` and
    ``launch.port``, with the interpreter ``launch.python``; default: this one). ``dtype``: vLLM's
    ``--dtype`` (``server_dtype`` resolves ``"auto"``); None: on CPU the float32 of
    ``CPU_ENGINE_ARGS``, on a GPU vLLM's own choice. A ``--dtype`` in ``extra_args`` comes later and wins."""
    cmd = [launch.python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
           os.fspath(model_dir), "--host", launch.host, "--port", str(launch.port)]
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    if on_cpu() if cpu is None else cpu:
        cmd += cli_flags({**CPU_ENGINE_ARGS, **({"dtype": dtype} if dtype else {})})
    elif dtype:
        cmd += ["--dtype", dtype]
    return cmd + list(extra_args)


def parallel_ranks(extra_args: Sequence[str]) -> int:
    """Tensor × pipeline parallel ranks asked for on vLLM's command line (1 when not given)."""
    flags = {"--tensor-parallel-size": 0, "-tp": 0, "--pipeline-parallel-size": 1, "-pp": 1}
    sizes = [1, 1]
    args = list(extra_args)
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in flags:
            text = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            if text.isdigit() and int(text) > 0:
                sizes[flags[name]] = int(text)
    return sizes[0] * sizes[1]


def numa_nodes() -> int:
    """NUMA nodes of this machine (1 when the kernel does not say)."""
    return max(1, len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))))


def cpu_binding(ranks: int, cpus: Sequence[int]) -> str | None:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each of ``ranks`` workers its own share of ``cpus``.

    vLLM's automatic binding puts each CPU worker on its own NUMA node and refuses to start
    ("Not enough allowed NUMA nodes") when ranks outnumber nodes, e.g. TP=2 on a one-node
    machine; splitting the allowed CPUs into contiguous groups works there. None when there is
    nothing to split (one rank) or too few CPUs (one per rank at least).
    """
    cpus = sorted(cpus)
    if ranks <= 1 or len(cpus) < ranks:
        return None
    share = len(cpus) // ranks
    return "|".join(",".join(str(c) for c in cpus[r * share:(r + 1) * share]) for r in range(ranks))


def server_env(
    base: Mapping[str, str] | None = None, *, cpu: bool | None = None, extra_args: Sequence[str] = ()
) -> dict[str, str]:
    """Environment for the server: the V1 model runner unless the caller's environment chooses
    (the plugin patches both; V1 is the one run on GPUs), CPU KV space.

    On CPU, when the TP × PP ranks in ``extra_args`` outnumber the NUMA nodes and the caller set
    no binding, each rank is bound to its own share of this process's CPUs (``cpu_binding``).
    """
    env = dict(os.environ if base is None else base)
    env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # the caller may choose V2 (the plugin patches both)
    if on_cpu() if cpu is None else cpu:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(CPU_KV_CACHE_GIB))
        ranks = parallel_ranks(extra_args)
        if "VLLM_CPU_OMP_THREADS_BIND" not in env and ranks > numa_nodes():
            binding = cpu_binding(ranks, sorted(os.sched_getaffinity(0)))
            if binding is not None:
                env["VLLM_CPU_OMP_THREADS_BIND"] = binding
                env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
                logger.info("binding %d vLLM CPU workers to CPUs %s (fewer NUMA nodes than ranks)", ranks, binding)
    return env


class ManagedProcess:
    """A server subprocess on loopback (its own process group): start, wait until ready, stop by PID.

    Subclasses set ``command``, ``env`` and ``what`` (for messages), call ``_init_process`` with
    their ``LaunchOptions`` (``host``, ``port``, ``log_path``) and may override ``_ready``
    (default: ``GET /v1/models`` answers a model list) and ``_preflight``. Use as a context
    manager; ``url`` is the base URL clients connect to.
    """

    what = "server"
    command: list[str]
    env: dict[str, str]
    host: str
    port: int
    log_path: Path | None

    def _init_process(self, launch: LaunchOptions) -> None:
        self.launch = launch
        self.host, self.port = launch.host, launch.port
        self.log_path = Path(launch.log_path) if launch.log_path else None
        self.process: subprocess.Popen[bytes] | None = None
        self.started_s: float | None = None  # seconds from launch to ready
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _preflight(self) -> None:
        """Checks before launching (``ServerStartError``)."""

    def start(self, timeout: float = 600.0) -> Self:
        """Launch and block until ready (``_ready``); raises ``ServerStartError`` otherwise."""
        self._preflight()
        began = time.perf_counter()
        self._log = open(self.log_path, "wb") if self.log_path else None  # noqa: SIM115
        self.process = subprocess.Popen(
            self.command, env=self.env, stdout=self._log or subprocess.DEVNULL, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        logger.info("started %s pid %d: %s", self.what, self.process.pid, " ".join(self.command))
        deadline = began + timeout
        while time.perf_counter() < deadline:
            code = self.process.poll()
            if code is not None:
                self.stop()
                raise ServerStartError(f"{self.what} exited with code {code} during start-up{self._log_hint()}")
            if self._ready():
                self.started_s = time.perf_counter() - began
                return self
            time.sleep(0.5)
        self.stop()
        raise ServerStartError(f"{self.what} not ready after {timeout:.0f} s{self._log_hint()}")

    def _log_hint(self) -> str:
        return f" (log: {self.log_path})" if self.log_path else ""

    def _get(self, path: str) -> tuple[int, bytes] | None:
        """Status and body of ``GET path`` (2 s timeout); None when the process does not answer."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=2.0)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            return response.status, response.read()
        except (OSError, http.client.HTTPException):
            return None
        finally:
            conn.close()

    def _ready(self) -> bool:
        answer = self._get("/v1/models")
        if answer is None or answer[0] != 200:
            return False
        try:
            return bool(json.loads(answer[1]).get("data"))
        except (ValueError, AttributeError):
            return False

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the process group (by PID), SIGKILL after ``timeout`` seconds."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            except ProcessLookupError:
                pass
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Self:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class VLLMServer(ManagedProcess):
    """A vLLM server subprocess on loopback: start, wait until ready, stop by PID.

    Use as a context manager; ``url`` is the base URL for ``VLLMServerBackend``. ``launch``: its
    address, environment and log; ``launch.python`` is the interpreter of the environment vLLM and
    specprefill-rag are installed in, when that is not this one (e.g. a client environment without
    vLLM starting a server from the vLLM one).
    ``dtype``: the main model's (``server_dtype``; ``"auto"`` is bfloat16 on a CPU with native
    bf16); ``self.dtype`` is what vLLM was asked for (None: vLLM's own choice on a GPU). Tests
    that compare the server's tokens with a float32 transformers reference pass ``"float32"``.
    """

    what = "vLLM server"

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        launch: LaunchOptions = DEFAULT_LAUNCH,
        max_model_len: int | None = None,
        extra_args: Sequence[str] = (),
        dtype: str = "auto",
    ) -> None:
        from ..loading import resolve_model_dir

        self.model_dir = resolve_model_dir(model)
        self.python = launch.python
        self.dtype = server_dtype(dtype)
        self.command = server_command(self.model_dir, launch=launch, max_model_len=max_model_len,
                                      extra_args=extra_args, dtype=self.dtype)
        self.env = server_env(launch.env, extra_args=extra_args)
        self._init_process(launch)

    def _preflight(self) -> None:
        _require_plugin(self.python)


def serve(model: str, *, host: str, port: int, max_model_len: int | None, extra_args: Sequence[str],
          dtype: str = "auto") -> int:
    """Run the server in the foreground (the ``serve`` CLI subcommand); returns its exit code."""
    from ..loading import resolve_model_dir

    _require_plugin()
    cmd = server_command(resolve_model_dir(model), launch=LaunchOptions(host=host, port=port),
                         served_model_name=model, max_model_len=max_model_len, extra_args=extra_args,
                         dtype=server_dtype(dtype))
    return subprocess.call(cmd, env=server_env(extra_args=extra_args))
