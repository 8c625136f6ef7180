"""Grammar-constrained decoding: an answer that must match a grammar, on every backend that can.

A grammar is Lark text in llguidance's dialect (https://github.com/guidance-ai/llguidance,
``docs/syntax.md``): rules, regex lexemes with ``&`` and ``~``, ``%json {schema}`` for a JSON
value, and ``<[id]>`` for one token by id. vLLM's structured outputs take the same text
(``structured_outputs.grammar``; ``declared`` heads it with ``%llguidance {}`` so that vLLM's
"auto" backend picks llguidance), so the vLLM backends forward it, and the transformers backend
masks the logits with llguidance itself (``GrammarMatcher``). llguidance comes with vLLM and is
a dependency of this package.

The engine builds one grammar per tool request (``toolcalls``): free text, then calls whose JSON
matches their tool's schema; ``json_grammar`` one for a JSON answer (structured output). A
template marker the tokenizer holds as one added token (Qwen's ``<tool_call>``) is matched as
that token (``token_literal``): llguidance never lets text lexemes produce an added token, so
client-looking text cannot open a call.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from .errors import ConfigError, InputError

__all__ = [
    "GrammarMatcher",
    "check_grammar",
    "check_support",
    "declared",
    "decodes_under_grammar",
    "json_grammar",
    "json_rule",
    "lark_string",
    "token_literal",
]

# How a JSON value is written: the separators Python's json.dumps and the Qwen/Hermes templates
# use, no other whitespace; schema keywords llguidance does not implement are ignored (the
# answer is validated against the schema after parsing anyway).
JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False, "lenient": True}

_TOKENIZERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_TOKENIZERS_LOCK = threading.Lock()


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf
    except ImportError as error:  # pragma: no cover - llguidance comes with vLLM and the dev install
        raise ConfigError("constrained decoding (a grammar, a forced tool call, a JSON schema) needs llguidance: "
                          "pip install llguidance") from error
    return llguidance


def json_rule(schema: Mapping[str, Any]) -> str:
    """The ``%json`` lexeme for ``schema`` written as ``JSON_STYLE`` (the schema's own
    ``x-guidance`` options win)."""
    if not isinstance(schema, Mapping):
        raise InputError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
    options = schema.get("x-guidance") or {}
    if not isinstance(options, Mapping):
        raise InputError(f"the JSON schema's x-guidance must be an object of options, got {options!r:.60}")
    styled = {**schema, "x-guidance": {**JSON_STYLE, **options}}
    try:
        return "%json " + json.dumps(styled, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise InputError(f"the JSON schema is not JSON: {error}") from None


def declared(grammar: str) -> str:
    """``grammar`` headed by ``%llguidance {}`` (llguidance's options block) unless it is already:
    vLLM's "auto" structured-output backend then hands it to llguidance, as xgrammar refuses the
    directive (xgrammar reads some Lark too, ``%json`` included, but not llguidance's JSON options
    nor ``&``, ``~`` and ``<[id]>``: the same text would decode differently)."""
    return grammar if grammar.lstrip().startswith("%llguidance") else "%llguidance {}\n" + grammar


def json_grammar(schema: Mapping[str, Any]) -> str:
    """A grammar whose answers are JSON values matching ``schema`` (a JSON schema)."""
    return declared(f"start: {json_rule(schema)}\n")


def lark_string(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def token_literal(tokenizer: Any, text: str) -> str:
    """Lark for ``text``: ``<[id]>`` when the tokenizer holds it as one added token (llguidance
    treats every added token as special: only a token reference matches it), else the string."""
    added: dict[str, int] = getattr(tokenizer, "get_added_vocab", dict)()
    return f"<[{added[text]}]>" if text in added else lark_string(text)


def _ll_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: Iterable[int]) -> Any:
    """llguidance's view of ``tokenizer`` (about a second to build: kept per tokenizer and size)."""
    llg = _llguidance()
    key = (vocab_size, tuple(sorted(eos_ids)))
    with _TOKENIZERS_LOCK:
        built = _TOKENIZERS.setdefault(tokenizer, {})
        if key not in built:
            try:
                built[key] = llg.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(key[1]) or None)
            except ValueError as error:
                raise ConfigError(f"constrained decoding needs a fast Hugging Face tokenizer: {error}") from None
        return built[key]


def decodes_under_grammar(backend: Any) -> bool:
    """Whether ``backend`` declares ``capabilities.grammar``."""
    return bool(getattr(getattr(backend, "capabilities", None), "grammar", False))


def check_support(backend: Any, grammar: str | None) -> None:
    """``ConfigError`` when a ``grammar`` is asked of a backend that would ignore it."""
    if grammar is not None and not decodes_under_grammar(backend):
        raise ConfigError(f"the {getattr(backend, 'name', 'this')} backend cannot decode under a grammar "
                          "(capabilities.grammar is False): drop GenerationConfig.grammar or use another backend")


def check_grammar(grammar: str, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int]) -> None:
    """``InputError`` naming llguidance's complaint when ``grammar`` does not compile for
    ``tokenizer``: before any model runs."""
    llg = _llguidance()
    problem = llg.LLMatcher.validate_grammar(llg.LLMatcher.grammar_from_lark(grammar),
                                             _ll_tokenizer(tokenizer, vocab_size, eos_ids))
    if problem:
        raise InputError(f"the grammar does not compile: {problem}")


class GrammarMatcher:
    """Masks a model's next-token logits to what ``grammar`` allows, token by token.

    ``mask(logits)`` sets every disallowed token's logit to -inf (end of text, one of
    ``eos_ids``, only once the grammar is complete); ``accept(token)`` advances; ``done`` is true
    when the grammar allows nothing more (the answer ends there).
    """

    def __init__(self, grammar: str, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int]) -> None:
        llg = _llguidance()
        self.vocab_size = vocab_size
        self._matcher = llg.LLMatcher(_ll_tokenizer(tokenizer, vocab_size, eos_ids),
                                      llg.LLMatcher.grammar_from_lark(grammar), log_level=0)
        if self._matcher.is_error():
            raise InputError(f"the grammar does not compile: {self._matcher.get_error()}")

    def allowed(self) -> torch.Tensor:
        """A boolean (vocab_size,) tensor: the tokens the grammar allows next."""
        bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        return torch.from_numpy(bits[: self.vocab_size].astype(bool))

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (vocab_size,) with the disallowed tokens at -inf (a new tensor)."""
        return logits.masked_fill(~self.allowed().to(logits.device), float("-inf"))

    def accept(self, token: int) -> None:
        """Advance past ``token`` (one ``mask`` allowed)."""
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"grammar refused token {token}: {self._matcher.get_error()}")

    @property
    def done(self) -> bool:
        return bool(self._matcher.is_stopped())
