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

A grammar is compiled once per request and kept (``compile_grammar``: by its digest, the
tokenizer and the request's cache namespace, so tenants share nothing, not even timing), the
engine's check before any model runs and the backend's matcher using the same compilation. It
is refused with a ``GrammarError`` (a 400 at the gateway) when llguidance does not compile it,
when compiling takes over ``COMPILE_BUDGET_S`` of CPU, or when a dry run finds no first token
(llguidance's own limits passed on the first masks: too many Earley items, a lexer that runs out
of states); what still fails while decoding is a ``GrammarError`` too, never a crash. Every
message quotes llguidance's reason through ``reason``: its errors quote the grammar, which holds
the client's schema. A JSON schema is checked against ``schema_limits`` before it
becomes a grammar (``json_rule``).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .errors import ConfigError, GrammarError, InputError, excerpt
from .schema_limits import SchemaChecker

__all__ = [
    "COMPILE_BUDGET_S",
    "CompiledGrammar",
    "GrammarMatcher",
    "check_grammar",
    "compile_grammar",
    "check_support",
    "declared",
    "decodes_under_grammar",
    "json_grammar",
    "json_rule",
    "lark_string",
    "reason",
    "token_literal",
]

# How a JSON value is written: the separators Python's json.dumps and the Qwen/Hermes templates
# use, no other whitespace; schema keywords llguidance does not implement are ignored (the
# answer is validated against the schema after parsing anyway).
JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False, "lenient": True}

COMPILE_BUDGET_S = 1.0  # CPU seconds compiling one grammar (and its dry run) may take; more is a refusal
CACHE_SIZE = 64  # compiled grammars (and refusals) kept, least recently used dropped first
DRY_RUN_FORCED = 64  # forced tokens the dry run follows before its second mask

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


def json_rule(schema: Mapping[str, Any], *, checked: bool = False) -> str:
    """The ``%json`` lexeme for ``schema`` written as ``JSON_STYLE`` (the schema's own
    ``x-guidance`` options win). ``SchemaError`` when it passes ``schema_limits`` (unless the
    caller ``checked`` it already, naming its own fields)."""
    if not isinstance(schema, Mapping):
        raise InputError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
    if not checked:
        SchemaChecker().check(dict(schema))
    options = schema.get("x-guidance") or {}
    if not isinstance(options, Mapping):
        raise InputError(f"the JSON schema's x-guidance must be an object of options, got {options!r:.60}")
    styled = {**schema, "x-guidance": {**JSON_STYLE, **options}}
    try:
        return "%json " + json.dumps(styled, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise InputError(f"the JSON schema is not JSON: {excerpt(str(error))}") from None


def declared(grammar: str) -> str:
    """``grammar`` headed by ``%llguidance {}`` (llguidance's options block) unless it is already:
    vLLM's "auto" structured-output backend then hands it to llguidance, as xgrammar refuses the
    directive (xgrammar reads some Lark too, ``%json`` included, but not llguidance's JSON options
    nor ``&``, ``~`` and ``<[id]>``: the same text would decode differently)."""
    return grammar if grammar.lstrip().startswith("%llguidance") else "%llguidance {}\n" + grammar


def json_grammar(schema: Mapping[str, Any], *, checked: bool = False) -> str:
    """A grammar whose answers are JSON values matching ``schema`` (a JSON schema; ``json_rule``)."""
    return declared(f"start: {json_rule(schema, checked=checked)}\n")


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


@dataclass(frozen=True)
class CompiledGrammar:
    """A grammar compiled for one tokenizer: llguidance's matcher at the start of an answer, never
    advanced itself (``fork`` gives each answer its own copy, sharing the compiled lexer)."""

    matcher: Any  # llguidance.LLMatcher
    ll_tokenizer: Any  # the llguidance tokenizer it was compiled for
    cpu_s: float  # CPU seconds compiling and the dry run took

    def fork(self) -> Any:
        return self.matcher.deep_copy()


class _Compiled:
    """The compiled grammars (and refusals, as their message) by key, least recently used dropped
    first. An entry holds its llguidance tokenizer: one with another tokenizer is a miss."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: OrderedDict[tuple[int, str, str], tuple[Any, CompiledGrammar | str]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[int, str, str], ll_tokenizer: Any) -> CompiledGrammar | str | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry[0] is not ll_tokenizer:
                return None
            self._entries.move_to_end(key)
            return entry[1]

    def put(self, key: tuple[int, str, str], ll_tokenizer: Any, value: CompiledGrammar | str) -> None:
        with self._lock:
            self._entries[key] = (ll_tokenizer, value)
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


_COMPILED = _Compiled(CACHE_SIZE)


def compile_grammar(grammar: str, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int], *,
                    namespace: str | None = None, param: str | None = None) -> CompiledGrammar:
    """``grammar`` compiled for ``tokenizer``, from the cache when this namespace (a request's
    ``cache_salt``) compiled it before; ``GrammarError`` (naming ``param``) when llguidance refuses
    it, compiling overruns ``COMPILE_BUDGET_S`` or the dry run finds no first token. Refusals are
    kept too: the same grammar sent again is refused at once."""
    llg = _llguidance()
    ll_tokenizer = _ll_tokenizer(tokenizer, vocab_size, eos_ids)
    digest = hashlib.sha256(grammar.encode("utf-8", "surrogatepass")).hexdigest()
    key = (id(ll_tokenizer), namespace or "", digest)
    found = _COMPILED.get(key, ll_tokenizer)
    if found is None:
        found = _compile(llg, ll_tokenizer, grammar)
        _COMPILED.put(key, ll_tokenizer, found)
    if isinstance(found, str):
        raise GrammarError(found, param)
    return found


_LISTING = re.compile(r"\n\s*\d+ \| ")  # where llguidance's error starts quoting the grammar's lines


def reason(message: str) -> str:
    """llguidance's error ``message`` as a client is told it: without the grammar's lines it quotes
    (the client's schema, whole), its white space folded, at most ``errors.QUOTE_CHARS`` characters."""
    found = _LISTING.search(message)
    text = (message[:found.start()] if found else message).replace("<non-verbose/>", "")
    return excerpt(" ".join(text.split()))


def _limits(llg: Any) -> Any:
    """llguidance's limits (its defaults, as vLLM's), without the parser state and grammar text in
    its errors."""
    return llg.LLParserLimits(verbose_errors=False)


def _compile(llg: Any, ll_tokenizer: Any, grammar: str) -> CompiledGrammar | str:
    """A compiled grammar, or why it is refused."""
    started = time.thread_time()  # llguidance compiles in the calling thread (without the GIL)
    try:
        matcher = llg.LLMatcher(ll_tokenizer, llg.LLMatcher.grammar_from_lark(grammar), log_level=0,
                                limits=_limits(llg))
    except (ValueError, RuntimeError) as error:
        return f"the grammar does not compile: {reason(str(error))}"
    if matcher.is_error():
        return f"the grammar does not compile: {reason(matcher.get_error())}"
    problem = _dry_run(matcher)
    cpu_s = time.thread_time() - started
    if problem is not None:
        return problem
    if cpu_s > COMPILE_BUDGET_S:
        return (f"compiling the grammar took {cpu_s:.1f} s of CPU, over the budget of {COMPILE_BUDGET_S:g} s: "
                "simplify the schema")
    return CompiledGrammar(matcher, ll_tokenizer, cpu_s)


def _dry_run(matcher: Any) -> str | None:
    """Why a copy of ``matcher`` cannot start an answer, or None: its first mask, then (past the
    tokens the grammar forces, such as a JSON object's brace) its next one, each within
    llguidance's limits and allowing some token."""
    probe = matcher.deep_copy()
    for step in range(2):
        mask = probe.compute_bitmask()
        if not probe.is_error() and mask.count(0) == len(mask) and not probe.is_stopped():
            return "the grammar allows no first token"
        forced = [] if step or probe.is_error() else probe.compute_ff_tokens()[:DRY_RUN_FORCED]
        if forced and not probe.is_error():
            probe.consume_tokens(forced)
        if probe.is_error():
            return f"the grammar cannot start an answer within llguidance's limits: {reason(probe.get_error())}"
        if not forced:
            break
    return None


def check_grammar(grammar: str, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int], *,
                  namespace: str | None = None, param: str | None = None) -> None:
    """``GrammarError`` naming llguidance's complaint when ``grammar`` cannot be decoded under for
    ``tokenizer`` (``compile_grammar``, whose compilation the matcher then reuses): before any
    model runs."""
    compile_grammar(grammar, tokenizer, vocab_size, eos_ids, namespace=namespace, param=param)


class GrammarMatcher:
    """Masks a model's next-token logits to what ``grammar`` allows, token by token.

    ``mask(logits)`` sets every disallowed token's logit to -inf (end of text, one of
    ``eos_ids``, only once the grammar is complete); ``accept(token)`` advances; ``done`` is true
    when the grammar allows nothing more (the answer ends there). The grammar is compiled once
    per namespace (``compile_grammar``); a failure while decoding is a ``GrammarError``.
    """

    def __init__(self, grammar: str, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int], *,
                 namespace: str | None = None) -> None:
        self.vocab_size = vocab_size
        self._matcher = compile_grammar(grammar, tokenizer, vocab_size, eos_ids, namespace=namespace).fork()

    def _failed(self, what: str) -> GrammarError:
        return GrammarError(f"the answer's grammar {what}: {reason(self._matcher.get_error())}")

    def allowed(self) -> torch.Tensor:
        """A boolean (vocab_size,) tensor: the tokens the grammar allows next."""
        mask = self._matcher.compute_bitmask()
        if self._matcher.is_error():
            raise self._failed("failed while decoding")
        bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[: self.vocab_size]
        if not bits.any():
            raise GrammarError("the answer's grammar allows no next token")
        return torch.from_numpy(bits.astype(bool))

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (vocab_size,) with the disallowed tokens at -inf (a new tensor)."""
        return logits.masked_fill(~self.allowed().to(logits.device), float("-inf"))

    def accept(self, token: int) -> None:
        """Advance past ``token`` (one ``mask`` allowed)."""
        if not self._matcher.consume_token(token):
            raise self._failed(f"refused token {token}")

    @property
    def done(self) -> bool:
        return bool(self._matcher.is_stopped())
