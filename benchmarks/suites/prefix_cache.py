"""SpecPrefill with vLLM's prefix cache: a shared system prompt, and a retry, on the ``vllm_server`` backend.

One vLLM server with the plugin and prefix caching on (started here unless ``--vllm-url``), the
packaged pair (Qwen2.5-Coder 0.5B draft → 1.5B main). Every request of the run carries the same
system prompt of about ``--system-tokens`` tokens (instructions and worked examples, as RAG
applications send), then a HotpotQA question's 10 paragraphs padded with other questions'
paragraphs to about ``--passage-tokens`` tokens. Per example, side by side:

    sys_full     full prefill, the system prompt already cached (warm)
    sys_spec     SpecPrefill at --keep, warm, the draft runs (score memo off)
    retry        the same SpecPrefill request again with the score memo on: memo hit, and vLLM
                 holds every block of the plan
    nosys_full   the same passages and question without the system prompt, cold (own salt)
    nosys_spec   SpecPrefill of that prompt, cold

For each: TTFT, the main model's prefill time, and the prompt tokens vLLM served from its cache
(the delta of its own ``vllm:prefix_cache_hits`` counter; requests run one at a time). The run
order of sys_full / sys_spec alternates per example. The vLLM server started here and the draft run
in one precision, ``--dtype`` (auto: the fastest the machine offers; ``--draft-dtype`` overrides
the draft's); each row records both (``main_dtype``, ``draft_dtype``). Then ``--chats`` RAG chats of
``--chat-turns`` turns (a new question and its passages each turn, earlier turns as chat
messages): per turn, full prefill, SpecPrefill with the history whole (the default,
``SelectionConfig.protect_history``) and SpecPrefill with it prunable, all warm, and SpecPrefill
cold, whose answer the warm one must equal (``prefix_cache_chat.jsonl``). ``--chat-answers long``
asks for answers of three to five sentences, so the history grows by paragraphs
(``prefix_cache_chat-long.jsonl``). Resumable: one JSON line per example.

    specprefill-rag bench prefix_cache --n 8                # → benchmarks/results/prefix_cache.jsonl
    specprefill-rag bench prefix_cache --summary
    specprefill-rag bench prefix_cache --n 0 --chats 4 --chat-answers long   # chats with long answers
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import re
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.lib.machine import add_dtype_arg, model_dtype_name, resolved_dtype, served_dtype
from benchmarks.lib.prefix_cache_summary import (
    SCENARIOS,
    chat_lines,
    print_summary,
    summarize,
    summarize_chat,
    summary_lines,
)
from benchmarks.lib.results import RESULTS_DIR, ROOT, append_jsonl
from benchmarks.suites import quality
from benchmarks.suites.evidence import load_rows
from benchmarks.suites.gateway_load import free_port
from specprefill_rag.loading import DEFAULT_DRAFT, DEFAULT_MAIN, DTYPES

# The tables of the results files live in benchmarks/lib/prefix_cache_summary.py; the report and
# the tests read them through this module too.
__all__ = ["chat_lines", "main", "run_chat", "summarize", "summarize_chat", "summary_lines"]

READY_TIMEOUT_S = 900.0
INSTRUCTIONS = (
    "You are the research assistant of a reference library. Answer the user's question from the "
    "context passages only. Give the shortest answer that is complete: a name, a date, a number or "
    "a short phrase, never a sentence of explanation. When two passages disagree, prefer the one "
    "that names its source. When the passages do not contain the answer, say \"not in the context\". "
    "Questions may need two facts from two different passages: find the bridge entity first. "
    "Here are worked examples of the expected answers."
)
LONG_INSTRUCTIONS = (
    "You are the research assistant of a reference library. Answer the user's question from the "
    "context passages only, in three to five sentences: first the answer, then which passages support "
    "it and how the facts connect. When the passages do not contain the answer, say so and say what "
    "they do contain. Later questions may refer to your earlier answers. "
    "Here are worked examples of the facts such answers rest on."
)
CHAT_MODES = ("full", "spec", "spec_pruned")  # warm, per turn; then "spec_cold" checks the warm answer


def count(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def system_prompt(tokenizer: Any, target: int, pool: Sequence[quality.Example], instructions: str = INSTRUCTIONS
                  ) -> str:
    """Instructions plus worked examples (other HotpotQA questions with their supporting sentences)
    up to about ``target`` tokens: the same for every request of the run."""
    parts = [instructions]
    for k, ex in enumerate(pool):
        facts = " ".join(ex.passages[i][1][a:b] for i, a, b in ex.evidence)
        parts.append(f"Example {k + 1}.\nContext: {facts}\nQuestion: {ex.question}\nAnswer: {ex.answers[0]}")
        if count(tokenizer, "\n\n".join(parts)) >= target:
            break
    return "\n\n".join(parts)


def passages_of(ex: quality.Example, pad: Sequence[quality.Example], tokenizer: Any, target: int, seed: int
                ) -> list[str]:
    """The example's paragraphs plus other questions' paragraphs up to ``target`` tokens, shuffled."""
    texts = [text for _, text in ex.passages]
    rng = random.Random(seed)
    others = [text for other in pad if other.id != ex.id for _, text in other.passages]
    rng.shuffle(others)
    total = sum(count(tokenizer, t) for t in texts)
    for text in others:
        if total >= target:
            break
        texts.append(text)
        total += count(tokenizer, text)
    rng.shuffle(texts)
    return texts


def hits_in(metrics: str) -> float:
    """vLLM's ``vllm:prefix_cache_hits`` counter in a ``/metrics`` text, summed over its labels
    (prompt tokens served from the prefix cache)."""
    found = re.findall(r"^vllm:prefix_cache_hits_total(?:\{[^}]*\})? ([0-9.e+]+)$", metrics, re.M)
    return sum(float(v) for v in found)


def cache_hits(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as response:
        return hits_in(response.read().decode())


def measure_segments(engine: Any, url: str, segments: list[Any], salt: str | None, mode: str, keep: float,
                     max_new_tokens: int | None = None) -> dict[str, Any]:
    """One request, alone: TTFT, the main model's prefill time, what vLLM served from its cache.
    ``mode``: "full", "spec", or "spec_pruned" (SpecPrefill with the chat's earlier turns prunable,
    ``SelectionConfig.protect_history=False``); ``max_new_tokens``: the answer's limit for this
    request (default: the engine's)."""
    engine.backend.cache_salt = salt
    before = cache_hits(url)
    options: dict[str, Any] = {"mode": "full"} if mode == "full" else {"keep_rate": keep}
    if mode == "spec_pruned":
        options["selection"] = dataclasses.replace(engine.config.selection, keep_rate=keep, protect_history=False)
    if max_new_tokens is not None:
        options["generation"] = engine.config.generation.with_overrides(max_new_tokens=max_new_tokens)
    res = engine.generate(segments, **options)
    return {"ttft_s": res.timings.ttft_s, "prefill_s": res.timings.prefill_s, "draft_s": res.timings.draft_s,
            "prompt_tokens": res.prompt_tokens, "sent_tokens": res.prefilled_tokens,
            "cached_tokens": int(cache_hits(url) - before), "memo_hit": res.draft_memo_hit,
            "draft_cached_tokens": res.draft_cached_tokens, "text": res.text, "answer_tokens": res.generated_tokens}


def run_example(engines: dict[str, Any], url: str, ex: quality.Example, passages: list[str], system: str,
                index: int, keep: float) -> dict[str, Any]:
    from specprefill_rag.prompt import build_segments

    cold = f"bench-prefix-{ex.id}-{time.time_ns()}"
    order = ["sys_full", "sys_spec"] if index % 2 == 0 else ["sys_spec", "sys_full"]
    with_system = list(build_segments(ex.question, passages, system))
    without = list(build_segments(ex.question, passages, ""))
    runs = {
        "sys_full": lambda: measure_segments(engines["off"], url, with_system, None, "full", keep),
        "sys_spec": lambda: measure_segments(engines["memo"], url, with_system, None, "spec", keep),
        "retry": lambda: measure_segments(engines["memo"], url, with_system, None, "spec", keep),
        "nosys_full": lambda: measure_segments(engines["off"], url, without, cold + "-f", "full", keep),
        "nosys_spec": lambda: measure_segments(engines["off"], url, without, cold + "-s", "spec", keep),
    }
    out = {name: runs[name]() for name in [*order, "retry", "nosys_full", "nosys_spec"]}
    return {"id": ex.id, "keep": keep, **out}


@dataclass(frozen=True)
class Chat:
    """One RAG chat to measure: its id, its turns (the question, that turn's passages), its system
    prompt, and its index in the run (which rotates the order of the modes)."""

    id: str
    turns: Sequence[tuple[str, list[str]]]
    system: str
    index: int = 0


def run_chat(engine: Any, url: str, chat: Chat, keep: float, answer_tokens: int | None = None) -> dict[str, Any]:
    """A RAG chat, new passages each turn: full prefill, SpecPrefill with the history whole (the
    default) and SpecPrefill with it prunable, of every turn's prompt (all with the prefix cache;
    order rotating), and SpecPrefill of it cold (a salt of its own) to check the warm answer.
    History: the full-prefill answers (``answer_tokens`` long at most), as the chat's earlier turns."""
    from specprefill_rag.prompt import chat_segments

    conversation = chat.id
    history: list[tuple[str, str]] = [("system", chat.system)]
    out = []
    for t, (question, passages) in enumerate(chat.turns):
        segments = list(chat_segments([*history, ("user", question)], passages))
        shift = (chat.index + t) % len(CHAT_MODES)
        order = [*CHAT_MODES[shift:], *CHAT_MODES[:shift]]
        got = {mode: measure_segments(engine, url, segments, None, mode, keep,
                                      answer_tokens if mode == "full" else None) for mode in order}
        got["spec_cold"] = measure_segments(engine, url, segments, f"cold-{conversation}-{t}-{time.time_ns()}",
                                            "spec", keep)
        out.append({"turn": t + 1, **got, "same_as_cold": got["spec"]["text"] == got["spec_cold"]["text"]})
        history += [("user", question), ("assistant", got["full"]["text"])]
    return {"id": conversation, "keep": keep, "turns": out}


def build_engines(args: argparse.Namespace, url: str) -> dict[str, Any]:
    from specprefill_rag import GenerationConfig, SelectionConfig, SpecPrefillConfig, SpecPrefillEngine
    from specprefill_rag.backends import create_backend
    from specprefill_rag.draft import DraftModel

    config = SpecPrefillConfig(selection=SelectionConfig(min_prompt_tokens=0),
                               generation=GenerationConfig(max_new_tokens=args.max_new_tokens))
    main = create_backend("vllm_server", args.main, base_url=url, read_timeout=READY_TIMEOUT_S)
    draft = DraftModel.from_pretrained(args.draft, config.draft, dtype=args.draft_dtype or args.dtype)
    off = dataclasses.replace(config, draft=dataclasses.replace(config.draft, memo_entries=0))
    return {"memo": SpecPrefillEngine(main, draft, config), "off": SpecPrefillEngine(main, draft, off)}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specprefill-rag bench prefix_cache", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--main", default=DEFAULT_MAIN)
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    add_dtype_arg(p, whose="vLLM's main model (a server started here) and the draft")
    p.add_argument("--draft-dtype", default=None, choices=("auto", *DTYPES),
                   help="the draft's dtype, overriding --dtype for it (default: --dtype); each row records it")
    p.add_argument("--server-dtype", default=None, choices=DTYPES,
                   help="with --vllm-url: the dtype that server runs the main model in (vLLM's --dtype; it does not "
                   "report it), recorded in each row as main_dtype")
    p.add_argument("--vllm-url", default=None, help="a running vLLM server with the plugin and prefix caching on")
    p.add_argument("--n", type=int, default=8, help="HotpotQA questions")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--keep", type=float, default=0.1)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--passage-tokens", type=int, default=2048)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--chats", type=int, default=2, help="4-turn RAG chats after the questions (0: none)")
    p.add_argument("--chat-turns", type=int, default=4)
    p.add_argument("--chat-answers", choices=("short", "long"), default="short",
                   help="long: the chats' system prompt asks for answers of three to five sentences, and the "
                   "full-prefill answer that becomes the history may run to --chat-answer-tokens")
    p.add_argument("--chat-answer-tokens", type=int, default=160, help="with --chat-answers long")
    p.add_argument("--threads", type=int, default=None, help="torch threads of the draft")
    p.add_argument("--summary", action="store_true", help="print the table of the results file and exit")
    p.add_argument("--out", default=None, help="results file (default benchmarks/results/prefix_cache.jsonl)")
    return p.parse_args(argv)


@dataclass(frozen=True)
class ChatSource:
    """What a run's chats are drawn from: their questions (``--chat-turns`` per chat, in order),
    the other questions' paragraphs that pad each turn's passages, the tokenizer that counts them,
    and the chats' system prompt."""

    questions: Sequence[quality.Example]
    pad: Sequence[quality.Example]
    tokenizer: Any
    system: str


def run_chats(args: argparse.Namespace, engine: Any, url: str, path: Path, source: ChatSource,
              main_dtype: str | None = None) -> None:
    """``args.chats`` conversations of ``args.chat_turns`` HotpotQA questions each (resumable)."""
    done = {r["id"] for r in load_rows(path)}
    for c in range(args.chats):
        exs = source.questions[c * args.chat_turns: (c + 1) * args.chat_turns]
        conversation = "+".join(ex.id for ex in exs)
        if conversation in done:
            continue
        turns = [(ex.question, passages_of(ex, source.pad, source.tokenizer, args.passage_tokens, args.seed + 100 + c))
                 for ex in exs]
        row = run_chat(engine, url, Chat(conversation, turns, source.system, c), args.keep,
                       args.chat_answer_tokens if args.chat_answers == "long" else None)
        row["draft_dtype"], row["main_dtype"] = model_dtype_name(engine.draft.model), main_dtype
        append_jsonl(path, row)
        print(f"[chat {c + 1}/{args.chats}] " + "  ".join(
            f"turn {t['turn']}: full {t['full']['ttft_s']:.1f}s spec {t['spec']['ttft_s']:.1f}s" for t in row["turns"]),
            flush=True)


def start_server(args: argparse.Namespace) -> Any:
    """A vLLM server of the main model with prefix caching on, started here (no --vllm-url)."""
    from specprefill_rag.tools.vllm_process import LaunchOptions, VLLMServer

    logs = ROOT / "benchmarks" / ".cache" / "prefix_cache"
    logs.mkdir(parents=True, exist_ok=True)
    launch = LaunchOptions(port=free_port(), log_path=logs / "vllm.log",
                           env={**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
    server = VLLMServer(args.main, launch=launch, max_model_len=4096, extra_args=["--enable-prefix-caching"],
                        dtype=args.dtype)
    print("starting vLLM ...", flush=True)
    server.start(timeout=READY_TIMEOUT_S)
    return server


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    from specprefill_rag.loading import load_tokenizer, resolve_model_dir

    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = Path(args.out) if args.out else RESULTS_DIR / "prefix_cache.jsonl"
    chat_path = path.with_name(path.stem + ("_chat.jsonl" if args.chat_answers == "short" else "_chat-long.jsonl"))
    if args.summary:
        print_summary(summarize(load_rows(path)))
        print("\n".join(chat_lines(summarize_chat(load_rows(chat_path)))))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(resolve_model_dir(args.main))
    sample = quality.load_hotpotqa(args.n + 60 + args.chats * args.chat_turns, args.seed)
    todo, pool, chat_pool = sample[: args.n], sample[args.n: args.n + 60], sample[args.n + 60:]
    system = system_prompt(tokenizer, args.system_tokens, pool[:40])
    system_tokens = count(tokenizer, system)
    done = {r["id"] for r in load_rows(path)}
    server = start_server(args) if args.vllm_url is None else None
    url = server.url if server else args.vllm_url.rstrip("/")
    asked = served_dtype(server) if server else args.server_dtype  # as vLLM logs it, or as declared
    main_dtype = resolved_dtype(asked) if asked else None
    try:
        engines = build_engines(args, url)
        for options in ({"mode": "full"}, {"keep_rate": 0.5}):  # caches the system prompt, warms the draft
            engines["off"].generate("Warm-up?", ["Warm-up passage. " * 40], instructions=system, **options)
        for i, ex in enumerate(todo):
            if ex.id in done:
                continue
            passages = passages_of(ex, pool[40:], tokenizer, args.passage_tokens, args.seed + i)
            row = run_example(engines, url, ex, passages, system, i, args.keep)
            row["system_tokens"], row["draft_dtype"] = system_tokens, model_dtype_name(engines["off"].draft.model)
            row["main_dtype"] = main_dtype
            append_jsonl(path, row)
            print(f"[{i + 1}/{len(todo)}] " + "  ".join(
                f"{name} {row[name]['ttft_s']:.1f}s cached {row[name]['cached_tokens']}" for name in SCENARIOS),
                flush=True)
        chat_system = system if args.chat_answers == "short" else system_prompt(
            tokenizer, args.system_tokens, pool[:40], LONG_INSTRUCTIONS)
        run_chats(args, engines["off"], url, chat_path, ChatSource(chat_pool, pool[40:], tokenizer, chat_system),
                  main_dtype)
    finally:
        if server is not None:
            server.stop()
    print_summary(summarize(load_rows(path)))
    print("\n".join(chat_lines(summarize_chat(load_rows(chat_path)))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
