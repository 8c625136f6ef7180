"""SpecPrefill RAG chatbot in the browser (Gradio).

Ask questions about the bundled station handbook or your own files; answers stream in, and
each one shows its time-to-first-token with SpecPrefill (and, optionally, with full prefill
side by side), the keep ratio, and the retrieved context with the tokens the main model
prefilled highlighted. Run from the repository root::

    .venv-web/bin/python -m examples.chatbot_web            # or: make web

Everything runs offline on the packaged models; SmolLM2-135M is the default so answers come
quickly on a CPU (``--models qwen`` for the Qwen2.5-Coder 0.5B → 1.5B pair).
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402

from examples.rag_chat import (  # noqa: E402
    MAX_UPLOAD_MB,
    MODEL_PAIRS,
    Answer,
    ChatSession,
    Turn,
    build_engine,
    build_retriever,
    format_timing,
    load_uploads,
)
from specprefill_rag import SpecPrefillEngine  # noqa: E402
from specprefill_rag.tools.retrieval import Retriever, demo_questions  # noqa: E402

logger = logging.getLogger("chatbot_web")

BACKENDS = {"Local (transformers)": "transformers", "vLLM server": "vllm_server"}
DOCS_BUNDLED = "Bundled handbook"
DOCS_UPLOADED = "My uploaded files"
KEPT_COLORS = {"kept": "#4ade80", "dropped": "#e5e7eb"}
CSS = "#kept .textfield { white-space: pre-wrap; line-height: 1.7; }"


@dataclass
class Models:
    """The one loaded engine (switching model pair or backend replaces it) and the bundled index."""

    args: argparse.Namespace
    engine_key: tuple[str, str, str] | None = None
    engine: SpecPrefillEngine | None = None
    bundled: Retriever | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def get_engine(self, pair_key: str, backend: str, url: str) -> SpecPrefillEngine:
        key = (pair_key, backend, url.strip() if backend != "transformers" else "")
        with self.lock:
            if self.engine is None or self.engine_key != key:
                self.engine = None  # free the old weights before loading new ones
                engine = build_engine(MODEL_PAIRS[pair_key], backend=backend, server_url=url)
                engine.warm_up()
                self.engine, self.engine_key = engine, key
            return self.engine

    def bundled_retriever(self) -> Retriever:
        with self.lock:
            if self.bundled is None:
                self.bundled = build_retriever()
            return self.bundled


def _text(content: Any) -> str:
    """Plain text of a chat message's content (a string or a list of parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "".join(part.get("text", "") if isinstance(part, dict) else str(part) for part in content)
    return str(content)


def _turns(chat: list[dict[str, Any]]) -> list[Turn]:
    """Finished question/answer pairs of the chat, warnings left out."""
    turns, question = [], None
    for message in chat:
        text = _text(message.get("content", ""))
        if message.get("role") == "user":
            question = text
        elif question is not None and not text.startswith("⚠️"):
            turns.append(Turn(question, text))
            question = None
    return turns


def highlighted(answer: Answer) -> list[tuple[str, str | None]]:
    """HighlightedText value: each passage's header, then its text in kept / dropped runs."""
    value: list[tuple[str, str | None]] = []
    for view in answer.views:
        header = f"[{view.rank}] {view.id} · kept {view.n_kept}/{view.n_tokens} tokens ({view.keep_ratio:.0%})\n"
        value.append((header, None))
        value.extend((text, "kept" if kept else "dropped") for text, kept in view.pieces)
        value.append(("\n\n", None))
    return value


def stats_markdown(answer: Answer, pair_key: str) -> str:
    r, t = answer.result, answer.result.timings
    lines = [f"**TTFT with SpecPrefill: {t.ttft_s:.2f} s**"]
    if t.draft_s is not None:
        lines[0] += f" (draft {t.draft_s:.2f} s + main prefill {t.prefill_s:.2f} s)"
    if answer.full is not None:
        full = answer.full.timings.ttft_s
        lines.append(f"**TTFT with full prefill: {full:.2f} s** · speedup {full / t.ttft_s:.2f}×")
    lines.append(
        f"**Keep ratio: {r.keep_ratio:.0%}** ({r.prefilled_tokens} of {r.prompt_tokens} prompt tokens prefilled)"
    )
    if not r.plan.speculated:
        lines.append("The prompt was prefilled whole (keep rate 100%, or too short to pay for the draft).")
    pair = MODEL_PAIRS[pair_key]
    if pair.main == pair.draft:
        lines.append(
            "_Draft and main are the same model here, so SpecPrefill cannot be faster (speedup ≤ 1/(r + k) "
            "with draft/main cost r = 1); pick the Qwen pair to see the speedup._"
        )
    return "  \n".join(lines)


def passages_markdown(answer: Answer) -> str:
    rows = ["| # | passage | kept / tokens | kept |", "|---|---|---|---|"]
    rows += [
        f"| {v.rank} | `{v.id}` | {v.n_kept} / {v.n_tokens} | {v.keep_ratio:.0%} |" for v in answer.views
    ]
    return "\n".join(rows)


def index_upload(files: list[str] | None, max_mb: float) -> Iterator[tuple[Any, ...]]:
    """Upload handler: (this session's Retriever, status line, documents choice) as it goes."""
    if not files:
        yield None, "", gr.update()
        return
    yield None, "Indexing the uploaded files …", gr.update()
    try:
        documents = load_uploads(files, max_mb=max_mb)
        retriever = build_retriever(documents)
    except (ValueError, OSError) as error:
        yield None, f"⚠️ {error}", gr.update(value=DOCS_BUNDLED)
        return
    except Exception as error:  # a bad file must not leave a traceback on the page
        logger.exception("indexing the upload failed")
        yield None, f"⚠️ could not index the upload ({type(error).__name__}: {error})", gr.update()
        return
    names = ", ".join(d.source for d in documents)
    yield retriever, f"Indexed {len(retriever.passages)} passages from {names}.", gr.update(value=DOCS_UPLOADED)


@dataclass(frozen=True)
class TurnSettings:
    """The settings a question is answered with, as the page's controls hold them (one control
    each, ``SettingsColumn.settings``); the defaults are the command line's."""

    keep_rate: float = 0.2  # fraction of the prompt's tokens prefilled
    top_k: float = 6  # passages retrieved (a slider's value: a float)
    compare_full: bool = True  # also measure the full-prefill TTFT
    pair_key: str = "smollm2"  # a MODEL_PAIRS key
    backend_label: str = "Local (transformers)"  # a BACKENDS key
    server_url: str = "http://127.0.0.1:8000"  # vLLM server URL (vLLM backend only)
    docs_mode: str = DOCS_BUNDLED  # DOCS_BUNDLED or DOCS_UPLOADED


def answer_turn(
    models: Models, message: str, history: list[dict[str, Any]], settings: TurnSettings,
    upload_retriever: Retriever | None,
) -> Iterator[tuple[Any, ...]]:
    """Ask handler: (chat, question box, status, timing, kept text, passages) as the answer streams."""
    history = list(history or [])
    unchanged = gr.update()
    if not (message or "").strip():
        yield history, message, "⚠️ The question is empty: type a question first.", *[unchanged] * 3
        return
    try:
        if settings.docs_mode == DOCS_UPLOADED:
            if upload_retriever is None:
                raise ValueError("no documents: upload .txt, .md or .pdf files first, or choose the bundled handbook")
            retriever = upload_retriever
        else:
            retriever = models.bundled_retriever()
        pair_key, backend = settings.pair_key, BACKENDS[settings.backend_label]
        if models.engine_key is None or models.engine_key[:2] != (pair_key, backend):
            yield history, "", "Loading models …", *[unchanged] * 3
        engine = models.get_engine(pair_key, backend, settings.server_url or "")
        session = ChatSession(
            engine, retriever, keep_rate=float(settings.keep_rate), top_k=int(settings.top_k),
            max_new_tokens=models.args.max_new_tokens,
        )
        stream, pending = session.ask(message, _turns(history))
        history += [{"role": "user", "content": message}, {"role": "assistant", "content": ""}]
        yield history, "", "Reading the context with the draft model …", *[unchanged] * 3
        for _ in stream:
            history[-1] = {"role": "assistant", "content": stream.text}
            yield history, "", "Answering …", *[unchanged] * 3
        if settings.compare_full:
            yield history, "", "Measuring the full-prefill TTFT for comparison …", *[unchanged] * 3
        answer = session.finish(stream, pending, compare_full=settings.compare_full)
        if not answer.result.text.strip():
            history[-1] = {"role": "assistant", "content": "(the model gave an empty answer)"}
        logger.info("answer: %s", format_timing(answer))
        yield history, "", "", stats_markdown(answer, pair_key), highlighted(answer), passages_markdown(answer)
    except (ValueError, RuntimeError, OSError) as error:  # BackendError is a RuntimeError
        yield history, message, f"⚠️ {error}", *[unchanged] * 3
    except Exception as error:  # never a traceback on the page; the log has it
        logger.exception("answering failed")
        yield history, message, f"⚠️ Unexpected error ({type(error).__name__}): {error}", *[unchanged] * 3


@dataclass(frozen=True)
class SettingsColumn:
    """The page's right-hand column: the documents (choice, upload, its status line) and the
    controls a question is answered with."""

    docs_mode: Any  # gr.Radio: DOCS_BUNDLED or DOCS_UPLOADED
    upload: Any  # gr.File
    upload_status: Any  # gr.Markdown
    settings: dict[str, Any]  # ``TurnSettings`` field name → the control that holds it


def settings_column(args: argparse.Namespace) -> SettingsColumn:
    """The right-hand column's controls (call inside a ``gr.Column``), set to the command line's values."""
    docs_mode = gr.Radio([DOCS_BUNDLED, DOCS_UPLOADED], value=DOCS_BUNDLED, label="Documents")
    upload = gr.File(
        label=f"Upload .txt / .md / .pdf (≤ {args.max_upload_mb:g} MB in all)",
        file_count="multiple", file_types=[".txt", ".md", ".pdf"], elem_id="upload",
    )
    upload_status = gr.Markdown(elem_id="upload-status")
    keep_rate = gr.Slider(0.05, 1.0, value=args.keep_rate, step=0.05, label="Keep rate", elem_id="keep")
    compare = gr.Checkbox(
        value=args.compare_full, label="Also measure full-prefill TTFT", elem_id="compare"
    )
    with gr.Accordion("Models and backend", open=False):
        pair = gr.Dropdown(
            [(p.label, p.key) for p in MODEL_PAIRS.values()], value=args.models, label="Draft → main"
        )
        backend = gr.Radio(list(BACKENDS), value=args.backend_label, label="Main model backend")
        url = gr.Textbox(value=args.server_url, label="vLLM server URL (vLLM backend only)")
        top_k = gr.Slider(1, max(16, args.top_k), value=args.top_k, step=1, label="Passages retrieved")
    settings = {"keep_rate": keep_rate, "top_k": top_k, "compare_full": compare, "pair_key": pair,
                "backend_label": backend, "server_url": url, "docs_mode": docs_mode}
    return SettingsColumn(docs_mode, upload, upload_status, settings)


def build_app(models: Models) -> gr.Blocks:
    """The page: chat and answer stats on the left, documents and settings on the right
    (``settings_column``), the kept/dropped context below; handlers are ``index_upload`` and
    ``answer_turn``."""
    args = models.args
    example = demo_questions()[0].question
    with gr.Blocks(title="SpecPrefill RAG chat") as app:
        gr.Markdown(
            "# SpecPrefill RAG chat\nA small **draft** model reads the retrieved context and picks the tokens "
            "that matter; the **main** model prefills only those, at their original positions. "
            "Green text below an answer is what the main model prefilled."
        )
        uploaded = gr.State(None)  # this browser session's Retriever over uploaded files
        with gr.Row():
            with gr.Column(scale=3):
                chat = gr.Chatbot(label="Chat", elem_id="chat", height=380)
                with gr.Row():
                    question = gr.Textbox(
                        placeholder=f"Ask about the documents, e.g. {example}", show_label=False,
                        elem_id="question", scale=5, submit_btn=False,
                    )
                    ask = gr.Button("Ask", variant="primary", elem_id="ask", scale=1)
                status = gr.Markdown(elem_id="status")
                timing = gr.Markdown(elem_id="timing")
            with gr.Column(scale=2):
                side = settings_column(args)
        kept = gr.HighlightedText(
            label="Retrieved context: kept vs dropped tokens", elem_id="kept", color_map=KEPT_COLORS,
            show_legend=True, show_inline_category=False,
        )
        passages = gr.Markdown(elem_id="passages")

        def on_upload(files: list[str] | None) -> Iterator[tuple[Any, ...]]:
            yield from index_upload(files, args.max_upload_mb)

        def respond(message: str, history: list[dict[str, Any]], upload_retriever: Retriever | None,
                    *values: Any) -> Iterator[tuple[Any, ...]]:
            settings = TurnSettings(**dict(zip(side.settings, values, strict=True)))
            yield from answer_turn(models, message, history, settings, upload_retriever)

        side.upload.change(on_upload, [side.upload], [uploaded, side.upload_status, side.docs_mode])
        inputs = [question, chat, uploaded, *side.settings.values()]
        outputs = [chat, question, status, timing, kept, passages]
        ask.click(respond, inputs, outputs)
        question.submit(respond, inputs, outputs)
    return app


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m examples.chatbot_web", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--models", choices=sorted(MODEL_PAIRS), default=TurnSettings.pair_key,
        help="smollm2: SmolLM2-135M as draft and main (fast); qwen: Qwen2.5-Coder 0.5B → 1.5B (default: %(default)s)")
    add("--backend", choices=sorted(set(BACKENDS.values())), default="transformers", help="main-model backend")
    add("--server-url", default=TurnSettings.server_url, help="vLLM server URL for --backend vllm_server")
    add("--keep-rate", type=float, default=TurnSettings.keep_rate,
        help="fraction of prompt tokens prefilled (default: %(default)s)")
    add("--top-k", type=int, default=TurnSettings.top_k,
        help="passages retrieved per question (default: %(default)s)")
    add("--max-new-tokens", type=int, default=96, help="answer length limit (default: %(default)s)")
    add("--no-compare-full", dest="compare_full", action="store_false",
        help="do not measure the full-prefill TTFT by default")
    add("--max-upload-mb", type=float, default=MAX_UPLOAD_MB, help="upload size limit (default: %(default)s)")
    add("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    add("--port", type=int, default=7860, help="port (default: %(default)s)")
    add("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)
    args.backend_label = {v: k for k, v in BACKENDS.items()}[args.backend]
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    models = Models(args)
    print("Loading the retriever and the models (the first run fetches and converts them) …", flush=True)
    models.bundled_retriever()
    try:
        models.get_engine(args.models, args.backend, args.server_url)
    except (ValueError, RuntimeError, OSError) as error:  # e.g. vLLM server down: the UI says so when asked
        print(f"warning: {error}", flush=True)
    theme = gr.themes.Soft(font=["ui-sans-serif", "system-ui", "sans-serif"], font_mono=["ui-monospace", "monospace"])
    build_app(models).queue().launch(
        server_name=args.host, server_port=args.port, theme=theme, css=CSS,
        # Gradio's own hard limit; the readable limit is checked when indexing (load_uploads).
        max_file_size=f"{max(args.max_upload_mb * 10, 10):g}mb", footer_links=[], ssr_mode=False,
    )


if __name__ == "__main__":
    main()
