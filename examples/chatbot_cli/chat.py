"""SpecPrefill RAG chat in the terminal.

Answers stream token by token; after each answer one line sums up the time to first token,
the draft/main split, and how much of the prompt the main model prefilled. Run from the
repository root::

    .venv/bin/python -m examples.chatbot_cli            # or: make chat

Commands: /keep 0.2 (keep rate), /full on|off (also measure full-prefill TTFT), /top 6
(passages retrieved), /passages (what the last answer kept), /help, /quit.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from examples.rag_chat import (  # noqa: E402
    MODEL_PAIRS,
    Answer,
    ChatSession,
    build_engine,
    build_retriever,
    format_timing,
    load_uploads,
)

HELP = """commands:
  /keep 0.2      keep rate: fraction of prompt tokens the main model prefills, in (0, 1]
  /full on|off   also measure the full-prefill TTFT after each answer
  /top 6         passages retrieved per question
  /passages      what the last answer kept, passage by passage
  /help          this text
  /quit          leave (Ctrl-D works too)"""


class Chat:
    """The read-eval-print loop around a ``ChatSession``; ``out`` is where it prints."""

    def __init__(self, session: ChatSession, *, compare_full: bool, out: Callable[..., None] = print) -> None:
        self.session = session
        self.compare_full = compare_full
        self.out = out
        self.last: Answer | None = None

    def command(self, line: str) -> bool:
        """Run one /command; False means quit."""
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name in ("/quit", "/exit", "/q"):
            return False
        if name == "/help":
            self.out(HELP)
        elif name == "/keep":
            try:
                self.session.set_keep_rate(float(arg))
                self.out(f"keep rate: {self.session.keep_rate:g}")
            except ValueError:
                self.out(f"error: /keep needs a number in (0, 1], e.g. /keep 0.2 (got {arg!r})")
        elif name == "/full":
            if arg not in ("on", "off"):
                self.out("error: use /full on or /full off")
            else:
                self.compare_full = arg == "on"
                self.out(f"full-prefill comparison: {arg}")
        elif name == "/top":
            if not arg.isdigit() or int(arg) < 1:
                self.out(f"error: /top needs a whole number >= 1 (got {arg!r})")
            else:
                self.session.top_k = int(arg)
                self.out(f"passages per question: {self.session.top_k}")
        elif name == "/passages":
            self.show_passages()
        else:
            self.out(f"error: unknown command {name!r}; /help lists the commands")
        return True

    def show_passages(self) -> None:
        if self.last is None:
            self.out("no answer yet: ask a question first")
            return
        for view in self.last.views:
            bar = "#" * round(20 * view.keep_ratio)
            self.out(f"{view.rank:2d}. {str(view.id):<30} {view.n_kept:4d}/{view.n_tokens:<4d} {bar}")
            kept = " … ".join(" ".join(text.split()) for text, k in view.pieces if k and text.strip())
            if kept:
                self.out(f"    kept: {kept[:300]}{' …' if len(kept) > 300 else ''}")

    def ask(self, question: str) -> None:
        try:
            stream, pending = self.session.ask(question)
        except ValueError as error:
            self.out(f"error: {error}")
            return
        self.out("bot> ", end="", flush=True)
        try:
            for delta in stream:
                self.out(delta, end="", flush=True)
        except KeyboardInterrupt:
            stream.close()
            self.out("\n(stopped)")
            return
        self.out()
        if self.compare_full:
            self.out("(measuring full-prefill TTFT …)", flush=True)
        self.last = self.session.finish(stream, pending, compare_full=self.compare_full)
        self.out(f"[{format_timing(self.last)}]", flush=True)

    def run(self, read: Callable[[str], str] = input) -> None:
        self.out("Ask about the documents. /help lists the commands, /quit leaves.", flush=True)
        while True:
            try:
                line = read("you> ").strip()
            except (EOFError, KeyboardInterrupt):
                self.out()
                break
            if not line:
                self.out("error: the question is empty: type a question, or /help")
                continue
            if line.startswith("/"):
                if not self.command(line):
                    break
                continue
            try:
                self.ask(line)
            except Exception as error:  # one failed answer must not end the chat
                logging.getLogger("chatbot_cli").debug("answer failed", exc_info=True)
                self.out(f"\nerror: {type(error).__name__}: {error}")
        self.out("bye")


def _documents(path: str | None) -> list | None:  # type: ignore[type-arg]
    if path is None:
        return None
    from specprefill_rag.tools.retrieval import load_documents

    root = Path(path).expanduser()
    if root.is_dir():
        return load_documents(root)
    if not root.exists():
        raise ValueError(f"no such file or directory: {root}")
    return load_uploads([root])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m examples.chatbot_cli", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--models", choices=sorted(MODEL_PAIRS), default="smollm2",
        help="smollm2: SmolLM2-135M as draft and main (fast); qwen: Qwen2.5-Coder 0.5B → 1.5B (default: %(default)s)")
    add("--backend", default="transformers", help="main-model backend (transformers or vllm_server)")
    add("--server-url", default="http://127.0.0.1:8000", help="vLLM server URL for --backend vllm_server")
    add("--docs", default=None, help="a directory of .md/.txt files, or one .md/.txt/.pdf file (default: bundled)")
    add("--keep-rate", type=float, default=0.2, help="fraction of prompt tokens prefilled (default: %(default)s)")
    add("--top-k", type=int, default=6, help="passages retrieved per question (default: %(default)s)")
    add("--max-new-tokens", type=int, default=96, help="answer length limit (default: %(default)s)")
    add("--full", action="store_true", help="also measure the full-prefill TTFT after each answer")
    add("--threads", type=int, default=None, help="torch CPU threads")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Loading weights" bars in the chat
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    pair = MODEL_PAIRS[args.models]
    print(f"Loading documents and models ({pair.label}) …", flush=True)
    try:
        retriever = build_retriever(_documents(args.docs))
        engine = build_engine(pair, backend=args.backend, server_url=args.server_url)
        engine.warm_up()
        session = ChatSession(
            engine, retriever, keep_rate=args.keep_rate, top_k=args.top_k, max_new_tokens=args.max_new_tokens
        )
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"Ready: {len(retriever.passages)} passages, keep rate {args.keep_rate:g}.", flush=True)
    Chat(session, compare_full=args.full).run()
    return 0
