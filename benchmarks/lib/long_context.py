"""Long-context tasks for ``bench evidence`` and ``bench quality``: the short tasks' questions in
the 4k–32k-token prompts RAG applications send (20 retrieved chunks of 300–500 tokens are 6–10k).

Each task is built at every length asked and named by it (``hotpotqa_4k``, ``multikey_8k``, ...),
so the summaries report quality per task and length:

    hotpotqa_long   a HotpotQA question's 10 paragraphs among other questions' paragraphs up to the
                    length, shuffled (LongBench's construction); evidence: its supporting sentences
    squad_long      a SQuAD v2 answer paragraph among other paragraphs (``datasets.load_squad``)
    needle_long     the needle at the length, over depths (``datasets.needle_examples``)
    multikey        a RULER-style multi-key needle: several needles whose keys differ in one digit
                    pair ("saffron-47", "saffron-74", ...), spread through the essays; one is asked
    near_miss_long  the near-miss cases (an answer passage, distractors of the same entity type and
                    attribute) spread through HotpotQA paragraphs up to the length

Seeded (the same examples every run for one seed) and disjoint from the short tasks' samples
where they draw from the same data: padding comes from questions never asked.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from benchmarks.lib import datasets

TASKS = ("hotpotqa_long", "squad_long", "needle_long", "multikey", "near_miss_long")
MULTIKEY_NEEDLES = 4  # needles per multi-key example, one asked
_PAD_QUESTIONS = 400  # HotpotQA questions whose paragraphs pad the long prompts (never asked)


def task_name(task: str, length: int) -> str:
    """``hotpotqa_long`` at 4096 → ``hotpotqa_4k`` (``multikey`` → ``multikey_4k``)."""
    return f"{task.removesuffix('_long')}_{length // 1024}k"


def pad_example(ex: datasets.Example, pad: Sequence[str], target: int, count_tokens: Any, rng: random.Random,
                task: str) -> datasets.Example:
    """``ex`` with texts of ``pad`` added (in order) until its passages hold about ``target``
    tokens, all passages shuffled; evidence and key spans follow their passages."""
    texts = [text for _, text in ex.passages]
    total = sum(count_tokens(t) for t in texts)
    added: list[str] = []
    for text in pad:
        if total >= target:
            break
        added.append(text)
        total += count_tokens(text)
    passages = [*ex.passages, *((f"pad{i}", text) for i, text in enumerate(added))]
    order = list(range(len(passages)))
    rng.shuffle(order)
    where = {old: new for new, old in enumerate(order)}
    return replace(
        ex, task=task, passages=tuple(passages[i] for i in order),
        evidence=tuple((where[i], a, b) for i, a, b in ex.evidence),
        key=tuple((where[i], a, b) for i, a, b in ex.key),
        meta={**ex.meta, "context_tokens": total, "n_passages": len(passages)},
    )


def _hotpot_pool(seed: int, asked: int) -> tuple[list[datasets.Example], list[str]]:
    """(``asked`` questions, paragraphs of ``_PAD_QUESTIONS`` other questions), one seeded sample."""
    sample = datasets.load_hotpotqa(asked + _PAD_QUESTIONS, seed)
    pad = [text for ex in sample[asked:] for _, text in ex.passages]
    return sample[:asked], list(dict.fromkeys(pad))


def hotpotqa_long(n: int, lengths: Sequence[int], seed: int, count_tokens: Any) -> list[datasets.Example]:
    questions, pad = _hotpot_pool(seed, n)
    out = []
    for length in lengths:
        rng = random.Random(f"{seed}-hotpotqa-{length}")
        for ex in questions:
            own = set(t for _, t in ex.passages)
            others = [t for t in pad if t not in own]
            rng.shuffle(others)
            out.append(pad_example(ex, others, length, count_tokens, rng, task_name("hotpotqa_long", length)))
    return out


def near_miss_long(lengths: Sequence[int], seed: int, count_tokens: Any) -> list[datasets.Example]:
    _, pad = _hotpot_pool(seed + 1, 0)
    out = []
    for length in lengths:
        rng = random.Random(f"{seed}-near-miss-{length}")
        for ex in datasets.load_near_miss():
            others = list(pad)
            rng.shuffle(others)
            out.append(pad_example(ex, others, length, count_tokens, rng, task_name("near_miss_long", length)))
    return out


def _multikey_keys(rng: random.Random) -> list[str]:
    """``MULTIKEY_NEEDLES`` keys of one stem that differ only in their two digits: swapped, or
    one digit off ("saffron-47", "saffron-74", "saffron-48", "saffron-57"), all distinct."""
    stem = rng.choice(datasets.NEEDLE_KEYS)
    a, b = rng.sample(range(1, 9), 2)  # a != b, and a + 1, b + 1 stay single digits
    return [f"{stem}-{d}" for d in (f"{a}{b}", f"{b}{a}", f"{a}{b + 1}", f"{a + 1}{b}")]


def multikey(lengths: Sequence[int], depths: Sequence[float], seed: int, count_tokens: Any
             ) -> list[datasets.Example]:
    """One example per (length, depth): the asked needle at ``depth``, the others spread evenly
    through the rest of the essay haystack; each value a distinct 7-digit number."""
    rng = random.Random(f"{seed}-multikey")
    out = []
    for base in datasets.needle_examples(lengths, depths, seed, count_tokens):
        length, depth = base.meta["length"], base.meta["depth"]
        home, _, _ = base.evidence[0]
        keys = _multikey_keys(rng)
        values = [str(v) for v in rng.sample(range(1_000_000, 10_000_000), len(keys))]
        asked = rng.randrange(len(keys))
        passages = [text for _, text in base.passages]
        old_needle = passages[home][base.evidence[0][1]: base.evidence[0][2]]
        needles = [datasets.NEEDLE.format(key=k, value=v) for k, v in zip(keys, values, strict=True)]
        passages[home] = passages[home].replace(old_needle, needles[asked])
        others = [i for i in range(len(keys)) if i != asked]
        slots = [round((j + 0.5) * len(passages) / len(others)) % len(passages) for j in range(len(others))]
        for i, slot in zip(others, slots, strict=True):
            slot = slot if slot != home else (slot + 1) % len(passages)
            passages[slot] = f"{passages[slot]} {needles[i]}"
        at = passages[home].index(needles[asked])
        at_value = at + needles[asked].index(values[asked])
        out.append(datasets.Example(
            task_name("multikey", length), f"multikey-{length}-{depth:g}",
            datasets.NEEDLE_QUESTION.format(key=keys[asked]),
            tuple((f"s{i}", p) for i, p in enumerate(passages)), (values[asked],),
            {"length": length, "depth": depth, "keys": keys, "asked": asked,
             "distractor_answers": [v for i, v in enumerate(values) if i != asked]},
            evidence=((home, at, at + len(needles[asked])),),
            key=((home, at_value, at_value + len(values[asked])),),
        ))
    return out


def add_arguments(parser: Any) -> None:
    """The long tasks' options, the same in ``bench evidence`` and ``bench quality``."""
    parser.add_argument("--long-lengths", type=int, nargs="+", default=[4096, 8192],
                        help=f"prompt lengths (tokens) of the long tasks: {', '.join(TASKS)} in --tasks")
    parser.add_argument("--n-long", type=int, default=30, help="questions per long HotpotQA / SQuAD task and length")


def long_examples(tasks: Sequence[str], lengths: Sequence[int], n: int, depths: Sequence[float], seed: int,
                  count_tokens: Any) -> list[datasets.Example]:
    """The long tasks named in ``tasks`` (others are ignored) at every length: ``n`` questions
    each for HotpotQA and SQuAD, the needles over ``depths``, every near-miss case."""
    out: list[datasets.Example] = []
    if "hotpotqa_long" in tasks:
        out += hotpotqa_long(n, lengths, seed, count_tokens)
    if "squad_long" in tasks:
        for length in lengths:
            out += [replace(ex, task=task_name("squad_long", length))
                    for ex in datasets.load_squad(n, seed, length, count_tokens)]
    if "needle_long" in tasks:
        out += [replace(ex, task=task_name("needle_long", ex.meta["length"]))
                for ex in datasets.needle_examples(lengths, depths, seed, count_tokens)]
    if "multikey" in tasks:
        out += multikey(lengths, depths, seed, count_tokens)
    if "near_miss_long" in tasks:
        out += near_miss_long(lengths, seed, count_tokens)
    return out
