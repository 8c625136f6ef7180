"""``tools.router``'s command line and checks (no router started; tests/test_router.py runs one)."""

from __future__ import annotations

import pytest

from specprefill_rag.errors import ConfigError
from specprefill_rag.tools.router import ROUTER_POLICIES, VLLMRouter, router_command
from specprefill_rag.tools.vllm_process import LaunchOptions


def test_command_names_the_workers_policy_and_metrics_port():
    cmd = router_command(["http://a:1", "http://b:2"], port=9000, policy="cache_aware", prometheus_port=9100,
                         python="/venv/bin/python")
    assert cmd[:3] == ["/venv/bin/python", "-m", "vllm_router.launch_router"]
    assert cmd[cmd.index("--port") + 1] == "9000" and cmd[cmd.index("--policy") + 1] == "cache_aware"
    assert cmd[cmd.index("--prometheus-port") + 1] == "9100"
    assert cmd[cmd.index("--worker-urls") + 1:] == ["http://a:1", "http://b:2"]
    assert "--prometheus-port" not in router_command(["http://a:1"])


def test_each_router_gets_its_own_metrics_port():
    """vllm-router panics at start when its metrics port is taken: two on one host need two."""
    first = VLLMRouter(["http://a:1"], launch=LaunchOptions(port=1))
    second = VLLMRouter(["http://a:1"], launch=LaunchOptions(port=2))
    assert first.prometheus_port != second.prometheus_port
    assert first.metrics_url == f"http://127.0.0.1:{first.prometheus_port}/metrics"


@pytest.mark.parametrize(("workers", "policy", "message"), [
    ([], "round_robin", "at least one worker URL"),
    (["http://a:1"], "fastest", "policy must be one of round_robin, random, cache_aware"),
])
def test_bad_arguments_are_refused(workers, policy, message):
    with pytest.raises(ConfigError, match=message):
        router_command(workers, policy=policy)
    assert "round_robin" in ROUTER_POLICIES
