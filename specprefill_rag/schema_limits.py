"""Limits on the JSON a request carries and on the JSON schemas it asks to decode under, checked
before any grammar is compiled, each refusal a ``SchemaError`` naming where (docs/gateway.md,
"Limits on structured requests").

**One JSON depth**, ``MAX_JSON_DEPTH`` arrays and objects nested, for everything: a request body
(counted from the body), a JSON schema or a tool's parameters (from the schema; inside a body the
body's count binds first) and a call's arguments sent as JSON text (from the arguments). Every
later stage (``json.dumps``, a chat template's ``tojson``, the tool-call layout, llguidance)
recurses on such values; Python's recursion limit is 1000 frames, so 64 leaves them each more
than 900 frames of headroom, while real schemas nest a dozen levels (OpenAI allows 10 of
objects).

**Schema limits** (``SchemaLimits``), in the spirit of OpenAI's structured outputs and sized by
what llguidance compiles in well under a second and decodes within its own limits (its Earley
rows hold at most 2,000 items: an object of 1,000 optional properties, or 3,000 ``anyOf``
branches, breaks that on the first token after the brace): properties per object and in all,
``anyOf``/``oneOf`` branches in all, enum and const values and their length in all, array bounds,
pattern length and counted repetitions nested in counted repetitions (``((a{2,50}){3,90}){3,90}``
exhausts llguidance's lexer mid-answer). "In all" counts across every schema of one request
(``SchemaChecker``): the ``response_format`` and all tools, which share one grammar. ``$ref`` must
be local (``#`` or ``#/...``) and point at a schema; a recursive one (a schema that contains
itself) is refused: unroll it to the depth you need.

The checks are iterative and linear in the value's size, so megabytes cost milliseconds, and
stop at the first limit passed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from .errors import QUOTE_CHARS, ConfigError, SchemaError, excerpt

__all__ = ["MAX_JSON_DEPTH", "SCHEMA_LIMITS", "SchemaChecker", "SchemaLimits", "check_depth", "pattern_problem"]

MAX_JSON_DEPTH = 64  # arrays and objects nested, for bodies, schemas and arguments alike

# A path as a linked list, built in O(1) per node: (parent, key); rendered only for an error.
Path = tuple[Any, str | int] | None

# Where a schema holds schemas: a dict of them, one, or a list of them.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("items", "additionalProperties", "additionalItems", "unevaluatedProperties", "unevaluatedItems",
               "contains", "propertyNames", "not", "if", "then", "else")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_ARRAY_BOUNDS = ("minItems", "maxItems")
_KEY = re.compile(r"[A-Za-z0-9_$-]{1,40}")
_COUNT = re.compile(r"\{(\d{1,9})(,(\d{0,9}))?\}")  # {m}, {m,} or {m,n}
_PRODUCT_CAP = 10**12  # products of counts are compared against limits far below this


@dataclass(frozen=True)
class SchemaLimits:
    """What one request's JSON schemas may hold (module docstring)."""

    max_depth: int = MAX_JSON_DEPTH  # arrays and objects nested, from the schema's root
    max_object_properties: int = 256  # properties (and patternProperties) of one object
    max_properties: int = 1000  # properties in all
    max_branches: int = 256  # anyOf and oneOf branches in all
    max_enum_values: int = 1000  # enum values and consts in all
    max_enum_chars: int = 120_000  # characters of those values (as JSON text) in all
    max_array_bound: int = 1000  # minItems / maxItems: a bounded array is one rule per item
    max_pattern_chars: int = 1000  # characters of one pattern (``pattern``, ``patternProperties`` keys)
    max_repeat_nesting: int = 2  # counted repetitions ({m,n}) nested in one another
    max_repeat_product: int = 1000  # the product of the counts along nested counted repetitions

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"SchemaLimits.{name} must be an integer >= 1, got {value!r:.40}")


SCHEMA_LIMITS = SchemaLimits()


def render_path(path: Path, root: str) -> str:
    """``root`` followed by the keys of ``path`` (``.key``, ``[n]``), at most ``QUOTE_CHARS``
    characters (client keys included)."""
    keys: list[str | int] = []
    while path is not None:
        path, key = path
        keys.append(key)
    parts = [root]
    for key in reversed(keys):
        if isinstance(key, int):
            parts.append(f"[{key}]")
        else:
            text = key if _KEY.fullmatch(key) else excerpt(json.dumps(key, ensure_ascii=False), 40)
            parts.append(f".{text}" if parts != [""] else text)
    return excerpt("".join(parts), QUOTE_CHARS)


def _children(value: Any) -> Iterator[tuple[str | int, Any]]:
    return iter(value.items()) if isinstance(value, dict) else enumerate(value)


def check_depth(value: object, root: str = "", limit: int = MAX_JSON_DEPTH) -> None:
    """``SchemaError`` when ``value`` nests arrays and objects more than ``limit`` deep (an object
    holding an array is 2 deep), naming the first place past the limit under ``root``."""
    if not isinstance(value, (dict, list)):
        return
    stack: list[tuple[Any, int, Path]] = [(value, 1, None)]
    while stack:
        item, depth, path = stack.pop()
        if depth > limit:
            where = render_path(path, root) or "the request body"
            raise SchemaError(f"{where} nests JSON arrays and objects deeper than the limit of {limit} levels",
                              where)
        for key, child in _children(item):
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1, (path, key)))


def _class_end(pattern: str, at: int) -> int:
    """The index after the character class opening at ``at`` (``[...]``), or -1 if unclosed."""
    i = at + 1
    if i < len(pattern) and pattern[i] == "^":
        i += 1
    if i < len(pattern) and pattern[i] == "]":
        i += 1
    while i < len(pattern):
        if pattern[i] == "\\":
            i += 2
            continue
        if pattern[i] == "]":
            return i + 1
        i += 1
    return -1


def _escape_end(pattern: str, at: int) -> int:
    """The index after the escape at ``at`` (``\\d``, ``\\{``, ``\\p{L}``, ``\\x{41}``)."""
    if pattern[at + 1:at + 2] in ("p", "P", "x", "u") and pattern[at + 2:at + 3] == "{":
        close = pattern.find("}", at + 3)
        return len(pattern) if close < 0 else close + 1
    return at + 2


def _repetition(pattern: str) -> tuple[int, int] | str:
    """(the deepest nesting of counted repetitions, the largest product of the counts along a
    nesting of two or more) in ``pattern``, or what is malformed. ``{m,}`` counts as ``m``."""
    stack = [(0, 1)]  # per open group: the deepest nesting and largest product inside it so far
    last = (0, 1)  # the atom just read: its nesting and product
    nested = 1  # the largest product along a nesting of two or more
    i = 0
    while i < len(pattern):
        count = _COUNT.match(pattern, i) if pattern[i] == "{" else None
        if count is not None:
            times = int(count.group(3) or count.group(1))
            last = (last[0] + 1, min(last[1] * max(times, 1), _PRODUCT_CAP))
            nested = max(nested, last[1]) if last[0] > 1 else nested
            i = count.end()
        else:
            char = pattern[i]
            if char == "\\":
                i, last = _escape_end(pattern, i), (0, 1)
            elif char == "[":
                i, last = _class_end(pattern, i), (0, 1)
                if i < 0:
                    return "is not a valid regular expression: a character class is not closed"
            elif char == "(":
                stack.append((0, 1))
                i, last = i + 1, (0, 1)
            elif char == ")":
                if len(stack) == 1:
                    return "is not a valid regular expression: a ')' closes no group"
                last = stack.pop()
                i += 1
            else:
                i, last = i + 1, (0, 1)
        depth, product = stack[-1]
        stack[-1] = (max(depth, last[0]), max(product, last[1]))
    if len(stack) > 1:
        return "is not a valid regular expression: a group is not closed"
    return stack[0][0], nested


def pattern_problem(pattern: str, limits: SchemaLimits = SCHEMA_LIMITS) -> str | None:
    """What is wrong with a JSON schema ``pattern`` (as "the pattern ..."), or None."""
    if len(pattern) > limits.max_pattern_chars:
        return f"has {len(pattern)} characters, over the limit of {limits.max_pattern_chars}"
    found = _repetition(pattern)
    if isinstance(found, str):
        return found
    depth, product = found
    if depth > limits.max_repeat_nesting:
        return (f"nests counted repetitions ({{m,n}}) {depth} deep, over the limit of {limits.max_repeat_nesting}: "
                "llguidance's lexer cannot follow them")
    if product > limits.max_repeat_product:
        shown = f"{product:,}" if product < _PRODUCT_CAP else "more than 10^12"
        return (f"repeats {shown} times through nested counted repetitions, over the limit of "
                f"{limits.max_repeat_product:,}: llguidance's lexer cannot follow them")
    return None


@dataclass
class _Totals:
    properties: int = 0
    branches: int = 0
    enum_values: int = 0
    enum_chars: int = 0


class SchemaChecker:
    """The schema limits over one request: ``check`` each of its schemas (the ``response_format``,
    every tool's parameters); the totals ("in all") add up across them."""

    def __init__(self, limits: SchemaLimits = SCHEMA_LIMITS) -> None:
        self.limits = limits
        self.totals = _Totals()

    def check(self, schema: object, root: str = "schema") -> None:
        """``SchemaError`` naming the first place under ``root`` where ``schema`` passes a limit."""
        check_depth(schema, root, self.limits.max_depth)
        if not isinstance(schema, dict):
            return
        refs: list[tuple[Path, str, int]] = []  # ($ref's path, the ref, id of the schema holding it)
        schemas: dict[int, dict[str, Any]] = {}  # id -> each schema node reached
        parents: dict[int, int | None] = {id(schema): None}
        stack: list[tuple[dict[str, Any], Path]] = [(schema, None)]
        while stack:
            node, path = stack.pop()
            schemas[id(node)] = node
            self._node(node, path, root)
            if isinstance(node.get("$ref"), str):
                refs.append(((path, "$ref"), node["$ref"], id(node)))
            for child, child_path in _subschemas(node, path):
                if isinstance(child, dict):
                    parents[id(child)] = id(node)
                    stack.append((child, child_path))
                elif not isinstance(child, bool):
                    where = render_path(child_path, root)
                    raise SchemaError(f"{where} must be a JSON schema (an object or a boolean), got "
                                      f"{type(child).__name__}", where)
        _check_refs(schema, refs, schemas, parents, root)

    def _node(self, node: dict[str, Any], path: Path, root: str) -> None:
        limits, totals = self.limits, self.totals
        for key in ("properties", "patternProperties"):
            named = node.get(key)
            if isinstance(named, dict):
                totals.properties += len(named)
                if len(named) > limits.max_object_properties:
                    self._refuse(path, key, root, f"has {len(named)} properties, over the limit of "
                                 f"{limits.max_object_properties} for one object")
        if totals.properties > limits.max_properties:
            self._refuse(path, "properties", root, f"brings the properties to {totals.properties}, over the "
                         f"limit of {limits.max_properties} in all")
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list):
                totals.branches += len(node[key])
                if totals.branches > limits.max_branches:
                    self._refuse(path, key, root, f"brings the anyOf/oneOf branches to {totals.branches}, over "
                                 f"the limit of {limits.max_branches} in all")
        self._values(node, path, root)
        for key in _ARRAY_BOUNDS:
            bound = node.get(key)
            if isinstance(bound, (int, float)) and not isinstance(bound, bool) and bound > limits.max_array_bound:
                self._refuse(path, key, root, f"is {excerpt(repr(bound), 40)}, over the limit of "
                             f"{limits.max_array_bound}")
        patterns: list[tuple[Path, str]] = []  # (where, the pattern)
        if isinstance(node.get("pattern"), str):
            patterns.append(((path, "pattern"), node["pattern"]))
        if isinstance(node.get("patternProperties"), dict):
            patterns += [(((path, "patternProperties"), key), key) for key in node["patternProperties"]]
        for at, pattern in patterns:
            if (problem := pattern_problem(pattern, limits)) is not None:
                text = render_path(at, root)
                raise SchemaError(f"{text}: the pattern {problem}", text)

    def _values(self, node: dict[str, Any], path: Path, root: str) -> None:
        limits, totals = self.limits, self.totals
        values = list(node["enum"]) if isinstance(node.get("enum"), list) else []
        values += [node["const"]] if "const" in node else []
        if not values:
            return
        totals.enum_values += len(values)
        key = "enum" if "enum" in node else "const"
        if totals.enum_values > limits.max_enum_values:
            self._refuse(path, key, root, f"brings the enum and const values to {totals.enum_values}, over the "
                         f"limit of {limits.max_enum_values} in all")
        for value in values:
            totals.enum_chars += len(value) + 2 if isinstance(value, str) else len(json.dumps(value))
            if totals.enum_chars > limits.max_enum_chars:
                self._refuse(path, key, root, f"brings the enum and const values to more than "
                             f"{limits.max_enum_chars:,} characters, the limit in all")

    @staticmethod
    def _refuse(path: Path, key: str, root: str, problem: str) -> None:
        where = render_path((path, key), root)
        raise SchemaError(f"{where} {problem}", where)


def _subschemas(node: dict[str, Any], path: Path) -> Iterator[tuple[Any, Path]]:
    """(child, its path) for each schema held by ``node``."""
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for name, child in node[key].items():
                yield child, ((path, key), name)
    for key in _SCHEMA_ONE:
        if key in node and not isinstance(node[key], list):
            yield node[key], (path, key)
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            for n, child in enumerate(node[key]):
                yield child, ((path, key), n)


def _resolve(schema: dict[str, Any], ref: str) -> object:
    """The value a local ``$ref`` points at (a JSON pointer after ``#``), or None."""
    target: object = schema
    for token in ref[2:].split("/") if ref != "#" else []:
        token = unquote(token).replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and token in target:
            target = target[token]
        elif isinstance(target, list) and token.isdigit() and int(token) < len(target):
            target = target[int(token)]
        else:
            return None
    return target


def _check_refs(schema: dict[str, Any], refs: list[tuple[Path, str, int]], schemas: dict[int, dict[str, Any]],
                parents: dict[int, int | None], root: str) -> None:
    """Every ``$ref`` local, pointing at a schema, and none recursive (``_cycle``)."""
    targets: dict[int, tuple[int, Path]] = {}  # id of a schema holding a ref -> (its target's id, the ref's path)
    for path, ref, holder in refs:
        where = render_path(path, root)
        if ref != "#" and not ref.startswith("#/"):
            raise SchemaError(f"{where}: only local references ('#' or '#/...') are supported, got "
                              f"{excerpt(json.dumps(ref, ensure_ascii=False), 60)}", where)
        target = _resolve(schema, ref)
        if isinstance(target, bool):
            continue
        if not isinstance(target, dict) or id(target) not in schemas:
            raise SchemaError(f"{where}: {excerpt(json.dumps(ref, ensure_ascii=False), 60)} does not point at a "
                              "schema of this document", where)
        targets[holder] = (id(target), path)
    cycle = _cycle(targets, parents)
    if cycle is not None:
        where = render_path(cycle, root)
        raise SchemaError(f"{where}: a recursive $ref (a schema that contains itself) is not supported: unroll it "
                          "to the depth you need", where)


def _cycle(targets: dict[int, tuple[int, Path]], parents: dict[int, int | None]) -> Path:
    """The path of a ref on a cycle, or None. A ref's target "leads to" the target of every ref held
    inside it (the ref's holder or one of its ancestors being that target); the schema is recursive
    when this graph over targets has a cycle (a ref inside its own target is one of length 1).
    Linear in the refs times the nesting."""
    edges: dict[int, list[tuple[int, Path]]] = {}
    pointed = {target for target, _ in targets.values()}
    for holder, (target, path) in targets.items():
        node: int | None = holder
        while node is not None:
            if node in pointed:
                edges.setdefault(node, []).append((target, path))
            node = parents.get(node)
    state: dict[int, int] = {}  # 1: on the current path, 2: done
    for start in edges:
        if state.get(start):
            continue
        stack: list[tuple[int, Iterator[tuple[int, Path]]]] = [(start, iter(edges.get(start, ())))]
        state[start] = 1
        while stack:
            node, out = stack[-1]
            step = next(out, None)
            if step is None:
                state[node] = 2
                stack.pop()
                continue
            target, path = step
            if state.get(target) == 1:
                return path
            if not state.get(target):
                state[target] = 1
                stack.append((target, iter(edges.get(target, ()))))
    return None
