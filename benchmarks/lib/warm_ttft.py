"""``gpu_ttft``'s warm cells: SpecPrefill's TTFT when the draft has read the prompt's passages before.

``gpu_ttft`` times every length cold: the draft reads every token of the prompt. RAG traffic
re-sends passages (a follow-up over one retrieved set, popular documents, a corpus read at
indexing time), and a draft that reads each passage apart keeps its reading
(``DraftConfig.passages``). Per length of each pair, a RAG prompt built through segments (a system
part, passages of up to ``PASSAGE_TOKENS`` tokens, a question), in the words of an in-memory
tokenizer whose ids fit every shape's vocabulary, so the draft lays its passages out as the
engine does (``DraftScorer.layout``), is sent per repetition and keep rate as:

- ``apart_cold``: both stores emptied: the draft reads each passage apart, keeps it, and reads
  the rest of the prompt (what a passage costs on first sight);
- ``apart_warm``: the same request, the prefix store emptied: every passage comes from the
  passage store; the head (system part, template) and the question are read (an indexed corpus);
- ``follow_up``: another question over the same passages: the prefix store holds the prompt up
  to its question, which alone is read (a chat's next turn);

beside the main model's full prefill of the same prompt, before or after them in turn. The
reading is the draft config's own (``PassageReading()`` where it reads jointly), the score memo
off, both stores bounded at ``STORE_BYTES`` at least. Per keep rate and case: median TTFT,
speedup = full TTFT / TTFT, r = the draft's seconds / full TTFT, what the stores served; per
length, the passage store's bytes per cached token.

On the GPU machine, one short command (the read-once issue's target: 1B → 8B shapes, keep 10%,
warm ≥ 4× at 4k; about two minutes on an H100 after the start):

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python -m benchmarks.suites.gpu_ttft \\
        --pairs llama-1b-8b --lengths 2048 4096 8192 --no-extras --out $OUT/gpu_ttft_warm.json
    python -m benchmarks.suites.gpu_ttft --tiny --no-extras     # the same on the CPU, tiny shapes
"""

from __future__ import annotations

import dataclasses
import functools
import random
import statistics
from typing import Any

from benchmarks.lib.gpu_timing import TimedPrompt, full_prefill_s, pruned_ttft

__all__ = ["CASES", "STORE_BYTES", "rag_prompts", "reading_config", "warm_length"]

CASES = ("apart_cold", "apart_warm", "follow_up")
PASSAGE_TOKENS = 512  # gpu_ttft's passage size (a shorter prompt gets n // 8, at least 16)
INSTRUCTION_WORDS = 24
QUESTION_WORDS = 48
STORE_BYTES = 4 << 30  # the stores' least budget: a 32k prompt's reading fits
WORDS = ("ice core station radio north field camp team snow wind power fuel ship crew data server archive glacier "
         "hut boat sled lamp map rock depth drill sample storm coast shelf stove water").split()


@functools.cache
def tokenizer() -> Any:
    """A byte-level BPE with a ChatML template, trained in memory on ``WORDS`` (each one token)."""
    from specprefill_rag.testing import tiny_tokenizer

    return tiny_tokenizer([" ".join(WORDS)] * 8, vocab_size=400)


def _words(rng: random.Random, count: int) -> str:
    tok = tokenizer()
    single = [w for w in WORDS if len(tok.encode(" " + w, add_special_tokens=False)) == 1]
    return " ".join(rng.choice(single) for _ in range(count))


def rag_prompts(n: int, seed: int) -> tuple[Any, Any]:
    """Two assembled RAG prompts of ``n`` tokens (at most: a word may not fit; where the head and
    one word already pass ``n``, that shortest prompt) over the same system part and passages
    (``PASSAGE_TOKENS`` words each, the last one filling the length), with two questions."""
    from specprefill_rag import prompt as prompt_lib

    tok, rng = tokenizer(), random.Random(seed)
    system, questions = _words(rng, INSTRUCTION_WORDS), (_words(rng, QUESTION_WORDS), _words(rng, QUESTION_WORDS))
    size = min(PASSAGE_TOKENS, max(16, n // 8))

    def length(passages: list[str]) -> int:
        return int(prompt_lib.assemble(tok, prompt_lib.build_segments(questions[0], passages, system)).n_tokens)

    one = length([_words(rng, size)])
    per = length([_words(rng, size)] * 2) - one  # a passage and its separator
    passages = [_words(rng, size) for _ in range(max(1, (n - one + per) // per))]
    while len(passages) > 1 and length(passages) > n:
        passages.pop()
    rest = n - length(passages)  # filled by a last, shorter passage, or by the last one's growing
    if rest > per - size + 8:
        passages.append(_words(rng, rest - (per - size)))
    elif rest > 0:
        passages[-1] += " " + _words(rng, rest)
    while length(passages) > n and " " in passages[-1]:  # one word left: the shortest prompt
        passages[-1] = passages[-1].rsplit(" ", 1)[0]
    asked, other = (prompt_lib.assemble(tok, prompt_lib.build_segments(q, passages, system)) for q in questions)
    return asked, other


def reading_config(config: Any) -> Any:
    """``config`` reading passages apart (its own ``PassageReading``, else the default one), the
    score memo off, the prefix store on and both stores bounded at ``STORE_BYTES`` at least."""
    from specprefill_rag import PassageReading

    return dataclasses.replace(config, memo_entries=0, passages=config.passages or PassageReading(),
                               prefix_cache_entries=max(config.prefix_cache_entries, 2),
                               prefix_cache_bytes=max(config.prefix_cache_bytes, STORE_BYTES),
                               passage_store_bytes=max(config.passage_store_bytes, STORE_BYTES))


def _layouts(draft: Any, config: Any, prompts: tuple[Any, ...]) -> list[Any]:
    """Where each prompt's passages sit, as the engine's scorer lays them out (``DraftScorer.layout``:
    the anchor is the system part's canonical head). A draft model of the same weights with the
    prompts' tokenizer only renders the anchor: it runs nothing."""
    from specprefill_rag.draft import DraftModel, DraftScorer

    scorer = DraftScorer(DraftModel(draft.model, tokenizer(), config), tokenizer(), config)
    return [scorer.layout(scorer.render(prompt)) for prompt in prompts]


def _timed(prompt: Any) -> TimedPrompt:
    from specprefill_rag.types import SegmentKind

    return TimedPrompt(prompt.token_ids, prompt.protected, prompt.segment_index,
                       prompt.positions_of(SegmentKind.QUESTION))


def _one_rep(draft: Any, main: Any, prompts: tuple[Any, ...], layouts: list[Any], keep: float, config: Any
             ) -> dict[str, Any]:
    """One repetition's three cases at ``keep`` (module docstring), in order."""
    asked, other = (_timed(p) for p in prompts)
    draft.passages.clear()
    draft.prefixes.clear()
    out = {"apart_cold": pruned_ttft(draft, main, asked, keep, config, layouts[0])}
    draft.prefixes.clear()
    out["apart_warm"] = pruned_ttft(draft, main, asked, keep, config, layouts[0])
    out["follow_up"] = pruned_ttft(draft, main, other, keep, config, layouts[1])
    return out


def warm_length(draft: Any, main: Any, n: int, keep_rates: list[float], reps: int) -> dict[str, Any]:
    """The warm cells at ``n`` tokens (at most), ``reps`` repetitions: the prompt, the reading,
    whether every warm request found every passage stored, the store's bytes per cached token
    and one cell per keep rate; both stores emptied after."""
    prompts = rag_prompts(n, seed=n)
    config = reading_config(draft.config)
    layouts = _layouts(draft, config, prompts)
    full: list[float] = []
    raw: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for rep in range(reps):
        if rep % 2:
            full.append(full_prefill_s(main, prompts[0].token_ids))
        for keep in keep_rates:
            for case, row in _one_rep(draft, main, prompts, layouts, keep, config).items():
                raw.setdefault((case, keep), []).append(row)
        if not rep % 2:
            full.append(full_prefill_s(main, prompts[0].token_ids))
    units = layouts[0].units if layouts[0] is not None else ()
    warm = [r for keep in keep_rates for r in raw[("apart_warm", keep)]]
    row = {"n_tokens": int(prompts[0].n_tokens), "passages": len(units),
           "passage_tokens": sum(end - start for start, end in units),
           "reading": dataclasses.asdict(config.passages), "full_ttft_s": statistics.median(full),
           "reads_apart": bool(units) and all(r["passages_cached"] == len(units) for r in warm),
           "store_bytes_per_token": _bytes_per_token(draft, config, prompts[0], layouts[0]),
           "cells": [_cell(keep, raw, statistics.median(full)) for keep in keep_rates]}
    draft.passages.clear()
    draft.prefixes.clear()
    return row


def _bytes_per_token(draft: Any, config: Any, prompt: Any, layout: Any) -> float | None:
    """What the passage store holds per passage token once ``prompt``'s passages are read alone."""
    if layout is None:
        return None
    draft.passages.clear()
    draft.read_passages(prompt.token_ids, layout, config)
    tokens = sum(end - start for start, end in layout.units)
    return draft.passages.nbytes / tokens if tokens and draft.passages.nbytes else None


def _cell(keep: float, raw: dict[tuple[str, float], list[dict[str, Any]]], full_s: float) -> dict[str, Any]:
    """One keep rate: per case the median TTFT and its parts, the speedup over the full prefill,
    r, and what the stores served (medians over the repetitions)."""
    med = statistics.median
    cell: dict[str, Any] = {"keep_rate": keep, "ttft_full_s": full_s}
    for case in CASES:
        rows = raw[(case, keep)]
        ttft, draft_s = med(r["ttft_s"] for r in rows), med(r["draft_s"] for r in rows)
        cell[case] = {"ttft_s": ttft, "draft_s": draft_s, "selection_s": med(r["selection_s"] for r in rows),
                      "prefill_s": med(r["prefill_s"] for r in rows), "keep_ratio": med(r["keep_ratio"] for r in rows),
                      "speedup": full_s / ttft, "r": draft_s / full_s,
                      **{k: med(r[k] for r in rows) for k in ("passages_cached", "passages_read", "cached_tokens")}}
    return cell


def report(label: str, row: dict[str, Any]) -> None:
    """One line per keep rate: each case's TTFT, speedup and r beside the full prefill."""
    ms = 1e3
    per_token = row["store_bytes_per_token"]
    store = "" if per_token is None else f"; store {per_token / 1024:.1f} KiB per passage token"
    for c in row["cells"]:
        cases = " | ".join(f"{case} {c[case]['ttft_s'] * ms:.0f} ms ({c[case]['speedup']:.2f}x, r {c[case]['r']:.3f})"
                           for case in CASES)
        print(f"[{label}] {row['n_tokens']} tokens, {row['passages']} passages read apart, keep {c['keep_rate']:.0%}:"
              f" full {c['ttft_full_s'] * ms:.0f} ms | {cases}{store}", flush=True)
