"""Several vLLM replicas behind vLLM's own router (``vllm-router``, the ``[router]`` extra).

``VLLMRouter(worker_urls, launch=LaunchOptions(port=...), policy=...)`` runs ``python -m vllm_router.launch_router``
(a prebuilt Rust binary from PyPI) in front of vLLM servers that each run the plugin, started by
``VLLMServer`` / ``specprefill-rag serve MODEL`` or by anything else. The router forwards
``vllm_xargs`` and ``cache_salt`` untouched and streams the replicas' answers through unchanged,
so plans, their proofs (``wire.PROOF_FIELD``) and the position-aware prefix cache work through
it; the ``vllm_server`` backend and the gateway point at ``router.url`` as at one server. A
replica without the plugin cannot answer a plan wrongly: its answers carry no proof and the
backend refuses them. The topology and the policies: docs/deploy.md.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from collections.abc import Sequence

from ..errors import ConfigError, ServerStartError
from .vllm_process import DEFAULT_LAUNCH, LaunchOptions, ManagedProcess

__all__ = ["ROUTER_POLICIES", "VLLMRouter", "router_command"]

# vllm-router 0.1.17's policies for plain (not prefill/decode-disaggregated) serving.
ROUTER_POLICIES = ("round_robin", "random", "cache_aware", "power_of_two", "consistent_hash", "sticky_least_loaded")


def router_command(
    worker_urls: Sequence[str],
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    policy: str = "round_robin",
    prometheus_port: int | None = None,
    extra_args: Sequence[str] = (),
    python: str | None = None,
) -> list[str]:
    """The command line that starts ``vllm-router`` over ``worker_urls`` (with ``python``);
    ``prometheus_port``: where it serves its own metrics (None: the router's default port)."""
    if not worker_urls:
        raise ConfigError("the router needs at least one worker URL (a vLLM server with the plugin)")
    if policy not in ROUTER_POLICIES:
        raise ConfigError(f"policy must be one of {', '.join(ROUTER_POLICIES)}, got {policy!r}")
    metrics = [] if prometheus_port is None else ["--prometheus-host", host, "--prometheus-port", str(prometheus_port)]
    return [python or sys.executable, "-m", "vllm_router.launch_router", "--host", host, "--port", str(port),
            "--policy", policy, *metrics, "--worker-urls", *worker_urls, *extra_args]


class VLLMRouter(ManagedProcess):
    """``vllm-router`` as a subprocess on loopback: ready once it answers ``/health`` and routes
    ``/v1/models`` to a replica. Stopped by PID (SIGTERM, then SIGKILL) like ``VLLMServer``.

    ``launch``: its address, interpreter, environment and log. ``prometheus_port`` (the router's
    own metrics; None: a free port, so that several routers can run on one host) is
    ``metrics_url``'s port."""

    what = "vllm-router"

    def __init__(
        self,
        worker_urls: Sequence[str],
        *,
        launch: LaunchOptions = DEFAULT_LAUNCH,
        policy: str = "round_robin",
        prometheus_port: int | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.worker_urls = tuple(worker_urls)
        self.policy, self.python = policy, launch.python
        self.prometheus_port = _free_port(launch.host) if prometheus_port is None else prometheus_port
        self.command = router_command(self.worker_urls, host=launch.host, port=launch.port, policy=policy,
                                      prometheus_port=self.prometheus_port, extra_args=extra_args,
                                      python=launch.python)
        self.env = dict(os.environ if launch.env is None else launch.env)
        self._init_process(launch)

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.prometheus_port}/metrics"

    def _preflight(self) -> None:
        if self.python is None and importlib.util.find_spec("vllm_router") is None:
            raise ServerStartError("vllm-router is not installed: pip install 'specprefill-rag[router]'")

    def _ready(self) -> bool:
        health = self._get("/health")
        return health is not None and health[0] == 200 and super()._ready()


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])
