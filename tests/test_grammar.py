"""Grammar-constrained decoding (issue 50, item 3): forced tool calls and JSON answers are made
well formed by construction on the transformers backend (a random tiny model, which writes
garbage unconstrained, writes valid calls under the grammar); the vLLM backends forward the same
grammar; a backend that would ignore a grammar refuses it; client text cannot open a call."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specprefill_rag import (
    ConfigError,
    GenerationConfig,
    GrammarError,
    InputError,
    SchemaError,
    SpecPrefillEngine,
    ToolCallError,
    testing,
)
from specprefill_rag.backends.vllm_server import request_body
from specprefill_rag.grammar import GrammarMatcher, json_grammar, token_literal
from specprefill_rag.toolcalls import HermesParser

# Bounded arguments, so a random model's call ends within a few dozen tokens.
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": 'Look up } a "record" %json {\n</tool_call> <tool_call> <|im_start|>',
    "parameters": {"type": "object", "properties": {
        "kind": {"type": "string", "enum": ["crew", "cargo"]}, "urgent": {"type": "boolean"}},
        "required": ["kind", "urgent"]}}}
PING = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [LOOKUP, PING]
SKY = ("Is the sky blue?", ["The sky is blue. " * 8])
MESSAGES = [{"role": "user", "content": "Who is on the crew of the winter station? " * 4}]


@pytest.fixture(scope="module")
def engine() -> SpecPrefillEngine:
    return testing.tiny_engine(tools=True)


def chat(engine: SpecPrefillEngine, **generation):
    options = {"max_new_tokens": 200, **generation}
    return engine.chat(MESSAGES, TOOLS, generation=GenerationConfig(**options), mode="full")


@pytest.mark.parametrize("choice", ["required", "lookup", "ping"])
def test_a_forced_call_is_valid_by_construction(engine, choice):
    result = chat(engine, tool_choice=choice, parallel_tool_calls=False)
    assert len(result.tool_calls) == 1, result.text
    call = result.tool_calls[0]
    assert choice == "required" or call.name == choice
    if call.name == "lookup":
        assert call.arguments["kind"] in ("crew", "cargo") and isinstance(call.arguments["urgent"], bool)
    else:
        assert call.arguments == {}  # no argument the schema does not name
    assert result.text.startswith("<tool_call>\n{") and result.text.rstrip().endswith("}\n</tool_call>")
    assert result.content == ""


def test_the_same_model_unconstrained_writes_no_valid_call(engine):
    backend = testing.ScriptedBackend(engine.backend, "")  # no grammar capability...
    backend.stream_tokens = engine.backend.stream_tokens  # ...but the real model's tokens
    unconstrained = SpecPrefillEngine(backend, engine.draft, engine.config)
    with pytest.raises(ToolCallError, match="without calling it"):
        chat(unconstrained, tool_choice="lookup", parallel_tool_calls=False)


def test_the_grammar_follows_tool_choice_and_parallel_calls(engine):
    parser, tokenizer = HermesParser(), engine.tokenizer
    opener = token_literal(tokenizer, "<tool_call>")
    assert opener == f"<[{tokenizer.convert_tokens_to_ids('<tool_call>')}]>"  # the added token, not text
    assert token_literal(tokenizer, "plain") == '"plain"'
    head = "%llguidance {}\n"  # vLLM's auto structured-output backend then picks llguidance
    assert parser.grammar(TOOLS, "auto", True, tokenizer).startswith(head + "start: TEXT? call*\n")
    assert parser.grammar(TOOLS, "auto", False, tokenizer).startswith(head + "start: TEXT? call?\n")
    assert parser.grammar(TOOLS, "required", True, tokenizer).startswith(head + "start: call+\n")
    named = parser.grammar(TOOLS, "ping", False, tokenizer)
    assert named.startswith(head + "start: call\n") and '"const": "ping"' in named and "lookup" not in named
    assert "call" not in parser.grammar(TOOLS, "none", True, tokenizer).replace("tool_call", "")


def allowed(matcher: GrammarMatcher) -> set[int]:
    return set(np.flatnonzero(matcher.allowed().numpy()).tolist())


def test_text_cannot_open_a_call_where_calls_are_not_allowed(engine):
    tokenizer = engine.tokenizer
    eos = engine.backend.eos_token_ids
    grammar = HermesParser().grammar(TOOLS, "none", True, tokenizer)
    matcher = GrammarMatcher(grammar, tokenizer, len(tokenizer), eos)
    opener = tokenizer.convert_tokens_to_ids("<tool_call>")
    assert opener not in allowed(matcher) and eos <= allowed(matcher)
    for token in tokenizer.encode("sky <tool_c", add_special_tokens=False):
        matcher.accept(token)
    rest = {t for t in allowed(matcher) if tokenizer.decode([t]).startswith("a")}
    assert not {t for t in rest if tokenizer.decode([t]).startswith("all>")}
    auto = GrammarMatcher(HermesParser().grammar(TOOLS, "auto", True, tokenizer), tokenizer, len(tokenizer), eos)
    assert opener in allowed(auto)


def test_a_json_answer_matches_its_schema(engine):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                               "sure": {"type": "boolean"}},
              "required": ["answer", "sure"], "additionalProperties": False}
    result = engine.generate("Is the sky blue?", ["The sky is blue. " * 8], generation=GenerationConfig(
        max_new_tokens=40, grammar=json_grammar(schema)), mode="full")
    data = json.loads(result.text)
    assert set(data) == {"answer", "sure"} and data["answer"] in ("yes", "no") and isinstance(data["sure"], bool)
    assert result.finish_reason == "stop"


def test_a_grammar_is_refused_where_it_would_be_ignored(engine):
    scripted = SpecPrefillEngine(testing.ScriptedBackend(engine.backend, "{}"), engine.draft, engine.config)
    with pytest.raises(ConfigError, match="cannot decode under a grammar"):
        scripted.generate(*SKY, generation=GenerationConfig(grammar=json_grammar({})))
    with pytest.raises(InputError, match="does not compile"):
        engine.generate(*SKY, generation=GenerationConfig(grammar="start: undefined_rule\n"))
    with pytest.raises(ValueError, match="grammar must be a non-empty string"):
        GenerationConfig(grammar=" ")
    with pytest.raises(ValueError, match="parallel_tool_calls must be True or False"):
        GenerationConfig(parallel_tool_calls="no")


def test_several_calls_are_refused_without_parallel_calls(engine):
    two = ('<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>\n'
           '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>')
    scripted = SpecPrefillEngine(testing.ScriptedBackend(engine.backend, two), engine.draft, engine.config)
    assert len(chat(scripted, max_new_tokens=100).tool_calls) == 2
    with pytest.raises(ToolCallError, match="parallel_tool_calls is false but the model made 2 calls"):
        chat(scripted, max_new_tokens=100, parallel_tool_calls=False)


def test_the_vllm_server_backend_forwards_the_grammar(engine):
    planned = engine.plan(engine.assemble("Is the sky blue?", ["The sky is blue. " * 8]), mode="full")
    body = request_body(planned.plan, GenerationConfig(grammar="start: %json {}\n"), model="m", max_tokens=4,
                        logprobs=False, stream=True)
    assert body["structured_outputs"] == {"grammar": "%llguidance {}\nstart: %json {}\n"}  # declared
    assert "structured_outputs" not in request_body(planned.plan, GenerationConfig(), model="m", max_tokens=4,
                                                    logprobs=False, stream=True)


def test_a_tool_schema_that_makes_no_grammar_is_refused_before_decoding(engine):
    def odd(pattern: str) -> dict:
        return {"type": "function", "function": {"name": "odd", "parameters": {
            "type": "object", "properties": {"code": {"type": "string", "pattern": pattern}}, "required": ["code"]}}}

    generation = GenerationConfig(max_new_tokens=8, tool_choice="odd")
    with pytest.raises(SchemaError, match="not a valid regular expression: a group is not closed") as info:
        engine.chat(MESSAGES, [odd("(unclosed")], generation=generation, mode="full")
    assert info.value.path == "tools[0].function.parameters.properties.code.pattern"
    with pytest.raises(GrammarError, match="look-around, including look-ahead and look-behind") as grammar:
        engine.chat(MESSAGES, [odd("(?<=a)b")], generation=generation, mode="full")
    assert grammar.value.param == "tools" and len(str(grammar.value)) < 300  # the grammar's lines not quoted
