"""Evidence recall: does the selection keep the gold evidence? Draft only, no main model.

The cheap proxy for answer quality, measured on hundreds of real questions: for each example
the draft reads the assembled prompt once (question queries + 8 look-ahead queries, every
layer); the per-layer attention rows are cached, and every scoring/selection variant is then
computed from the cache with the library's own ``scoring`` and ``selection`` functions, at
each keep rate (a fraction of the context, as ``SelectionConfig.keep_rate`` is).

Per example, variant and keep rate:

- ``recall``: share of the gold evidence tokens kept (HotpotQA: the supporting-fact
  sentences; SQuAD: the answer span; needle: the needle sentence);
- ``complete``: every key span kept (HotpotQA: each supporting sentence ≥ 50% kept, "both
  hops"; SQuAD: the whole answer span; needle: the whole number);
- ``context_kept``: share of the context tokens kept (the budget actually used).

Results are appended to a JSON-lines file one example at a time (an interrupted run resumes
where it stopped, with the same command: each row records its prompt's digest, and a resume that
would build another prompt under an id the file holds, e.g. with another ``--n-long`` or other
lengths, is refused before any work); ``summary`` prints means with bootstrap 95% confidence
intervals. The same examples (seeded) as ``bench quality``. Variants are named in ``VARIANTS``; ``--variants``
re-evaluates from the cache without running the draft again.

A prompt longer than the draft's window (or ``--draft-window``) has no single pass to capture:
it is read in windows as the engine reads it (``DraftConfig.on_overflow="windows"``), and only
the library default's scoring and the draft-free baselines are measured on it (its row records
``windows``).

    specprefill-rag bench evidence --n 200                   # ~10 s per example on 2 CPU cores
    specprefill-rag bench evidence --summary                 # the table from the results file
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import pickle
import random
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.lib import long_context
from benchmarks.lib.machine import cold, dtype_name, model_dtype_name, offline
from benchmarks.lib.metrics import bootstrap_ci, share_ci
from benchmarks.lib.results import RESULTS_DIR, ROOT, append_jsonl, prompt_digest, read_jsonl, same_example
from benchmarks.suites import quality
from specprefill_rag import DraftConfig, DraftModel, Passage, SelectionConfig
from specprefill_rag import prompt as prompt_lib
from specprefill_rag import selection as selection_lib
from specprefill_rag.config import LayerChoice
from specprefill_rag.draft import probe as draft_lib
from specprefill_rag.durable import atomic_open, write_atomic
from specprefill_rag.errors import InputError
from specprefill_rag.loading import DEFAULT_DRAFT, DEFAULT_MAIN, DTYPES, load_tokenizer, resolve_dtype
from specprefill_rag.types import AssembledPrompt, SegmentKind

# v3: keyed by the prompt's token ids too (v2 keyed by the question alone, so a padding built
# with another --n-long or other lengths read the rows of another prompt); v2 can be deleted.
CACHE_DIR = ROOT / "benchmarks" / ".cache" / "evidence-v3"
PINNED = ("library default", "reference", "random chunks", "random sentences", "oracle sentences")
METRICS = ("recall", "complete", "context_kept")  # the columns of each result entry
MAX_LOOKAHEAD = 8  # captured once; shorter look-aheads are prefixes of the same greedy run
# The early-exit blocks ("lens", "upper<share>", "greedyupper<share>") depend on the aggregated
# layers, whose top is where the prompt's forward stops: an untagged block is captured for
# LENS_LAYERS, a block "<kind>@<layers>" for other layers ("<layers>": a LayerChoice, or "a-b" for
# the layers a..b), so exits at other depths are measured as the library runs them.
LENS_LAYERS: LayerChoice = "middle_half"
UPPER_KEEPS = (0.15, 0.3)  # DraftConfig.upper_keep values captured
EXIT_KINDS = ("lens", *(f"upper{u:g}" for u in UPPER_KEEPS), *(f"greedyupper{u:g}" for u in UPPER_KEEPS))
BLOCKS = ("greedy", "full", *EXIT_KINDS)  # look-ahead row blocks, in order


def layers_tag(layers: LayerChoice | tuple[int, ...]) -> str:
    """How a block names its aggregated ``layers``: a LayerChoice as it is, a run of indices "a-b"."""
    if isinstance(layers, str):
        return layers
    first, last = min(layers), max(layers)
    if tuple(layers) != tuple(range(first, last + 1)):
        raise ValueError(f"early-exit blocks are captured for a LayerChoice or a run of layers, got {layers}")
    return f"{first}-{last}"


def block_name(kind: str, layers: LayerChoice | tuple[int, ...]) -> str:
    """The block of early-exit ``kind`` for ``layers`` (untagged for ``LENS_LAYERS``)."""
    return kind if layers == LENS_LAYERS else f"{kind}@{layers_tag(layers)}"


def block_layers(block: str) -> tuple[str, LayerChoice | tuple[int, ...]]:
    """(kind, aggregated layers) of a block name; ``ValueError`` for a name that is none."""
    kind, _, tag = block.partition("@")
    if kind in ("greedy", "full") and not tag:
        return kind, LENS_LAYERS
    if kind not in EXIT_KINDS:
        raise ValueError(f"unknown look-ahead block {block!r}: one of {BLOCKS}, or <early-exit kind>@<layers>")
    if not tag:
        return kind, LENS_LAYERS
    if "-" in tag:
        first, last = (int(x) for x in tag.split("-"))
        return kind, tuple(range(first, last + 1))
    DraftConfig(layers=tag)  # type: ignore[arg-type]  # validates the name
    return kind, tag  # type: ignore[return-value]
POOL_KERNEL = DraftConfig().pool_kernel


@dataclass(frozen=True)
class Variant:
    """One scoring + selection configuration, in the library's own config objects."""

    name: str
    draft: DraftConfig = field(default_factory=DraftConfig)
    selection: SelectionConfig = field(default_factory=lambda: SelectionConfig(min_prompt_tokens=0))
    scores: str = "draft"  # "draft" | "random" | "oracle" | "lens" (the draft, look-ahead block "lens")
    prior: bool = False  # pass a retriever prior (MiniLM question-passage cosine) to selection


REFERENCE = DraftConfig(
    lookahead=8, lookahead_tokens="greedy", lookahead_weight=1.0, layers="all", heads="max", normalize=False
)
CHUNKS = SelectionConfig(min_prompt_tokens=0, unit="chunk", chunk_size=32)
SENTENCES = SelectionConfig(min_prompt_tokens=0, unit="sentence")


def _lookahead_name(d: DraftConfig) -> str:
    end = ", to the draft's end" if d.lookahead_stop_at_eos and d.lookahead > 1 else ""
    if d.lookahead == 1 or (d.lookahead_tokens == "greedy" and not d.early_exit):
        return f"look-ahead {d.lookahead}{end}"
    if d.lookahead_tokens == "greedy":
        return f"look-ahead {d.lookahead}, upper layers read {d.upper_keep:.0%}{end}"
    if not d.early_exit:
        return f"{d.lookahead - 1} siblings, full forward"
    return f"{d.lookahead - 1} siblings, upper layers read {d.upper_keep:.0%}"


def _variants() -> list[Variant]:
    out = [
        Variant("reference (look-ahead 8, all layers, max, chunks 32)", REFERENCE, CHUNKS),
        Variant("random chunks", REFERENCE, CHUNKS, scores="random"),
        Variant("random sentences", REFERENCE, SENTENCES, scores="random"),
        Variant("oracle sentences", REFERENCE, SENTENCES, scores="oracle"),
    ]
    for weight in (0.0, 0.25, 0.5, 1.0):
        for layers in ("all", "upper_half", "middle_half", "lower_half"):
            for normalize in (False, True):
                for heads in ("max", "mean"):
                    d = DraftConfig(  # the scoring grid, measured with the greedy look-ahead on full forwards
                        lookahead=MAX_LOOKAHEAD, lookahead_tokens="greedy", lookahead_weight=weight, layers=layers,
                        heads=heads, normalize=normalize, early_exit=False,  # type: ignore[arg-type]
                    )
                    tag = f"w={weight:g} {layers} {heads}{' norm' if normalize else ''}"
                    out.append(Variant(f"{tag} | chunks 32", d, CHUNKS))
                    out.append(Variant(f"{tag} | sentences", d, SENTENCES))
    best = DraftConfig()  # the library default
    looks = [dataclasses.replace(best, lookahead=1)]  # no look-ahead tokens: early exit changes nothing
    looks += [dataclasses.replace(best, lookahead=n, lookahead_tokens="greedy", early_exit=e)
              for n in (2, 4, 8) for e in (False, True)]
    looks += [dataclasses.replace(best, lookahead=8, lookahead_tokens="greedy", early_exit=True, upper_keep=u)
              for u in UPPER_KEEPS]
    looks += [dataclasses.replace(best, lookahead=8, lookahead_tokens="greedy", early_exit=e, lookahead_stop_at_eos=s)
              for e in (False, True) for s in (False, True)]  # the look-ahead cut at the draft's answer's end
    looks += [dataclasses.replace(best, lookahead=n, lookahead_tokens="siblings", early_exit=False) for n in (2, 4, 8)]
    looks += [
        dataclasses.replace(best, lookahead=n, lookahead_tokens="siblings", early_exit=True, upper_keep=u)
        for u in UPPER_KEEPS for n in (2, 4, 8)
    ]
    for d in looks:
        if d != best:
            out.append(Variant(f"default scoring, {_lookahead_name(d)} | sentences", d, SENTENCES))
    for n in (2, 4, 8):  # read off the exit layer by the LM head: measured, not a library option
        d = dataclasses.replace(best, lookahead=n, lookahead_tokens="siblings", early_exit=True)
        out.append(Variant(f"default scoring, {n - 1} siblings off the exit layer (logit lens) | sentences", d,
                           SENTENCES, scores="lens"))
    def sentences(**overrides: Any) -> SelectionConfig:
        return dataclasses.replace(SENTENCES, **overrides)

    for pw in (0.25, 0.5):
        out.append(Variant(f"default scoring | sentences, passage {pw:g}", best, sentences(passage_weight=pw)))
    for cap in (32, 128):
        out.append(Variant(f"default scoring | sentences ≤ {cap}", best, sentences(max_sentence_tokens=cap)))
    for mass in (0.5, 0.7, 0.9):
        out.append(Variant(f"default scoring | sentences, keep_mass {mass:g}", best, sentences(keep_mass=mass)))
    for rw in (0.1, 0.25, 0.5, 1.0):
        out.append(
            Variant(f"default scoring | sentences, retriever {rw:g}", best, sentences(retriever_weight=rw), prior=True)
        )
    out.append(Variant("library default", best, SelectionConfig(min_prompt_tokens=0)))
    return out


VARIANTS = {v.name: v for v in _variants()}


def exit_candidates(tag: str) -> list[Variant]:
    """The library default's scoring with its early exit after another layer: the aggregated
    layers a..b of ``tag`` ("a-b", for one draft's depth), with the default look-ahead (greedy
    from the upper layers over a reading set), none (look-ahead 1) and siblings. Their blocks
    are "greedyupper0.3@a-b" and "upper0.3@a-b" (``--blocks``). Added to ``VARIANTS`` by
    ``--candidate-layers``; what a cheaper draft would keep, measured on the same examples."""
    _, layers = block_layers(f"upper0.3@{tag}")
    best = dataclasses.replace(DraftConfig(), layers=layers)
    looks = (best, dataclasses.replace(best, lookahead=1), dataclasses.replace(best, lookahead_tokens="siblings"))
    return [Variant(f"default scoring, layers {tag}, {_lookahead_name(d)} | sentences", d, SENTENCES) for d in looks]


# -- gold evidence on tokens -------------------------------------------------------------------


def span_masks(
    prompt: AssembledPrompt, ex: quality.Example, spans: Sequence[tuple[int, int, int]]
) -> list[torch.Tensor]:
    """Token masks (n,) bool of each (passage index, start, end) character span of ``ex``."""
    seg_of_passage = [i for i, s in enumerate(prompt.segments) if s.kind is SegmentKind.PASSAGE]
    where = {segment: (a, b) for segment, a, b in prompt.segment_spans}
    starts, ends = prompt.offsets[:, 0], prompt.offsets[:, 1]
    masks = []
    for passage, a, b in spans:
        raw = ex.passages[passage][1]
        shift = len(raw) - len(raw.lstrip())  # segments hold stripped text
        base = where[seg_of_passage[passage]][0] - shift
        lo, hi = base + a, base + b
        masks.append((starts < hi) & (ends > lo) & (ends > starts))
    return masks


# -- capture cache -----------------------------------------------------------------------------


def capture_name(args: argparse.Namespace, dtype: torch.dtype) -> str:
    """The draft's name in the capture cache: a dtype other than fp32 is cached apart (fp32
    captures predate ``--draft-dtype`` and keep the bare name)."""
    if args.tiny:
        return "tiny"
    return args.draft if dtype == torch.float32 else f"{args.draft}|{dtype_name(dtype)}"


def same_dtype(rows: Sequence[dict[str, Any]], dtype: torch.dtype, path: Path) -> None:
    """Refuse to resume a results file measured with the draft in another dtype (rows written
    before rows recorded it were fp32): one file, one dtype."""
    found = {r.get("draft_dtype", "float32") for r in rows}
    if found and found != {dtype_name(dtype)}:
        raise SystemExit(f"{path} was measured with the draft in {', '.join(sorted(found))}, this run would add "
                         f"{dtype_name(dtype)}: pass --draft-dtype {sorted(found)[0]} or another --out")


def cache_path(ex: quality.Example, draft_name: str, prompt: Any) -> Path:
    """Where the draft's captured rows of ``prompt`` (the example assembled) are cached: keyed by
    the draft, the example and the prompt's token ids, since an id names a question, not its
    padding (SQuAD-long's depends on --n-long, a haystack on the lengths and depths asked)."""
    key = f"{draft_name}|{ex.task}|{ex.id}|{ex.question}|{prompt_digest(prompt)}"
    return CACHE_DIR / f"{ex.task}-{hashlib.sha1(key.encode()).hexdigest()[:16]}.pt"


def save_capture(captured: Any, where: Path) -> None:
    """Cache a capture crash-safely: an interrupted save leaves the previous file, or none."""
    with atomic_open(where) as handle:
        torch.save(captured, handle)


def load_capture(where: Path) -> Any | None:
    """A cached capture, or None if there is none or it cannot be read (a file torn by a crash
    before saves were atomic): then it is captured again."""
    if not where.exists():
        return None
    try:
        return torch.load(where)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as error:
        print(f"warning: {where}: unreadable cached capture ({error}); capturing again", file=sys.stderr, flush=True)
        return None


@torch.inference_mode()
def _capture_all(draft: Any, ids: torch.Tensor, question: torch.Tensor, blocks: Sequence[str]) -> Any:
    """The look-aheads the variants read, after ONE forward over the prompt (the library's
    ``capture`` runs one per look-ahead; this is that, with the prompt's forward shared). Blocks
    of 7 rows each, in the order of ``blocks``: "greedy" (7 greedy steps), "full" (siblings from
    the full forward's logits), "lens" (siblings read off the input of the top aggregated layer
    by the LM head: the logit lens, measured and rejected), "upper<share>" (siblings from the
    upper layers over a reading set, ``DraftConfig.upper_keep``: the library's early exit),
    "greedyupper<share>" (its greedy steps); the early-exit ones for ``LENS_LAYERS``, or for the
    layers a "@<layers>" tag names (``block_layers``). Every look-ahead forward runs on the
    prompt's cache cropped back to the prompt. Rows (per layer): question, last token, then the
    blocks. ``tests/test_bench_evidence.py`` checks the variants against ``DraftModel.score``."""
    from transformers import DynamicCache

    from specprefill_rag.draft.probe import DecoderParts, Recorder, recording, tree_mask, upper_layer_logits

    n, k = int(ids.numel()), MAX_LOOKAHEAD - 1
    device = draft.device
    parsed = {block: block_layers(block) for block in blocks}
    aggregated = {layers: DraftConfig(layers=layers).layer_indices(draft.n_layers)  # type: ignore[arg-type]
                  for _, layers in parsed.values()}
    tops = sorted({max(layers) for layers in aggregated.values()})
    recorder = Recorder([n], [question.to(torch.int64).cpu()])
    cache = DynamicCache(config=draft.model.config)
    parts = DecoderParts.of(draft.model)
    assert parts is not None
    entering: dict[int, torch.Tensor] = {}
    leaving: dict[int, torch.Tensor] = {}

    def hooks_of(top: int) -> list[Any]:
        def enter(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            entering[top] = (args[0] if args else kwargs["hidden_states"])[0, -1]

        def leave(module: Any, args: Any, output: Any) -> None:
            leaving[top] = output[0] if isinstance(output, tuple) else output

        return [parts.layers[top].register_forward_pre_hook(enter, with_kwargs=True),
                parts.layers[top].register_forward_hook(leave)]

    hooks = [hook for top in tops for hook in hooks_of(top)]
    prompt = ids.to(device).reshape(1, n)
    last = torch.tensor([n - 1], device=device)
    with recording(recorder):
        try:
            out = draft.model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        finally:
            for hook in hooks:
                hook.remove()
        logits = out.logits[0, -1]
        tokens: list[int] = []
        for block in blocks:
            kind, layers = parsed[block]
            chosen = aggregated[layers]
            top = max(chosen)
            if kind == "greedy":
                tokens += _greedy_steps(draft, cache, logits, n, k)
                continue
            if kind.startswith("greedyupper"):
                tokens += _upper_greedy_steps(draft, recorder, cache, prompt, leaving[top], chosen,
                                              float(kind.removeprefix("greedyupper")), k)
                continue
            if kind == "full":
                first = logits
            elif kind == "lens":
                first = parts.head(parts.norm(entering[top]))
            else:
                first = upper_layer_logits(draft, recorder, parts, leaving[top], last, top,
                                           float(kind.removeprefix("upper")), chosen)[0]
            siblings = first.topk(k).indices
            tokens += siblings.tolist()
            draft.model(input_ids=siblings.reshape(1, k), position_ids=torch.full((1, k), n, device=device),
                        attention_mask=tree_mask(torch.ones(1, n, device=device), k), past_key_values=cache,
                        use_cache=True, logits_to_keep=1)
            cache.crop(-k)  # back to the prompt
        return recorder.captures([tokens])[0]


def _end_at(tokens: Sequence[int], end_ids: Iterable[int]) -> int:
    """How many of a block's look-ahead ``tokens`` come before the first end token."""
    ends = set(end_ids)
    return next((i for i, t in enumerate(tokens) if t in ends), len(tokens))


def _greedy_steps(draft: Any, cache: Any, logits: torch.Tensor, n: int, k: int) -> list[int]:
    """``k`` greedy decode steps after the prompt (recorded), then the cache back to the prompt."""
    device = draft.device
    greedy: list[int] = []
    for step in range(k):
        greedy.append(int(logits.argmax()))
        logits = draft.model(
            input_ids=torch.tensor([[greedy[-1]]], device=device),
            position_ids=torch.tensor([[n + step]], device=device),
            attention_mask=torch.ones(1, n + step + 1, dtype=torch.int64, device=device), past_key_values=cache,
            use_cache=True, logits_to_keep=1,
        ).logits[0, -1]
    cache.crop(-k)
    return greedy


def _upper_greedy_steps(draft: Any, recorder: Any, cache: Any, prompt: torch.Tensor, leaving: torch.Tensor,
                        aggregated: list[int], share: float, k: int) -> list[int]:
    """The library's early-exit greedy look-ahead (``draft.upper_greedy``) on the full forward's
    cache, whose layers up to the top aggregated one are the early-exit forward's (left as they
    are: the loop runs on fixed-size copies, ``draft.early_exit.StepLoop``). The layers above get zero
    rows (they are never read for it). One step per token: verified guesses give the same tokens
    and rows (tests/test_lookahead.py)."""
    from transformers import DynamicCache

    from specprefill_rag.draft.probe import DecoderParts, ExitedPrompts, LookaheadSpec, reading_sets, upper_greedy

    parts = DecoderParts.of(draft.model)
    assert parts is not None
    top = max(aggregated)
    keeps = reading_sets(draft, recorder, share, aggregated)
    n = int(leaving.shape[1])
    everything = recorder.layers
    recorder.layers = frozenset(range(top + 1))
    try:
        prompts = ExitedPrompts(prompt, torch.ones(1, n, dtype=torch.int64, device=draft.device), cache, leaving)
        spec = LookaheadSpec(lookahead=k + 1, layers=aggregated, guesses=0)  # k steps, upper layers from top + 1
        tokens, _ = upper_greedy(parts, prompts, DynamicCache(config=draft.model.config), keeps, spec)
    finally:
        recorder.layers = everything
    for layer in range(top + 1, draft.n_layers):
        pieces = recorder.queries[layer][0]
        heads, _, dim = pieces[0].shape
        pieces.append(pieces[0].new_zeros(heads, k, dim))
    return tokens[0].tolist()  # the loop ran on copies: ``cache`` still holds the prompt alone


def _block_rows(cap: Any, prompt: AssembledPrompt) -> dict[str, torch.Tensor]:
    """Per (normalize, heads) combination, (layers, n_queries, n) fp16 rows of a capture."""
    context = ~prompt.protected
    return {
        f"{int(normalize)}{heads}": torch.stack(
            [
                draft_lib.layer_rows(
                    cap.queries[i], cap.keys[i], cap.scaling[i], POOL_KERNEL,
                    positions=cap.positions, context=context if normalize else None, heads=heads,
                )
                for i in range(len(cap.keys))
            ]
        ).half()
        for normalize in (False, True)
        for heads in ("max", "mean")
    }


def _block_tokens(cap: Any, blocks: Sequence[str]) -> dict[str, list[int]]:
    """Each block's look-ahead tokens (``MAX_LOOKAHEAD - 1`` per block, in ``blocks`` order)."""
    k = MAX_LOOKAHEAD - 1
    return {b: list(cap.lookahead_token_ids[i * k : (i + 1) * k]) for i, b in enumerate(blocks)}


def capture_rows(draft: Any, prompt: AssembledPrompt, blocks: Sequence[str] = BLOCKS) -> dict[str, Any]:
    """Per-layer rows for every (normalize, heads) combination, (layers, n_q + 1 + 7 × blocks, n)
    fp16: the question's queries, the last prompt token's, then each block of ``blocks``; each
    block's tokens and the draft's end tokens (``DraftConfig.lookahead_stop_at_eos``)."""
    question = prompt.positions_of(SegmentKind.QUESTION)
    cap = _capture_all(draft, prompt.token_ids, question, blocks)
    return {"n_question": cap.n_question, "n_layers": draft.n_layers, "blocks": list(blocks),
            "tokens": _block_tokens(cap, blocks), "end_ids": sorted(draft.end_ids), **_block_rows(cap, prompt)}


def complete_rows(draft: Any, prompt: AssembledPrompt, rows: dict[str, Any], blocks: Sequence[str] = BLOCKS
                  ) -> dict[str, Any]:
    """``rows`` of an older capture with the ``blocks`` it lacks added (one more prompt
    forward, no greedy steps unless those are missing too)."""
    have = rows.get("blocks", ["greedy", "full", "lens"])  # the first layout had these three
    missing = [b for b in blocks if b not in have]
    if not missing:
        return rows
    cap = _capture_all(draft, prompt.token_ids, prompt.positions_of(SegmentKind.QUESTION), missing)
    lead = cap.n_question + 1
    added = _block_rows(cap, prompt)
    out = dict(rows, blocks=[*have, *missing], end_ids=sorted(draft.end_ids),
               tokens={**rows.get("tokens", {}), **_block_tokens(cap, missing)})
    for combo, extra in added.items():
        out[combo] = torch.cat([rows[combo], extra[:, lead:]], dim=1)
    return out


def variant_scores(rows: dict[str, Any], cfg: DraftConfig, block: str | None = None) -> torch.Tensor:
    """What ``DraftModel.score(..., config=cfg)`` returns, from the cached rows (``block``: read
    that look-ahead block instead of the one ``cfg`` implies, e.g. "lens")."""
    per_layer = rows[f"{int(cfg.normalize)}{cfg.heads}"].float()
    n_q = rows["n_question"]
    lookahead = cfg.lookahead_for(n_q)
    lead = n_q + 1  # the question's rows and the last prompt token's
    if block is None:
        greedy = cfg.lookahead_tokens == "greedy"
        if lookahead == 1 or (greedy and not cfg.early_exit):
            block = "greedy"
        elif not cfg.early_exit or max(cfg.layer_indices(rows["n_layers"])) == rows["n_layers"] - 1:
            block = "greedy" if greedy else "full"  # no early exit, or nothing above the aggregated layers
        else:
            if cfg.upper_keep not in UPPER_KEEPS:
                raise ValueError(f"early-exit look-aheads were captured for upper_keep in {UPPER_KEEPS} only")
            block = block_name(f"{'greedy' if greedy else ''}upper{cfg.upper_keep:g}", cfg.layers)
    elif block == "lens":
        block = block_name("lens", cfg.layers)
    captured = rows.get("blocks", ["greedy", "full", "lens"])
    if lookahead > 1 and block not in captured:  # a look-ahead of 1 reads no block
        raise ValueError(f"this capture holds no look-ahead block {block!r} (it holds {captured}): capture it "
                         "with --blocks")
    after = lead + (MAX_LOOKAHEAD - 1) * captured.index(block) if lookahead > 1 else lead
    fed = lookahead - 1  # look-ahead tokens whose rows count
    if cfg.lookahead_stop_at_eos and lookahead > 1:
        if "tokens" not in rows:
            raise ValueError("this capture holds no look-ahead tokens: capture it again to cut at the draft's end")
        fed = min(fed, _end_at(rows["tokens"][block], rows["end_ids"]))
    per_layer = per_layer[cfg.layer_indices(rows["n_layers"])]
    per_layer = torch.cat([per_layer[:, :lead], per_layer[:, after : after + fed]], dim=1)
    return draft_lib.importance(per_layer, draft_lib.query_weights(n_q, 1 + fed, cfg.lookahead_weight))


_EMBEDDER: list[Any] = []


def retriever_prior(prompt: AssembledPrompt, ex: quality.Example) -> torch.Tensor:
    """(n_segments,) cosine similarity of the question to each passage under MiniLM (the demo
    retriever's embedder), NaN for other segments: what a dense retriever would have scored."""
    from specprefill_rag.tools.retrieval import load_embedder

    if not _EMBEDDER:
        _EMBEDDER.append(load_embedder())
    texts = [s.text for s in prompt.segments if s.kind is SegmentKind.PASSAGE]
    emb = _EMBEDDER[0].encode([ex.question, *texts], convert_to_tensor=True, normalize_embeddings=True)
    cosine = (emb[1:] @ emb[0]).float().cpu()
    prior = torch.full((len(prompt.segments),), float("nan"))
    prior[[i for i, s in enumerate(prompt.segments) if s.kind is SegmentKind.PASSAGE]] = cosine
    return prior


def gold_mask(prompt: AssembledPrompt, ex: quality.Example) -> torch.Tensor:
    """(n,) bool: the tokens of ``ex``'s gold evidence."""
    evidence = span_masks(prompt, ex, ex.evidence)
    return torch.stack(evidence).any(0) if evidence else torch.zeros(prompt.n_tokens, dtype=torch.bool)


def kept_metrics(prompt: AssembledPrompt, ex: quality.Example, scores: torch.Tensor, sel: SelectionConfig,
                 prior: torch.Tensor | None = None, gold: torch.Tensor | None = None) -> list[float]:
    """[recall, complete, context_kept] (``METRICS``) of the library's selection from ``scores``."""
    gold = gold_mask(prompt, ex) if gold is None else gold
    kept_idx = selection_lib.select(
        scores, prompt.protected, prompt.segment_index, sel, prompt.sentence_start, prior, prompt.cut_level,
    )
    kept = torch.zeros(prompt.n_tokens, dtype=torch.bool)
    kept[kept_idx] = True
    recall = float((kept & gold).sum()) / max(int(gold.sum()), 1)
    keys = span_masks(prompt, ex, ex.key)
    complete = all(float((kept & m).sum()) >= ex.key_share * float(m.sum()) for m in keys if m.any())
    context_kept = float((kept & ~prompt.protected).sum()) / max(prompt.n_context, 1)
    return [round(recall, 4), int(complete), round(context_kept, 4)]


def evaluate(
    prompt: AssembledPrompt, ex: quality.Example, rows: dict[str, Any] | None, variants: Iterable[Variant],
    keep_rates: Sequence[float], seed: int, default: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Each variant's metrics per keep rate, its scores read off the captured ``rows``; ``default``:
    the library default's scores when they were computed instead (``default_scores``)."""
    gold = gold_mask(prompt, ex)
    results: dict[str, Any] = {}
    cache: dict[tuple[DraftConfig, str], torch.Tensor] = {}
    if default is not None:
        cache[DraftConfig(), "draft"] = default
    prior = retriever_prior(prompt, ex) if any(v.prior for v in variants) else None
    for v in variants:
        if v.scores == "random":
            scores = torch.rand(prompt.n_tokens, generator=torch.Generator().manual_seed(seed))
        elif v.scores == "oracle":
            scores = gold.float() + 1e-3 * torch.rand(prompt.n_tokens, generator=torch.Generator().manual_seed(seed))
        else:
            if (v.draft, v.scores) not in cache:
                assert rows is not None, f"{v.name} reads captured rows"
                cache[v.draft, v.scores] = variant_scores(rows, v.draft, "lens" if v.scores == "lens" else None)
            scores = cache[v.draft, v.scores]
        for keep in keep_rates:
            sel = dataclasses.replace(v.selection, keep_rate=keep)
            results[f"{v.name}@{keep:g}"] = kept_metrics(prompt, ex, scores, sel, prior if v.prior else None, gold)
    return results


def default_scores(
    draft: DraftModel, prompt: AssembledPrompt, window: int | None = None,
) -> tuple[torch.Tensor, int, float]:
    """(scores, windows read, seconds) of the library's default scoring of ``prompt`` through
    ``DraftModel.score``, as the engine reads it: in windows when it is longer than the draft's
    window (``window``: that window in tokens for the call; None: the draft's own)."""
    config = draft.model.config
    own = config.max_position_embeddings
    if window is not None:
        config.max_position_embeddings = window
    try:
        start = time.perf_counter()
        scored = draft.score(prompt.token_ids, question=prompt.positions_of(SegmentKind.QUESTION),
                             context=~prompt.protected, config=cold(DraftConfig()))
        return scored.scores, scored.windows, time.perf_counter() - start
    finally:
        config.max_position_embeddings = own


def windowed_variants(variants: Iterable[Variant]) -> list[Variant]:
    """The variants an example read in windows can be measured with: those scored by the library
    default (``default_scores``) and the draft-free baselines. The others read captured
    attention rows of one pass over the whole prompt, which a draft shorter than it cannot give."""
    default = DraftConfig()
    return [v for v in variants if v.scores in ("random", "oracle") or (v.scores == "draft" and v.draft == default)]


# -- the run -----------------------------------------------------------------------------------


def windowed_record(draft: DraftModel, prompt: AssembledPrompt, ex: quality.Example, variants: Iterable[Variant],
                    keep_rates: Sequence[float], seed: int) -> dict[str, Any] | None:
    """The results row of a prompt longer than the draft's window, read in windows as the engine
    reads it (``windowed_variants`` only); None when windows cannot hold its context."""
    try:
        scores, windows, seconds = default_scores(draft, prompt)
    except InputError:
        return None
    return {"task": ex.task, "id": ex.id, "n_prompt": prompt.n_tokens, "n_context": prompt.n_context,
            "prompt_sha": prompt_digest(prompt), "draft_s": seconds, "windows": windows,
            "draft_dtype": model_dtype_name(draft.model),
            "results": evaluate(prompt, ex, None, windowed_variants(variants), keep_rates, seed, default=scores)}


def examples(args: argparse.Namespace, count_tokens: Any) -> list[quality.Example]:
    out: list[quality.Example] = []
    if "hotpotqa" in args.tasks:
        out += quality.load_hotpotqa(args.n, args.seed)
    if "squad" in args.tasks:
        out += quality.load_squad(args.n, args.seed, args.squad_tokens, count_tokens)
    if "needle" in args.tasks:
        depths = _needle_depths(args.n_needle, len(args.needle_lengths))
        out += quality.needle_examples(args.needle_lengths, depths, args.seed, count_tokens)
    if "near_miss" in args.tasks:
        out += quality.load_near_miss()
    out += long_context.long_examples(args.tasks, args.long_lengths, args.n_long,
                                      _needle_depths(args.n_needle, len(args.long_lengths)), args.seed, count_tokens)
    return quality.interleave(out)


def _needle_depths(n: int, lengths: int) -> list[float]:
    """``n`` needle examples spread over ``lengths`` lengths: this many depths, evenly spaced."""
    per = max(1, n // max(1, lengths))
    return [round((i + 0.5) / per, 4) for i in range(per)]


def load_rows(path: Path) -> list[dict[str, Any]]:
    """A results file's rows (``results.read_jsonl``: a torn last line is skipped)."""
    return read_jsonl(path)


def summarize(rows: list[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """Mean recall / complete / context kept per (task, variant@keep), with bootstrap 95% CIs."""
    out = []
    tasks = sorted({r["task"] for r in rows})
    for task in tasks:
        mine = [r for r in rows if r["task"] == task]
        names = list(dict.fromkeys(k for r in mine for k in r["results"]))
        for name in names:
            have = [r["results"][name] for r in mine if name in r["results"]]
            variant, keep = name.rsplit("@", 1)
            entry: dict[str, Any] = {"task": task, "variant": variant, "keep_rate": float(keep), "n": len(have)}
            for column, metric in enumerate(METRICS):
                values = [float(h[column]) for h in have]
                mean, lo, hi = share_ci(values, seed=seed)
                entry[metric] = mean
                entry[f"{metric}_ci"] = [lo, hi]
            out.append(entry)
    return out


def paired(rows: list[dict[str, Any]], base: str, seed: int = 0) -> list[dict[str, Any]]:
    """Per (task, variant, keep rate): the mean difference in recall and in "complete" to the
    variant ``base`` on the same examples (those that hold both), with bootstrap 95% CIs."""
    out = []
    for task in sorted({r["task"] for r in rows}):
        mine = [r["results"] for r in rows if r["task"] == task]
        for name in dict.fromkeys(k for r in mine for k in r):
            variant, keep = name.rsplit("@", 1)
            reference = f"{base}@{keep}"
            pairs = [(r[name], r[reference]) for r in mine if name in r and reference in r]
            if variant == base or not pairs:
                continue
            entry: dict[str, Any] = {"task": task, "variant": variant, "keep_rate": float(keep), "n": len(pairs),
                                     "base": sum(float(b[0]) for _, b in pairs) / len(pairs)}
            for column, metric in enumerate(METRICS[:2]):
                mean, lo, hi = bootstrap_ci([float(a[column]) - float(b[column]) for a, b in pairs], seed=seed)
                entry[f"{metric}_diff"], entry[f"{metric}_diff_ci"] = mean, [lo, hi]
            out.append(entry)
    return out


def joined(rows: list[dict[str, Any]], others: list[dict[str, Any]], file: str, variant: str
           ) -> tuple[list[dict[str, Any]], str]:
    """``rows`` of the examples ``others`` also holds, each with ``variant``'s results from there
    under the name ``"<file's name>: <variant>"`` (returned): what ``paired`` compares against."""
    name = f"{Path(file).name}: {variant}"
    theirs = {(r["task"], r["id"]): r["results"] for r in others}
    out = []
    for row in rows:
        found = theirs.get((row["task"], row["id"]), {})
        extra = {f"{name}@{key.rsplit('@', 1)[1]}": value for key, value in found.items()
                 if key.rsplit("@", 1)[0] == variant}
        if extra:
            out.append({**row, "results": {**row["results"], **extra}})
    return out, name


def print_paired(entries: list[dict[str, Any]], base: str) -> None:
    print(f"paired against {base!r}: difference in recall, in complete")
    for e in sorted(entries, key=lambda e: (e["task"], e["keep_rate"], e["variant"])):
        (lo, hi), (clo, chi) = e["recall_diff_ci"], e["complete_diff_ci"]
        print(f"  {e['task']:<12} keep {e['keep_rate']:<4g} n={e['n']:<4} base {e['base']:.3f}  "
              f"recall {e['recall_diff']:+.3f} [{lo:+.3f}, {hi:+.3f}]  "
              f"complete {e['complete_diff']:+.3f} [{clo:+.3f}, {chi:+.3f}]  {e['variant']}")


def pinned(variant: str) -> bool:
    """Baselines every table shows whatever their rank."""
    return variant.startswith(PINNED)


def top_variants(rows: list[dict[str, Any]], top: int) -> list[dict[str, Any]]:
    """``rows`` restricted to the pinned variants and the ``top`` others with the best mean
    recall, per task and keep rate (so only those need bootstrapping)."""
    shown: set[tuple[str, str]] = set()
    for task in {r["task"] for r in rows}:
        recalls: dict[str, list[float]] = {}
        for r in rows:
            if r["task"] == task:
                for key, values in r["results"].items():
                    recalls.setdefault(key, []).append(float(values[0]))
        by_keep: dict[str, list[tuple[float, str]]] = {}
        for key, values in recalls.items():
            variant, keep = key.rsplit("@", 1)
            if pinned(variant):
                shown.add((task, key))
            else:
                by_keep.setdefault(keep, []).append((sum(values) / len(values), key))
        for ranked in by_keep.values():
            shown |= {(task, key) for _, key in sorted(ranked, key=lambda x: -x[0])[:top]}
    return [{**r, "results": {k: v for k, v in r["results"].items() if (r["task"], k) in shown}} for r in rows]


def print_summary(summary: list[dict[str, Any]]) -> None:
    for task in sorted({e["task"] for e in summary}):
        mine = sorted((e for e in summary if e["task"] == task), key=lambda e: (e["keep_rate"], -e["recall"]))
        print(f"\n{task}")
        for e in mine:
            lo, hi = e["recall_ci"]
            clo, chi = e["complete_ci"]
            print(
                f"  keep {e['keep_rate']:<4g} n={e['n']:<4} recall {e['recall']:.3f} [{lo:.3f}, {hi:.3f}]  "
                f"complete {e['complete']:.2f} [{clo:.2f}, {chi:.2f}]  ctx {e['context_kept']:.3f}  {e['variant']}"
            )


def assemble(tokenizer: Any, ex: quality.Example) -> AssembledPrompt:
    """The prompt ``bench quality`` builds for ``ex`` (its instructions, default protection)."""
    passages = [Passage(text, id=pid) for pid, text in ex.passages]
    return prompt_lib.assemble(tokenizer, prompt_lib.build_segments(ex.question, passages, quality.INSTRUCTIONS))


def reevaluate(
    tokenizer: Any, todo: Sequence[quality.Example], path: Path, variants: Sequence[Variant], args: argparse.Namespace,
    draft: Any = None,
) -> int:
    """Rewrite the results file with ``variants`` recomputed from the capture cache; results of
    variants no longer in ``VARIANTS`` (renamed or dropped) are removed. A capture lacking one of
    ``--blocks`` gets it added (a draft pass); the others are read as they are."""
    index = {(ex.task, ex.id): (i, ex) for i, ex in enumerate(todo)}
    rows = load_rows(path)
    draft_name = capture_name(args, resolve_dtype(args.draft_dtype))
    updated = 0
    for row in rows:
        found = index.get((row["task"], row["id"]))
        if found is None:
            continue
        i, ex = found
        prompt = assemble(tokenizer, ex)
        where = cache_path(ex, draft_name, prompt)
        cached = load_capture(where)
        if cached is None:
            continue
        same_example([row], prompt, path)
        row["results"] = {key: v for key, v in row["results"].items() if key.rsplit("@", 1)[0] in VARIANTS}
        if not set(args.blocks) <= set(cached.get("blocks", [])):  # an older capture: add the blocks it lacks
            draft = draft or DraftModel.from_pretrained(args.draft, dtype=args.draft_dtype)
            cached = complete_rows(draft, prompt, cached, args.blocks)
            save_capture(cached, where)
        row["results"].update(evaluate(prompt, ex, cached, variants, args.keep_rates, args.seed * 1000 + i))
        updated += 1
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))
    print(f"re-evaluated {len(variants)} variants on {updated} of {len(rows)} examples")
    return 0


def add_task_args(p: argparse.ArgumentParser, *, tasks: Sequence[str], n: int, n_needle: int) -> None:
    """The options ``examples`` reads (the long tasks' too), for every bench that draws from it."""
    p.add_argument("--tasks", nargs="+", default=list(tasks))
    p.add_argument("--n", type=int, default=n, help="examples per task (HotpotQA, SQuAD)")
    p.add_argument("--n-needle", type=int, default=n_needle, help="needle examples, spread over lengths and depths")
    p.add_argument("--needle-lengths", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--squad-tokens", type=int, default=1024, help="SQuAD context length target (tokens)")
    long_context.add_arguments(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)


def open_results(args: argparse.Namespace, name: str) -> tuple[Path, list[dict[str, Any]]]:
    """A resumable bench's results file (``--out``, else ``name`` in the results folder) and its
    rows so far, with the process set up as every bench runs: offline, ``--threads``."""
    offline(args.threads)
    path = Path(args.out) if args.out else RESULTS_DIR / name
    return path, load_rows(path)


def _block_arg(value: str) -> str:
    try:
        block_layers(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="specprefill-rag bench evidence", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--main", default=DEFAULT_MAIN, help="tokenizer and prompt layout come from the main model")
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--draft-dtype", default="auto", choices=("auto", *DTYPES),
                   help="the draft's dtype (auto: loading.resolve_dtype); rows and cached captures record it, "
                   "and a results file holds one dtype")
    add_task_args(p, tasks=["hotpotqa", "squad", "needle", "near_miss"], n=200, n_needle=100)
    p.add_argument("--keep-rates", type=float, nargs="+", default=[0.1, 0.3])
    p.add_argument("--variants", nargs="*", default=None, help="names from VARIANTS (default: all)")
    p.add_argument("--blocks", nargs="+", default=list(BLOCKS), type=_block_arg,
                   help=f"look-ahead blocks to capture for new examples: {', '.join(BLOCKS)}, or an early-exit one "
                   "for other aggregated layers, <kind>@<layers> (e.g. upper0.3@9-14); default: those the "
                   "variants read. Fewer is faster, and variants reading a block not captured fail")
    p.add_argument("--candidate-layers", nargs="+", default=[], metavar="A-B",
                   help="also measure the default scoring with its early exit after layer B, aggregating layers "
                   "A..B (exit_candidates; capture their blocks: --blocks ... greedyupper0.3@A-B upper0.3@A-B)")
    p.add_argument("--summary", action="store_true", help="print the table of the results file and exit")
    p.add_argument(
        "--reevaluate",
        action="store_true",
        help="recompute the chosen --variants for examples already in the results file, from the cached draft "
        "rows (after a change of defaults or a new variant; no draft runs)",
    )
    p.add_argument("--top", type=int, default=None, help="--summary: best N variants per keep rate")
    p.add_argument("--paired", default=None, metavar="VARIANT",
                   help="--summary: each variant's paired difference to this one, on the examples holding both")
    p.add_argument("--against", nargs=2, default=None, metavar=("FILE", "VARIANT"),
                   help="--summary --paired: pair with VARIANT of another results FILE (e.g. another draft or "
                   "dtype), by example; it enters as 'FILE: VARIANT'")
    p.add_argument("--draft-window", type=int, default=None, metavar="TOKENS",
                   help="the draft's window for this run (default: its own); longer prompts are read in windows "
                   "of it, scored by the library default only")
    p.add_argument("--tiny", action="store_true", help="tiny random models (smoke run; scores mean nothing)")
    p.add_argument("--out", default=None, help="results file (default benchmarks/results/evidence.jsonl)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    for tag in args.candidate_layers:
        VARIANTS.update((v.name, v) for v in exit_candidates(tag))
    offline()
    path = Path(args.out) if args.out else RESULTS_DIR / ("evidence_tiny.jsonl" if args.tiny else "evidence.jsonl")
    if args.summary:
        rows = load_rows(path)
        if args.against:
            rows, args.paired = joined(rows, load_rows(Path(args.against[0])), *args.against)
        if args.paired:
            print_paired(paired(rows, args.paired, args.seed), args.paired)
            return 0
        print_summary(summarize(top_variants(rows, args.top) if args.top is not None else rows, args.seed))
        return 0
    offline(args.threads)
    variants = [VARIANTS[n] for n in args.variants] if args.variants else list(VARIANTS.values())
    variants += [v for tag in args.candidate_layers for v in exit_candidates(tag) if v not in variants]
    if args.tiny:
        engine = quality.build_engine(
            argparse.Namespace(tiny=True, main=args.main, draft=args.draft, lookahead=None, max_new_tokens=8)
        )
        tokenizer, draft = engine.tokenizer, engine.draft
    else:  # the draft scores; the main model's tokenizer lays out the prompt (same family)
        tokenizer = load_tokenizer(args.main)
        draft = None if args.reevaluate else DraftModel.from_pretrained(args.draft, dtype=args.draft_dtype)

    if draft is not None and args.draft_window:
        draft.model.config.max_position_embeddings = args.draft_window

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    todo = examples(args, count_tokens)
    if args.reevaluate:
        return reevaluate(tokenizer, todo, path, variants, args, draft)
    rows = load_rows(path)
    done = {(r["task"], r["id"]): r for r in rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    dtype = next(draft.model.parameters()).dtype if draft is not None else resolve_dtype(args.draft_dtype)
    if not args.tiny:
        same_dtype(rows, dtype, path)
    draft_name = capture_name(args, dtype)
    started = time.perf_counter()
    for ex in todo:  # before any work: a resume that would mix two examples under one id is refused
        if (ex.task, ex.id) in done:
            same_example([done[(ex.task, ex.id)]], assemble(tokenizer, ex), path)
    for i, ex in enumerate(todo):
        if (ex.task, ex.id) in done:
            continue
        prompt = assemble(tokenizer, ex)
        if draft is not None and not draft.fits(prompt.n_tokens, MAX_LOOKAHEAD):
            record = windowed_record(draft, prompt, ex, variants, args.keep_rates, args.seed * 1000 + i)
            if record is None:
                print(f"[{i + 1}/{len(todo)}] {ex.task} {ex.id[:16]}: {prompt.n_tokens} tokens, and the draft's "
                      f"window of {draft.max_context} cannot hold it in windows: skipped", flush=True)
                continue
            append_jsonl(path, record)
            print(f"[{i + 1}/{len(todo)}] {ex.task} {ex.id[:16]} n={prompt.n_tokens} read in {record['windows']} "
                  f"windows, draft {record['draft_s']:.1f} s, elapsed {time.perf_counter() - started:.0f} s",
                  flush=True)
            continue
        cached = cache_path(ex, draft_name, prompt)
        captured = load_capture(cached)
        if captured is not None:
            draft_s = None
            if draft is not None and not set(args.blocks) <= set(captured.get("blocks", [])):
                captured = complete_rows(draft, prompt, captured, args.blocks)
                save_capture(captured, cached)
        else:
            t0 = time.perf_counter()
            captured = capture_rows(draft, prompt, args.blocks)
            draft_s = time.perf_counter() - t0
            if not args.tiny:
                cached.parent.mkdir(parents=True, exist_ok=True)
                save_capture(captured, cached)
        results = evaluate(prompt, ex, captured, variants, args.keep_rates, args.seed * 1000 + i)
        record = {
            "task": ex.task, "id": ex.id, "n_prompt": prompt.n_tokens, "n_context": prompt.n_context,
            "prompt_sha": prompt_digest(prompt), "draft_s": draft_s, "draft_dtype": dtype_name(dtype),
            "results": results,
        }
        append_jsonl(path, record)
        print(f"[{i + 1}/{len(todo)}] {ex.task} {ex.id[:16]} n={prompt.n_tokens} "
              f"draft {draft_s or 0:.1f} s, elapsed {time.perf_counter() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    random.seed(0)
    sys.exit(main())
