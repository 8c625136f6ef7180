"""Tiny random models (smoke runs and tests; no files): a BPE tokenizer trained on the essays,
Llama models built from a config, an engine over them."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from benchmarks.lib.datasets import essay_text

__all__ = ["tiny_engine", "tiny_model", "tiny_tokenizer"]

_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer(corpus: Sequence[str]) -> Any:
    """A small byte-level BPE tokenizer with a ChatML template, trained in memory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        show_progress=False,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(list(corpus), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = _CHATML
    return fast


@functools.cache
def _essay_tokenizer() -> Any:
    words = essay_text()[:60_000]
    return tiny_tokenizer([words[i : i + 2000] for i in range(0, len(words), 2000)])


def tiny_model(vocab_size: int, layers: int, hidden: int, *, seed: int, max_positions: int = 32768) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return LlamaForCausalLM(config).eval()


def tiny_engine(config: Any = None, *, draft_layers: int = 2) -> Any:
    """A SpecPrefillEngine over two tiny random Llama models (draft ``draft_layers`` layers, main 4;
    a draft reads passages apart from 8 layers on: early exit below its last layer)."""
    from specprefill_rag import SpecPrefillEngine
    from specprefill_rag.backends.transformers import TransformersBackend
    from specprefill_rag.draft import DraftModel

    tokenizer = _essay_tokenizer()
    vocab = len(tokenizer)
    backend = TransformersBackend(tiny_model(vocab, 4, 128, seed=1), tokenizer, name="tiny-main")
    draft = DraftModel(tiny_model(vocab, draft_layers, 64, seed=2), tokenizer)
    return SpecPrefillEngine(backend, draft, config)
