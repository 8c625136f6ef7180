"""Checks shared by the request parsers (``protocol`` and ``tools``): every refusal an
OpenAI-shaped 400 naming the field, every string read checked for valid Unicode, and the JSON
depth and schema limits (``schema_limits``) with the field path as ``param``."""

from __future__ import annotations

import reprlib
from typing import Any

from ..errors import SchemaError
from ..schema_limits import SchemaChecker, check_depth
from ..types import lone_surrogate
from .messages import MAX_PARTS
from .responses import APIError

__all__ = ["at_most", "bad", "check_json_depth", "check_schema", "check_strings", "shown", "unsupported", "valid_text"]

# Values quoted in error messages: short, and shallow (a client's value may be megabytes, or
# nested thousands deep, which the built-in repr would recurse into).
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlist, _SHOWN.maxdict = 2, 60, 60, 4, 4


def shown(value: object) -> str:
    """``value`` as an error message quotes it: short and shallow."""
    return _SHOWN.repr(value)


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, what: str) -> APIError:
    return bad(f"{what} is not supported by the SpecPrefill gateway", param=param, code="unsupported_parameter")


def valid_text(value: str, param: str) -> str:
    """``value``, unless it holds a lone surrogate (JSON's unpaired ``"\\ud800"``): not valid
    Unicode, it cannot be tokenized nor sent back. Every string the gateway reads passes here."""
    at = lone_surrogate(value)
    if at is not None:
        raise bad(f"{param} is not valid Unicode: a lone surrogate (U+{ord(value[at]):04X}) at character {at}",
                  param=param)
    return value


def check_strings(value: object, param: str) -> None:
    """``valid_text`` on every string (keys included) inside JSON data: a tool's schema, a call's
    arguments. Iterative: the data may nest as deep as the JSON decoder allowed."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            valid_text(item, param)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def at_most(items: list[Any], param: str, what: str) -> None:
    if len(items) > MAX_PARTS:
        raise bad(f"{param} holds {len(items)} {what}, more than the gateway's limit of {MAX_PARTS}", param=param)


def check_json_depth(value: object, param: str) -> None:
    """400 naming the place when ``value`` nests deeper than ``schema_limits.MAX_JSON_DEPTH``
    (``param``: where ``value`` sits, "" for the body)."""
    try:
        check_depth(value, param)
    except SchemaError as error:
        raise bad(str(error), param=error.path or None) from None


def check_schema(checker: SchemaChecker, schema: object, param: str) -> None:
    """400 naming the place when ``schema`` passes the schema limits (``checker``: the request's)."""
    try:
        checker.check(schema, param)
    except SchemaError as error:
        raise bad(str(error), param=error.path) from None
