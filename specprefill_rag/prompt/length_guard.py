"""How many characters one token can stand for: a prompt refused by its length, before tokenizing.

The engine refuses a prompt of ``window`` tokens or more. Tokenizing a 10-million-character prompt
to find that out takes half a minute and gigabytes; its length alone shows it sooner
(``check_length``). For a tokenizer whose pipeline keeps every character (below), every token covers at most
``max_chars_per_token(tokenizer)`` characters of the text, so a text of ``n_chars`` characters has
at least ``ceil(n_chars / max_chars_per_token)`` tokens, and one with
``n_chars > max_chars_per_token * (window - 1)`` cannot fit.

Why the bound holds (x: the text, |x| its characters; L: the longest vocabulary entry, in bytes
for a byte-level vocabulary, else in characters; n: the tokens of x):

* Normalizers. Decomposing (NFD, NFKD), lowercasing, prepending and one-character replacements
  never shorten a text. Composing (NFC) can: |x| <= |NFD(x)| = |NFD(NFC(x))| = sum over the
  characters c of NFC(x) of |NFD(c)|, and |NFD(c)| <= 4 characters, <= 1.5 x its UTF-8 bytes,
  for every character an NFC text holds (NFKC alike, with NFKD; ``tests/test_hostile_gateway.py``
  checks both over all of Unicode). So |x| <= F x |y| for the normalized text y, with F = 4 per
  composing step in characters, or 1.5 in bytes when NFC or NFKC is the only normalizer.
* Pre-tokenizers that only split, isolate or map one for one (ByteLevel, Metaspace, Split and
  Punctuation without "removed", Digits, UnicodeScripts) keep every unit of y.
* A BPE model covers every unit with tokens whose vocabulary strings are the units they cover (a
  byte-fallback token covers one byte, an unfused unknown token one character; a subword prefix
  or suffix only lengthens the string), so |y| <= n x L. Added tokens, matched in the raw text
  first, cover their own string: at most L too, as none may swallow neighbouring white space
  (``lstrip`` / ``rstrip``).

Hence n >= |x| / (F x L). Every other pipeline (WordPiece and BERT's normalizer, which drop
characters; Unigram's fused unknown tokens; truncation) gets no bound: ``None``, and the prompt
is tokenized as before.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from ..errors import InputError
from ..types import Segment

__all__ = ["check_length", "max_chars_per_token"]

# Characters of prompt text tokenized to count them whatever their length (milliseconds); a longer
# prompt whose length alone shows it cannot fit the window is refused before tokenizing.
COUNT_EXACTLY_BELOW = 100_000

_COMPOSING = frozenset({"NFC", "NFKC"})
_LENGTHENING = frozenset({"NFD", "NFKD", "Lowercase", "Prepend"})
_COMPOSE_CHARS = 4.0  # max |NFD(c)| in characters over the characters an NFC text holds
_COMPOSE_BYTES = 1.5  # max |NFD(c)| / UTF-8 bytes of c, over the same characters
_KEEPING = frozenset({"ByteLevel", "Metaspace", "Split", "Punctuation", "Digits", "UnicodeScripts"})


def _state(component: Any) -> dict[str, Any] | None:
    """A tokenizers component as its JSON (what it pickles to); None when it has none."""
    return None if component is None else dict(json.loads(component.__getstate__()))


def _shrink(normalizer: dict[str, Any] | None, byte_level: bool) -> float | None:
    """F: how many characters of the input one unit of the normalized text can stand for."""
    if normalizer is None:
        return 1.0
    kind = normalizer.get("type")
    if kind in _COMPOSING:
        return _COMPOSE_BYTES if byte_level else _COMPOSE_CHARS
    steps = normalizer.get("normalizers", []) if kind == "Sequence" else [normalizer]
    factor = 1.0
    for step in steps:
        kind = step.get("type")
        if kind in _COMPOSING:
            factor *= _COMPOSE_CHARS  # a later step may shorten the bytes: count characters
        elif kind == "Replace":
            pattern = step.get("pattern", {}).get("String")
            if not isinstance(pattern, str) or len(pattern) != 1 or not step.get("content"):
                return None  # a regex or a longer pattern may shorten the text
        elif kind not in _LENGTHENING:
            return None
    return factor


def _keeps_everything(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return True
    if pre_tokenizer.get("type") == "Sequence":
        return all(_keeps_everything(p) for p in pre_tokenizer.get("pretokenizers", []))
    return pre_tokenizer.get("type") in _KEEPING and pre_tokenizer.get("behavior") != "Removed"


def _byte_level(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return False
    if pre_tokenizer.get("type") == "Sequence":
        return any(_byte_level(p) for p in pre_tokenizer.get("pretokenizers", []))
    return pre_tokenizer.get("type") == "ByteLevel"


def max_chars_per_token(tokenizer: Any) -> int | None:
    """The most characters of text one token of ``tokenizer`` (a fast HF tokenizer) can stand
    for, or None where its pipeline gives no such bound (see the module's docstring)."""
    backend: Any = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow tokenizer
        return None
    try:
        model = backend.model
        if type(model).__name__ != "BPE" or backend.truncation is not None:
            return None
        if model.unk_token is not None and model.fuse_unk and not model.byte_fallback:
            return None  # one unknown token may swallow a run of characters
        added = getattr(tokenizer, "added_tokens_decoder", {}).values()
        if any(token.lstrip or token.rstrip for token in added):
            return None  # such a token covers a run of white space of any length
        pre_tokenizer = _state(backend.pre_tokenizer)
        if not _keeps_everything(pre_tokenizer):
            return None
        factor = _shrink(_state(backend.normalizer), _byte_level(pre_tokenizer))
        longest = max(map(len, tokenizer.get_vocab()), default=0)
    except (AttributeError, TypeError, ValueError):  # not a tokenizers pipeline
        return None
    if factor is None or longest < 1:
        return None
    return math.ceil(longest * factor)


def check_length(segments: Sequence[Segment], window: int, chars_per_token: int | None) -> None:
    """The window's ``InputError`` for segments too long to fit by their length alone, before
    tokenizing them (seconds and gigabytes for millions of characters). Never refuses a prompt
    that fits: it has at least chars / ``chars_per_token`` tokens (``max_chars_per_token``; None:
    no bound, nothing refused). Prompts cheap to tokenize are left to the exact count, whose
    message says how many tokens."""
    if chars_per_token is None:
        return
    chars = sum(len(s.text) for s in segments if isinstance(s.text, str))
    if chars > max(chars_per_token * (window - 1), COUNT_EXACTLY_BELOW):
        raise InputError(
            f"the prompt has at least {-(-chars // chars_per_token)} tokens ({chars} characters, at most "
            f"{chars_per_token} per token) but the main model's window is {window}: "
            "retrieve fewer or shorter passages"
        )
