"""The checks every config applies to its fields: one message style, one place the choices of a
``Literal`` field are written."""

from __future__ import annotations

from typing import Any, get_args

from ..errors import ConfigError, ConfigTypeError
from ..types import is_int, is_number

__all__ = ["check", "check_choice", "check_types", "describe_choices"]

def check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def describe_choices(literal: Any, *, other: str | None = None) -> str:
    """The values of a ``Literal`` for a message: "'a', 'b' or 'c'" (``other`` last, if given)."""
    items = [repr(value) for value in get_args(literal)] + ([other] if other else [])
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def check_choice(name: str, value: object, literal: Any) -> None:
    """``ConfigError`` unless ``value`` is one of the values of the ``Literal`` ``literal``, the
    one place the choices of a field are written."""
    check(value in get_args(literal), f"{name} must be {describe_choices(literal)}, got {value!r}")


def check_types(obj: object, ints: tuple[str, ...] = (), numbers: tuple[str, ...] = (),
                 bools: tuple[str, ...] = ()) -> None:
    """ConfigTypeError for a field of the wrong type (a bool is not a number; 2.5 is not a count);
    ConfigError for a switch that is not True or False."""
    for name in bools:
        value = getattr(obj, name)
        check(isinstance(value, bool), f"{name} must be True or False, got {value!r:.40}")
    for name in ints:
        value = getattr(obj, name)
        if value is not None and not is_int(value):
            raise ConfigTypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    for name in numbers:
        value = getattr(obj, name)
        if value is not None and not is_number(value):
            raise ConfigTypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")

