"""Tool calls parsed from the model's generated text, validated against the offered tools.

Only generated text is parsed, never the prompt: a ``<tool_call>`` block a tool result carries
is context the model read, not a call it made. A parser per chat-template family reads the raw
calls out of the text (``HermesParser``: Qwen's ``<tool_call>{"name": ..., "arguments": ...}
</tool_call>`` JSON blocks); ``parser_for`` picks one by the tokenizer's chat template, and
``register_parser`` adds (or replaces) one. ``parse_tool_calls`` validates every call (a known
tool; arguments a JSON object with the schema's required keys and types) and the request's
``tool_choice``: any failure is a ``ToolCallError`` naming what is wrong, never a half-parsed
answer.

A parser may also write its syntax as a grammar (``ToolCallParser.grammar``): on a backend that
decodes under one, ``answer_setup`` constrains the answer to free text (without the call
opener) and calls whose JSON matches their tool's schema, as ``tool_choice`` and
``parallel_tool_calls`` allow, so a forced call is made, and well formed, by construction.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from . import grammar as grammar_lib
from .config import GenerationConfig
from .errors import GrammarError, InputError, SchemaError, ToolCallError, excerpt
from .schema_limits import SchemaChecker
from .types import GenerationResult, Segment, SegmentKind, ToolCall, is_int, is_number

__all__ = [
    "HermesParser",
    "answer_reader",
    "answer_setup",
    "CallText",
    "content_filter",
    "ParsedAnswer",
    "RawCall",
    "ToolCallParser",
    "held_back",
    "offered_tools",
    "parse_tool_calls",
    "parser_for",
    "register_parser",
]

RawCall = tuple[str, object]  # (name, arguments) as the model wrote them, before validation


@dataclass(frozen=True)
class ParsedAnswer:
    """The model's answer split into its text outside the calls and the validated calls."""

    content: str
    calls: tuple[ToolCall, ...]


class ToolCallParser(Protocol):
    """Reads the raw calls out of generated text, in one template family's syntax."""

    opener: str  # the text that begins a call: a stream holds text back from here

    def split(self, text: str) -> tuple[str, list[RawCall]]:
        """(the text outside the calls, the calls in order); ``ToolCallError`` on a malformed call."""
        ...


class GrammarWriter(Protocol):
    """A parser that can also write its syntax as a grammar (optional: without it, answers are
    only checked)."""

    def grammar(self, tools: Sequence[Mapping[str, Any]], tool_choice: str, parallel: bool, tokenizer: Any) -> str:
        """Lark (``grammar``) for an answer offering ``tools`` under ``tool_choice``: text without
        calls for "none"; calls only (one or more, one without ``parallel``) for "required" or a
        tool's name (that tool's); for "auto", free text then optional calls."""
        ...


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks: Qwen2.5's (and Hermes')
    syntax. ``arguments`` may be a JSON object or its JSON text."""

    opener = "<tool_call>"
    closer = "</tool_call>"

    def split(self, text: str) -> tuple[str, list[RawCall]]:
        calls: list[RawCall] = []
        outside: list[str] = []
        at = 0
        while (start := text.find(self.opener, at)) >= 0:
            outside.append(text[at:start])
            end = text.find(self.closer, start)
            if end < 0:
                raise ToolCallError(f"tool call {len(calls) + 1} is not closed by {self.closer} (the answer ended "
                                    "inside it: max_new_tokens too small, or a stop string?)")
            calls.append(self._call(text[start + len(self.opener):end], len(calls) + 1))
            at = end + len(self.closer)
        outside.append(text[at:])
        return "".join(outside).strip(), calls

    @staticmethod
    def _call(body: str, number: int) -> RawCall:
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, RecursionError) as error:
            raise ToolCallError(f"tool call {number} is not JSON ({error}): {body.strip()!r:.120}") from None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            raise ToolCallError(f'tool call {number} must be a JSON object with a "name": {body.strip()!r:.120}')
        arguments = data.get("arguments", data.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (json.JSONDecodeError, RecursionError) as error:
                raise ToolCallError(f"tool call {number} ({data['name']}): arguments are not JSON ({error})") from None
        return data["name"], arguments

    def grammar(self, tools: Sequence[Mapping[str, Any]], tool_choice: str, parallel: bool, tokenizer: Any) -> str:
        text = "TEXT: /(?s:.+)/ & ~/(?s:.*" + "".join(
            c if c.isalnum() or c == "_" else f"\\x{{{ord(c):x}}}" for c in self.opener) + ".*)/"
        if tool_choice == "none":
            return grammar_lib.declared(f"start: TEXT?\n{text}\n")
        opener = grammar_lib.token_literal(tokenizer, self.opener)
        closer = grammar_lib.token_literal(tokenizer, self.closer)
        named = [t for t in tools if tool_choice in ("auto", "required") or t["function"]["name"] == tool_choice]
        checker = SchemaChecker()  # the limits over all the schemas of this one grammar
        for n, tool in enumerate(tools):
            if tool in named:
                checker.check(tool["function"].get("parameters") or {}, f"tools[{n}].function.parameters")
        bodies = [f"body{n}: {grammar_lib.json_rule(_call_schema(tool), checked=True)}" for n, tool in enumerate(named)]
        if tool_choice == "auto":
            start = "start: TEXT? " + ("call*" if parallel else "call?")
        else:
            start = "start: " + ("call+" if parallel else "call")
        body = " | ".join(f"body{n}" for n in range(len(named)))
        rules = [start, text, f'call: {opener} "\\n" ({body}) "\\n" {closer} "\\n"?', *bodies]
        return grammar_lib.declared("\n".join(rules) + "\n")


def _call_schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON schema of one call to ``tool`` as Hermes writes it: its name, then its arguments."""
    function = tool["function"]
    parameters = dict(function.get("parameters") or {})
    parameters.setdefault("type", "object")
    parameters.setdefault("additionalProperties", False)  # no argument the schema does not name
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


# (name, does it serve this chat template?, parser), newest first
_PARSERS: list[tuple[str, Callable[[str], bool], ToolCallParser]] = [
    ("hermes", lambda template: "<tool_call>" in template, HermesParser()),
]


def register_parser(name: str, matches: Callable[[str], bool], parser: ToolCallParser) -> None:
    """Add a parser for the chat templates ``matches`` accepts (given the template's text); it is
    tried before those registered earlier, and replaces one of the same ``name``."""
    _PARSERS[:] = [(name, matches, parser)] + [entry for entry in _PARSERS if entry[0] != name]


def parser_for(tokenizer: Any) -> ToolCallParser:
    """The parser of the tokenizer's chat-template family; ``InputError`` when none is known."""
    template = getattr(tokenizer, "chat_template", None)
    template = " ".join(template.values()) if isinstance(template, dict) else str(template or "")
    for _, matches, parser in _PARSERS:
        if matches(template):
            return parser
    raise InputError(
        "no tool-call parser knows this model's chat template (known: "
        f"{', '.join(name for name, _, _ in _PARSERS)}): register one with toolcalls.register_parser"
    )


def content_filter(segments: Sequence[Segment], tokenizer: Any) -> Callable[[str], str]:
    """What of each streamed delta a client is shown: all of it when ``segments`` offer no tools;
    with tools, ``CallText``'s content (the calls arrive parsed, at the end of the stream)."""
    if not any(s.kind is SegmentKind.TOOL_SCHEMA for s in segments):
        return lambda delta: delta
    return CallText(parser_for(tokenizer).opener).feed


class CallText:
    """What of a streamed answer that may hold tool calls is shown as content: the text before the
    first call, without the white space around it (as ``ParsedAnswer.content``), held back while
    it could be the opener's beginning; nothing from the opener on (the calls arrive parsed).
    Linear: only the text not shown yet is searched."""

    def __init__(self, opener: str) -> None:
        self.opener = opener
        self.pending = ""  # generated text not shown yet
        self.shown = ""  # content sent so far
        self.closed = False  # the first call began: nothing more is shown until the answer is parsed

    def feed(self, delta: str) -> str:
        """The content to show now, of ``delta`` and the text held back before it ("" often)."""
        if self.closed:
            return ""
        self.pending += delta
        found = self.pending.find(self.opener)
        self.closed = found >= 0
        ready = self.pending[:found] if self.closed else self.pending[:held_back(self.pending, self.opener)]
        skip = 0 if self.shown else len(ready) - len(ready.lstrip())  # white space before the content
        out = ready[skip:].rstrip()  # white space is shown once text follows it
        self.pending = self.pending[skip + len(out):]
        self.shown += out
        return out

    def finish(self, result: GenerationResult) -> str:
        """The content left to show once the answer is parsed (text after the calls)."""
        content = result.content if result.content is not None else result.text.strip()
        return content[len(self.shown):] if content.startswith(self.shown) else ""


def held_back(text: str, opener: str) -> int:
    """How many characters of streamed ``text`` may be shown now: up to the first call's opener,
    less a tail that could be the opener's beginning."""
    found = text.find(opener)
    if found >= 0:
        return found
    for keep in range(min(len(opener) - 1, len(text)), 0, -1):
        if opener.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)


_TYPES: dict[str, Callable[[object], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: is_int(v) or (isinstance(v, float) and v.is_integer()),
    "number": is_number,
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def _check_value(value: object, schema: Mapping[str, Any], path: str) -> str | None:
    """What is wrong with ``value`` under the JSON ``schema`` (types, enums, required keys, nested
    objects and array items), or None. Keywords it does not know are not checked."""
    declared = schema.get("type")
    types = declared if isinstance(declared, list) else [declared] if isinstance(declared, str) else []
    if types and not any(_TYPES.get(t, lambda _: True)(value) for t in types):
        return f"{path} must be of type {' or '.join(types)}, got {type(value).__name__} {value!r:.60}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{path} must be one of {schema['enum']!r:.120}, got {value!r:.60}"
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        missing = [key for key in schema.get("required") or () if key not in value]
        if missing:
            return f"{path} lacks the required {', '.join(map(repr, missing))}"
        for key, item in value.items():
            if key in properties:
                if (problem := _check_value(item, properties[key], f"{path}.{key}")) is not None:
                    return problem
            elif schema.get("additionalProperties") is False:
                return f"{path} has {key!r}, which the schema does not allow"
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for n, item in enumerate(value):
            if (problem := _check_value(item, schema["items"], f"{path}[{n}]")) is not None:
                return problem
    return None


def _check_choice(calls: Sequence[ToolCall], choice: str) -> None:
    if choice == "auto":
        return
    if choice == "none" and calls:
        raise ToolCallError(f"tool_choice='none' but the model called {calls[0].name}")
    if choice == "required" and not calls:
        raise ToolCallError("tool_choice='required' but the model answered without a tool call "
                            "(its backend does not decode under a grammar)")
    if choice not in ("none", "required"):
        if not calls:
            raise ToolCallError(f"tool_choice={choice!r} but the model answered without calling it "
                                "(its backend does not decode under a grammar)")
        other = next((call.name for call in calls if call.name != choice), None)
        if other is not None:
            raise ToolCallError(f"tool_choice={choice!r} but the model called {other}")


def offered_tools(segments: Sequence[Segment]) -> list[dict[str, Any]]:
    """The tools a prompt offers: its ``TOOL_SCHEMA`` segments' schemas, in order."""
    return [json.loads(s.text) for s in segments if s.kind is SegmentKind.TOOL_SCHEMA]


def parse_tool_calls(text: str, tools: Sequence[Mapping[str, Any]], parser: ToolCallParser,
                     tool_choice: str = "auto") -> ParsedAnswer:
    """The calls in generated ``text``, validated against ``tools`` (OpenAI function format) and
    ``tool_choice``; ``ToolCallError`` on the first problem, and then no call at all."""
    schemas = {tool["function"]["name"]: tool["function"].get("parameters") or {} for tool in tools}
    if tool_choice not in ("auto", "required", "none") and tool_choice not in schemas:
        raise InputError(f"tool_choice names {tool_choice!r:.80}, which is not among the tools "
                         f"({excerpt(', '.join(schemas))})")
    content, raw = parser.split(text)
    calls = []
    for number, (name, arguments) in enumerate(raw, start=1):
        if name not in schemas:
            raise ToolCallError(f"tool call {number} names {name!r:.60}, which is not among the tools "
                                f"({excerpt(', '.join(schemas))})")
        if not isinstance(arguments, dict):
            raise ToolCallError(f"tool call {number} ({name}): arguments must be a JSON object, "
                                f"got {type(arguments).__name__}")
        problem = _check_value(arguments, {"type": "object", **schemas[name]}, "arguments")
        if problem is not None:
            raise ToolCallError(f"tool call {number} ({name}): {problem}")
        calls.append(ToolCall(name, arguments, f"call_{uuid.uuid4().hex[:24]}"))
    _check_choice(calls, tool_choice)
    return ParsedAnswer(content, tuple(calls))


def answer_setup(segments: Sequence[Segment], tokenizer: Any, generation: GenerationConfig, backend: Any
                 ) -> tuple[GenerationConfig, Callable[[GenerationResult], GenerationResult] | None]:
    """How a request decodes and what reads its answer: ``generation`` with the grammar of the
    tool calls (``GrammarWriter``) when ``segments`` offer tools, the backend decodes under a
    grammar and the request brings none of its own; and ``answer_reader``'s reader. Raises at
    once, before any model runs: ``answer_reader``'s errors, the request's grammar on a backend
    without ``capabilities.grammar`` (``ConfigError``), a tool schema over ``schema_limits``
    (``SchemaError``) or a grammar that cannot be decoded under (``GrammarError``, ``param``
    "tools" for the calls' grammar). Each grammar is compiled here, once, in the request's cache
    namespace; the backend's matcher reuses it."""
    read = answer_reader(segments, tokenizer, generation.tool_choice, generation.parallel_tool_calls)
    eos = getattr(backend, "eos_token_ids", ())
    namespace = generation.cache_salt
    if generation.grammar is not None:
        grammar_lib.check_support(backend, generation.grammar)
        grammar_lib.check_grammar(generation.grammar, tokenizer, _vocab_size(backend, tokenizer), eos,
                                  namespace=namespace)
    elif read is not None and grammar_lib.decodes_under_grammar(backend):
        parser = parser_for(tokenizer)
        if hasattr(parser, "grammar"):
            try:
                written = parser.grammar(offered_tools(segments), generation.tool_choice,
                                         generation.parallel_tool_calls, tokenizer)
            except SchemaError:
                raise
            except InputError as error:
                raise GrammarError(f"the tools' parameters make no grammar: {error}", "tools") from None
            grammar_lib.check_grammar(written, tokenizer, _vocab_size(backend, tokenizer), eos, namespace=namespace,
                                      param="tools")
            generation = dataclasses.replace(generation, grammar=written)
    return generation, read


def _vocab_size(backend: Any, tokenizer: Any) -> int:
    """The main model's logits width (its config's ``vocab_size``), else the tokenizer's size."""
    config = getattr(getattr(backend, "model", None), "config", None)
    return int(getattr(config, "vocab_size", 0) or len(tokenizer))


def answer_reader(segments: Sequence[Segment], parser: ToolCallParser | Any, tool_choice: str = "auto",
                  parallel: bool = True) -> Callable[[GenerationResult], GenerationResult] | None:
    """For a prompt whose ``segments`` offer tools: what reads the calls out of its answer (the
    generated text only) into ``GenerationResult.tool_calls`` and ``content``. ``parser``: a
    ``ToolCallParser``, or a tokenizer whose template picks one; ``parallel`` False: an answer
    with several calls is a ``ToolCallError``. None without tools. Raises ``InputError`` at once,
    before any model runs: a ``tool_choice`` other than "auto" without tools or naming no offered
    tool, or no parser for the template."""
    tools = offered_tools(segments)
    if not tools:
        if tool_choice != "auto":
            raise InputError(f"tool_choice={tool_choice!r} but the prompt offers no tools")
        return None
    names = [tool["function"]["name"] for tool in tools]
    if tool_choice not in ("auto", "required", "none", *names):
        raise InputError(f"tool_choice names {tool_choice!r:.80}, which is not among the tools "
                         f"({excerpt(', '.join(names))})")
    chosen: ToolCallParser = parser if hasattr(parser, "split") else parser_for(parser)

    def read(result: GenerationResult) -> GenerationResult:
        answer = parse_tool_calls(result.text, tools, chosen, tool_choice)
        if not parallel and len(answer.calls) > 1:
            raise ToolCallError(f"parallel_tool_calls is false but the model made {len(answer.calls)} calls "
                                f"({', '.join(call.name for call in answer.calls)})")
        return dataclasses.replace(result, tool_calls=answer.calls, content=answer.content)

    return read
