"""A serving workload where passages recur (``bench serving --mix reuse``), and what the gateway
served of it.

Real RAG traffic re-sends passages: popular questions are asked by many users, neighbouring
questions retrieve the same documents, and a chat's follow-up re-sends its retrieved set. The mix
draws requests in *sessions* from a pool of questions over the demo collection (the demo
questions, then one question per section heading of the handbook):

- a session opens with a pool question drawn by popularity (the question of rank i with weight
  1 / (i + 1) ** ``zipf``; 0: uniform; the ranks are a seeded shuffle of the pool) and its
  top-``top_k`` retrieved passages;
- ``follow_ups`` more questions (others of the pool, uniform) re-send that retrieved set, as a
  chat's next turns; session j's k-th follow-up arrives after session j + k's opening, so a user
  reads an answer before asking again.

Everything is drawn from one ``random.Random(seed)``: the same seed, pool and retriever give the
same requests. ``mix_stats`` says how much recurs; ``served`` sums what the gateway's answers say
its draft read from its stores.
"""

from __future__ import annotations

import http.client
import json
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ANSWER_FACTS", "ReuseMix", "draw", "mix_stats", "question_pool", "served", "warm_corpus"]

Retrieve = Callable[[str, int], list[str]]  # (question, k) -> the top-k passages' texts, best first
# What a gateway answer's ``specprefill`` object says its draft found in its stores.
ANSWER_FACTS = ("passages_cached", "passages_read", "draft_cached_tokens")
_HEADING = re.compile(r"^#{2,6}\s+(.*\S)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class ReuseMix:
    """How a reuse mix is drawn (module docstring)."""

    pool: int = 32  # questions in the pool
    zipf: float = 1.0  # popularity exponent of the openers' draw (0: uniform)
    follow_ups: int = 1  # questions per session after its opener, over the same retrieved set
    top_k: int = 8  # passages retrieved per session
    seed: int = 0

    def __post_init__(self) -> None:
        if self.pool < 2 or self.top_k < 1 or self.follow_ups < 0 or self.zipf < 0:
            raise ValueError(f"need pool >= 2, top_k >= 1, follow_ups >= 0 and zipf >= 0, got {self}")


def question_pool(size: int) -> list[str]:
    """``size`` questions over the demo collection: the demo questions, then one per section
    heading of the handbook ("What does the station handbook say about <heading>?"), taken
    evenly across the documents; ``ValueError`` when the collection has fewer."""
    from specprefill_rag.tools.retrieval import demo_documents, demo_questions

    asked = [q.question for q in demo_questions()]
    headings = list(dict.fromkeys(h for doc in demo_documents() for h in _HEADING.findall(doc.text)))
    need = size - len(asked)
    if need > len(headings):
        raise ValueError(f"the demo collection holds {len(asked) + len(headings)} questions, not {size}")
    spread = [headings[i * len(headings) // need] for i in range(need)] if need > 0 else []
    return (asked + [f"What does the station handbook say about {h}?" for h in spread])[:size]


def _sessions(mix: ReuseMix, pool: Sequence[str], rng: random.Random, count: int) -> list[list[int]]:
    """``count`` sessions as pool indices: the opener, then its follow-ups."""
    ranked = list(range(len(pool)))
    rng.shuffle(ranked)  # popularity is not the pool's order
    weights = [1.0 / (rank + 1) ** mix.zipf for rank in range(len(pool))]
    out = []
    for _ in range(count):
        opener = ranked[rng.choices(range(len(pool)), weights)[0]]
        others = [i for i in range(len(pool)) if i != opener]
        out.append([opener, *(rng.choice(others) for _ in range(mix.follow_ups))])
    return out


def draw(mix: ReuseMix, pool: Sequence[str], retrieve: Retrieve, n: int) -> list[dict[str, Any]]:
    """``n`` requests of the mix in arrival order: ``question``, ``passages`` (its session's
    retrieved set), ``session`` and ``turn`` (0: the opener). Whole sessions are drawn; the last
    follow-ups are cut where ``n`` is not a multiple of the session size."""
    if n < 1 or len(pool) < 2:
        raise ValueError(f"need n >= 1 and a pool of two questions or more, got n={n}, pool of {len(pool)}")
    rng = random.Random(mix.seed)
    size = 1 + mix.follow_ups
    sessions = _sessions(mix, pool, rng, -(-n // size))
    retrieved: dict[int, list[str]] = {}
    slots: list[list[dict[str, Any]]] = [[] for _ in range(len(sessions) + mix.follow_ups)]
    for j, asked in enumerate(sessions):
        passages = retrieved.setdefault(asked[0], retrieve(pool[asked[0]], mix.top_k))
        for turn, q in enumerate(asked):
            slots[j + turn].append({"question": pool[q], "passages": passages, "session": j, "turn": turn})
    for slot in slots:  # in a slot, the opener first, then the follow-ups due
        slot.sort(key=lambda item: item["turn"] > 0)
    return [item for slot in slots for item in slot][:n]


def mix_stats(items: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """How much of a mix recurs: passages drawn (counted once per request), distinct passages,
    the fewest and mean draws of a passage, the mean sessions that retrieve a passage, and the
    share of passage draws a store that kept every reading would serve (``repeat_share``)."""
    draws: dict[str, int] = {}
    sessions: dict[str, set[int]] = {}
    for item in items:
        for p in item["passages"]:
            draws[p] = draws.get(p, 0) + 1
            sessions.setdefault(p, set()).add(item.get("session", -1))
    total = sum(draws.values())
    return {
        "requests": len(items), "sessions": len({item.get("session") for item in items}),
        "distinct_prompts": len({(item["question"], tuple(item["passages"])) for item in items}),
        "passage_draws": total, "distinct_passages": len(draws),
        "min_draws": min(draws.values(), default=0), "mean_draws": total / len(draws) if draws else 0.0,
        "mean_sessions_per_passage": sum(map(len, sessions.values())) / len(sessions) if sessions else 0.0,
        "repeat_share": 1.0 - len(draws) / total if total else 0.0,
    }


def warm_corpus(port: int, passages: Sequence[str], instructions: str) -> dict[str, Any]:
    """``POST /v1/passages`` of ``passages`` under ``instructions`` to the gateway on ``port``,
    before any request: ``{"warmed": True, "passages", "found", "read", "seconds"}``;
    ``RuntimeError`` when the gateway refuses."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    began = time.perf_counter()
    try:
        conn.request("POST", "/v1/passages", json.dumps({"passages": list(passages), "instructions": instructions}),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        body = response.read().decode()
    finally:
        conn.close()
    if response.status != 200:
        raise RuntimeError(f"POST /v1/passages answered {response.status}: {body[:300]}")
    got = json.loads(body)
    return {"warmed": True, "passages": len(passages), "found": got.get("found"), "read": got.get("read"),
            "seconds": time.perf_counter() - began}


def served(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per gateway side and rate, what its answers say the draft found in its stores: passages
    served by the passage store and read now (sums), the share served, and the mean prompt
    tokens the prefix store held (``draft_cached_tokens``)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        if row.get("status") == 200 and any(row.get(k) is not None for k in ANSWER_FACTS):
            groups.setdefault((row["side"], str(row["rate"])), []).append(row)
    for (side, rate), mine in groups.items():
        cached, read = (sum(r.get(k) or 0 for r in mine) for k in ANSWER_FACTS[:2])
        out.setdefault(side, {})[rate] = {
            "answers": len(mine), "passages_cached": cached, "passages_read": read,
            "cached_share": cached / (cached + read) if cached + read else None,
            "mean_draft_cached_tokens": sum(r.get("draft_cached_tokens") or 0 for r in mine) / len(mine),
        }
    return out
