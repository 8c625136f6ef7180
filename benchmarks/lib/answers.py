"""How a generated answer is scored against the accepted ones: SQuAD's exact match and F1 for
HotpotQA and SQuAD, the number in the answer for the needle and the multi-key haystack, an
accepted answer anywhere in it for the near-miss set (a near-identical distractor's counting as
wrong). A long task (``hotpotqa_4k``, ``benchmarks.lib.long_context``) is scored as its short one.
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Sequence
from typing import Any


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


def metric_of(task: str) -> str:
    return "acc" if task_kind(task) in ("needle", "multikey", "near_miss") else "f1"
