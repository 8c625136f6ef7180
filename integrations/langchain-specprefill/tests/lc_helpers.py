"""Test helpers: a tiny random engine (no files), real SmolLM2-135M (draft = main), MiniLM embeddings."""

from __future__ import annotations

import functools
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from langchain_core.embeddings import Embeddings  # noqa: E402
from specprefill_rag import (  # noqa: E402
    DraftConfig,
    DraftModel,
    GenerationConfig,
    SelectionConfig,
    SpecPrefillConfig,
    SpecPrefillEngine,
)
from specprefill_rag.backends.transformers import TransformersBackend  # noqa: E402

SMOLLM = "smollm2-135m-instruct"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@functools.lru_cache(maxsize=1)
def tiny_engine() -> SpecPrefillEngine:
    """A 2-layer random Llama as draft and main, with a small trained BPE tokenizer."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, show_progress=False, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["The passkey is 48213. The sky is blue. Question: context user assistant"] * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, eos_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    spec = SpecPrefillConfig(
        draft=DraftConfig(lookahead=2),
        selection=SelectionConfig(keep_rate=0.3, min_prompt_tokens=32, chunk_size=8),
        generation=GenerationConfig(max_new_tokens=4),
    )
    backend = TransformersBackend(model, tokenizer, name="tiny-llama")
    return SpecPrefillEngine(backend, DraftModel(model, tokenizer), spec)


@functools.lru_cache(maxsize=1)
def smollm_engine() -> SpecPrefillEngine:
    """Real SmolLM2-135M-Instruct; one set of weights serves as draft and main."""
    from specprefill_rag.models import load_model

    model, tokenizer = load_model(SMOLLM)
    spec = SpecPrefillConfig(selection=SelectionConfig(keep_rate=0.5, min_prompt_tokens=128))
    return SpecPrefillEngine(TransformersBackend(model, tokenizer, name=SMOLLM), DraftModel(model, tokenizer), spec)


class MiniLMEmbeddings(Embeddings):
    """LangChain embeddings over the packaged all-MiniLM-L6-v2 (``load_embedder()``), offline."""

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        from specprefill_rag.retrieval import load_embedder

        vectors = load_embedder().encode(texts, normalize_embeddings=True, show_progress_bar=False)
        return [v.tolist() for v in vectors]

    def embed_query(self, text: str) -> list[float]:
        return self.embed_documents([text])[0]
