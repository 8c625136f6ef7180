"""Shared fixtures: a tiny in-memory tokenizer with a chat template and tiny random models.

Nothing here reads files: the tokenizer is trained on a few sentences and the models are
built from configs with seeded random weights.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Context: passages retrieved for the question. Answer the question using the context.",
    "Question: what is the passkey? The passkey is 48213. Remember it.",
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.",
    "Alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho.",
    "0123456789 [1] [2] [3] system user assistant instructions be concise",
]


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, show_progress=False,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHATML
    return fast


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


def make_model(family: str, vocab_size: int, *, seed: int = 0, layers: int = 3, eos_token_id: int | None = None):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        eos_token_id=eos_token_id, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, rope_theta=10000.0))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, rope_theta=10000.0))
    else:
        raise ValueError(family)
    # Sharper attention than the default init, so scores are not nearly uniform.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "q_proj.weight" in name or "k_proj.weight" in name:
                p.mul_(8.0)
    return model.eval()


@pytest.fixture(params=["llama", "qwen2"])
def family(request):
    return request.param
