"""``--device`` / ``--dtype`` reach every model a CLI command loads: demo, ask, gateway (draft and
a transformers main model) and serve's gateway (the draft beside vLLM). The engine's builder is
replaced by a recorder, so nothing is loaded."""

from __future__ import annotations

import signal
from typing import Any

import pytest

from specprefill_rag import loading
from specprefill_rag.engine import SpecPrefillEngine
from specprefill_rag.loading import devices
from specprefill_rag.tools import cli, vllm_process


class _Built(Exception):
    """Raised by the recording builder: the command got as far as loading its models."""


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []

    def record(cls: Any, main: str, draft: str | None = None, **kwargs: Any) -> Any:
        calls.append({"main": main, "draft": draft, **kwargs})
        raise _Built

    monkeypatch.setattr(SpecPrefillEngine, "from_pretrained", classmethod(record))
    monkeypatch.setattr(loading, "resolve_model_dir", lambda name, **_: name)
    monkeypatch.setattr(cli, "_retrieve", lambda args, question: [])
    return calls


@pytest.mark.parametrize(
    "argv",
    [
        ["demo"],
        ["ask", "why?", "--docs", "."],
        ["gateway"],
        ["gateway", "--backend", "vllm_server", "--served-model-name", "m", "--max-model-len", "4096"],
    ],
)
def test_device_and_dtype_reach_the_models(built: list[dict[str, Any]], argv: list[str]) -> None:
    with pytest.raises(_Built):
        cli.main([*argv, "--device", "cuda:1", "--dtype", "bfloat16"])
    assert built[-1]["device"] == "cuda:1" and built[-1]["dtype"] == "bfloat16"
    with pytest.raises(_Built):
        cli.main(argv)
    assert built[-1]["device"] == "auto" and built[-1]["dtype"] == "auto"  # the library's choice


def test_serve_gives_the_gateways_draft_the_device(
    built: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[dict[str, Any]] = []

    class FakeVLLM:
        url, started_s = "http://127.0.0.1:1", 0.0

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            started.append(kwargs)

        def start(self) -> None:
            pass

        def stop(self) -> None:
            pass

    monkeypatch.setattr(vllm_process, "VLLMServer", FakeVLLM)
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    with pytest.raises(_Built):
        cli.main(["serve", "main-model", "--gateway-port", "1", "--draft", "d", "--device", "cuda",
                  "--dtype", "float16"])
    assert built[-1] == {
        "main": "main-model", "draft": "d", "backend": "vllm_server", "base_url": FakeVLLM.url,
        "config": built[-1]["config"], "device": "cuda", "dtype": "float16",
    }
    assert started[-1]["dtype"] == "float16"  # one precision: vLLM's main model too
    with pytest.raises(_Built):
        cli.main(["serve", "main-model", "--gateway-port", "1", "--draft", "d"])
    assert started[-1]["dtype"] == built[-1]["dtype"] == "auto"  # each resolves auto by one rule


def test_serve_gives_vllm_the_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(vllm_process, "serve", lambda model, **kwargs: calls.append(kwargs) or 0)
    assert cli.main(["serve", "m", "--dtype", "bfloat16"]) == 0 and calls[-1]["dtype"] == "bfloat16"
    assert cli.main(["serve", "m"]) == 0 and calls[-1]["dtype"] == "auto"


@pytest.mark.parametrize(("native_bf16", "want"), [(True, "bfloat16"), (False, "float32")])
def test_a_cpu_vllm_server_runs_at_the_cpus_best_precision(monkeypatch: pytest.MonkeyPatch, native_bf16: bool,
                                                           want: str) -> None:
    """``VLLMServer`` / ``serve`` ask vLLM for the precision ``"auto"`` gives the draft on that CPU."""
    monkeypatch.setattr(devices, "cpu_runs_bf16", lambda: native_bf16)
    assert vllm_process.server_dtype("auto", cpu=True) == want
    assert vllm_process.server_dtype("auto", cpu=False) is None  # a GPU: vLLM's own auto (bf16 / fp16)
    assert vllm_process.server_dtype("fp32", cpu=True) == "float32"  # asked for: given, as vLLM spells it
    command = vllm_process.server_command("/m", cpu=True, dtype=vllm_process.server_dtype("auto", cpu=True),
                                          extra_args=["--max-num-seqs", "8"])
    assert command[-5:] == ["--dtype", want, "--enforce-eager", "--max-num-seqs", "8"]
    assert vllm_process.server_command("/m", cpu=False, dtype="float16")[-2:] == ["--dtype", "float16"]
    monkeypatch.setattr(vllm_process, "on_cpu", lambda: True)
    monkeypatch.setattr(loading, "resolve_model_dir", lambda name, **_: name)
    launch = vllm_process.LaunchOptions(port=1)
    server = vllm_process.VLLMServer("m", launch=launch)
    assert server.dtype == want and server.command[server.command.index("--dtype") + 1] == want
    server = vllm_process.VLLMServer("m", launch=launch, dtype="float32")  # equality tests against fp32 references
    assert server.dtype == "float32" and server.command.count("--dtype") == 1


def test_an_unknown_dtype_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["demo", "--dtype", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["demo"], ["gateway"]])
def test_lookahead_tokens_reach_the_draft_config(built: list[dict[str, Any]], argv: list[str]) -> None:
    with pytest.raises(_Built):
        cli.main([*argv, "--lookahead-tokens", "siblings"])
    assert built[-1]["config"].draft.lookahead_tokens == "siblings"
    with pytest.raises(_Built):
        cli.main(argv)
    assert built[-1]["config"].draft.lookahead_tokens == "greedy"  # the library's default


@pytest.mark.parametrize("field", ["lookahead_stop_at_eos", "echo_question"])
@pytest.mark.parametrize("argv", [["demo"], ["gateway"]])
def test_the_draft_switches_reach_the_draft_config(built: list[dict[str, Any]], argv: list[str], field: str) -> None:
    from specprefill_rag import DraftConfig

    flag = field.replace("_", "-")
    for given, want in ((f"--{flag}", True), (f"--no-{flag}", False)):
        with pytest.raises(_Built):
            cli.main([*argv, given])
        assert getattr(built[-1]["config"].draft, field) is want
    with pytest.raises(_Built):
        cli.main(argv)
    assert getattr(built[-1]["config"].draft, field) is getattr(DraftConfig(), field)


def test_draft_memo_reaches_the_gateways_draft_config(built: list[dict[str, Any]]) -> None:
    with pytest.raises(_Built):
        cli.main(["gateway", "--draft-memo", "0"])
    assert built[-1]["config"].draft.memo_entries == 0
    with pytest.raises(_Built):
        cli.main(["gateway"])
    assert built[-1]["config"].draft.memo_entries == 32  # the library's default
    assert built[-1]["config"].draft.prefix_cache_entries == 8


def test_draft_prefix_cache_reaches_the_gateways_draft_config(built: list[dict[str, Any]]) -> None:
    with pytest.raises(_Built):
        cli.main(["gateway", "--draft-prefix-cache", "0"])
    assert built[-1]["config"].draft.prefix_cache_entries == 0 and built[-1]["config"].draft.memo_entries == 32


def test_skip_draft_when_slower_reaches_the_gateways_draft_config(built: list[dict[str, Any]]) -> None:
    with pytest.raises(_Built):
        cli.main(["gateway", "--skip-draft-when-slower"])
    assert built[-1]["config"].draft.skip_when_slower is True
    with pytest.raises(_Built):
        cli.main(["gateway"])
    assert built[-1]["config"].draft.skip_when_slower is False  # the library's default


def test_draft_batch_pad_limit_reaches_the_gateways_draft_config(built: list[dict[str, Any]]) -> None:
    with pytest.raises(_Built):
        cli.main(["gateway", "--draft-batch", "8", "--draft-batch-pad-limit", "0.1"])
    assert built[-1]["config"].draft.batch_pad_limit == 0.1 and built[-1]["config"].draft.max_batch == 8


def test_the_loaded_line_names_each_torch_models_device_and_dtype() -> None:
    from types import SimpleNamespace

    import torch

    model = SimpleNamespace(dtype=torch.bfloat16, device=torch.device("cpu"))  # what a transformers model has
    assert cli._placed(model) == " (cpu, bfloat16)"
    assert cli._placed(None) == ""  # a vLLM main model: nothing to name


def test_the_demos_speedup_names_both_precisions() -> None:
    from types import SimpleNamespace

    import torch

    def model(dtype: torch.dtype) -> Any:
        return SimpleNamespace(dtype=dtype, device=torch.device("cpu"))

    engine = SimpleNamespace(draft=SimpleNamespace(model=model(torch.bfloat16)),
                             backend=SimpleNamespace(model=model(torch.bfloat16)))
    assert cli._precisions(engine) == "draft bf16, main bf16"
    engine.backend = SimpleNamespace()  # a vLLM main model: no weights here
    assert cli._precisions(engine) == "draft bf16, main served by vLLM"


@pytest.mark.parametrize("native_bf16", [True, False])
def test_the_demo_says_when_its_baseline_is_not_at_its_best(monkeypatch: pytest.MonkeyPatch,
                                                           native_bf16: bool) -> None:
    from types import SimpleNamespace

    import torch

    monkeypatch.setattr(devices, "cpu_runs_bf16", lambda: native_bf16)
    fp32 = SimpleNamespace(dtype=torch.float32, device=torch.device("cpu"))
    note = cli._baseline_note(fp32)
    assert ("fp32 where this CPU runs bf16 faster" in note) is native_bf16 and bool(note) is native_bf16
    assert cli._baseline_note(SimpleNamespace(dtype=torch.bfloat16, device=torch.device("cpu"))) == ""
    assert cli._baseline_note(None) == ""  # a vLLM main model
