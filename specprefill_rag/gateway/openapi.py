"""The request bodies as JSON schemas, for the gateway's own OpenAPI document (``app.openapi()``).

The routes read their bodies themselves (``protocol``), so FastAPI cannot see their shape: these
schemas describe it (``openapi_extra`` on each route). The document is not served —
``create_app`` keeps ``/openapi.json`` off, so a gateway does not describe itself to whoever asks —
but tools can take it from ``app.openapi()``: the fuzzer does (``tests/test_gateway_fuzz.py``).
The schemas are looser than the parser where a rule spans fields (the last user message is the
question, ``stream_options`` needs ``stream``): what they let through that the gateway cannot
serve is a 400 naming the field, which is what the fuzzer checks.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CHAT_REQUEST", "COMPLETION_REQUEST", "PASSAGES_REQUEST", "RESPONSES_REQUEST", "request_body"]

_STRING: dict[str, Any] = {"type": "string"}
_TEXT: dict[str, Any] = {"type": "string", "pattern": "\\S"}  # says something
_BOOLEAN: dict[str, Any] = {"type": "boolean"}
_OBJECT: dict[str, Any] = {"type": "object"}  # any JSON object (a schema, metadata)
_NAME = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}  # a function's (``tools``)
_CALL_ID = {"type": "string", "pattern": "^[A-Za-z0-9_.:+/=-]{1,128}$"}

_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": _STRING}}
_CONTENT = {"anyOf": [_TEXT, {"type": "array", "minItems": 1, "items": _TEXT_PART}]}
_TOOL_CALL = {"type": "object", "required": ["id", "type", "function"], "properties": {
    "id": _CALL_ID, "type": {"const": "function"},
    "function": {"type": "object", "required": ["name", "arguments"],
                 "properties": {"name": _NAME, "arguments": {"anyOf": [  # JSON text of an object, or the object
                     {"type": "string", "contentMediaType": "application/json"}, _OBJECT]}}}}}
_MESSAGE = {"oneOf": [
    {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"enum": ["system", "developer", "user"]}, "content": _CONTENT, "name": _STRING}},
    {"type": "object", "required": ["role"], "properties": {
        "role": {"const": "assistant"}, "content": {"anyOf": [_CONTENT, {"type": "null"}]},
        "tool_calls": {"type": "array", "items": _TOOL_CALL}}},
    {"type": "object", "required": ["role", "tool_call_id", "content"], "properties": {
        "role": {"const": "tool"}, "tool_call_id": _CALL_ID, "content": _CONTENT}}]}
_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": _NAME, "description": _STRING, "parameters": _OBJECT, "strict": _BOOLEAN}}}}
_TOOL_CHOICE = {"anyOf": [
    {"enum": ["auto", "none", "required"]},
    {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {"name": _NAME}}}}]}
_RESPONSE_FORMAT = {"anyOf": [
    {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
    {"type": "object", "required": ["type", "json_schema"], "properties": {
        "type": {"const": "json_schema"},
        "json_schema": {"type": "object", "required": ["name", "schema"], "properties": {
            "name": _STRING, "schema": _OBJECT, "strict": _BOOLEAN}}}}]}
_PASSAGE = {"anyOf": [_STRING, {"type": "object", "required": ["text"], "properties": {
    "text": _STRING, "id": _STRING, "metadata": _OBJECT}}]}
_EXTENSION = {"type": "object", "additionalProperties": False, "properties": {
    "mode": {"enum": ["specprefill", "full", "text"]},
    "keep_rate": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "passages": {"type": "array", "items": _PASSAGE}, "question": _TEXT}}
_COMMON = {
    "model": _STRING,
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": -1},
    "seed": {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1},
    "stop": {"anyOf": [{"type": "string", "minLength": 1},
                       {"type": "array", "items": {"type": "string", "minLength": 1}}]},
    "stream": _BOOLEAN,
    "stream_options": {"type": "object", "properties": {"include_usage": _BOOLEAN}},  # with stream only
    "n": {"const": 1},  # one choice per request
    "cache_salt": {"type": "string", "minLength": 1},
    "response_format": _RESPONSE_FORMAT,
    "specprefill": _EXTENSION,
}

CHAT_REQUEST: dict[str, Any] = {"type": "object", "required": ["messages"], "properties": {
    **_COMMON,
    "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
    "max_completion_tokens": {"type": "integer", "minimum": 1},
    "tools": {"type": "array", "items": _TOOL},
    "tool_choice": _TOOL_CHOICE,
    "parallel_tool_calls": _BOOLEAN,
}}
COMPLETION_REQUEST: dict[str, Any] = {"type": "object", "required": ["prompt"], "properties": {
    **_COMMON,
    "prompt": {"anyOf": [_TEXT, {"type": "array", "minItems": 1, "maxItems": 1, "items": _TEXT}]},
}}

# ``POST /v1/responses`` (``responses_api``): OpenAI's Responses API, read as the chat request it is.
_INPUT_PART = {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"enum": ["input_text", "output_text"]}, "text": _STRING}}
_INPUT_CONTENT = {"anyOf": [_TEXT, {"type": "array", "minItems": 1, "items": _INPUT_PART}]}
_INPUT_ITEM = {"oneOf": [
    {"type": "object", "required": ["role", "content"], "properties": {
        "type": {"const": "message"}, "role": {"enum": ["system", "developer", "user", "assistant"]},
        "content": _INPUT_CONTENT}},
    {"type": "object", "required": ["type", "call_id", "name", "arguments"], "properties": {
        "type": {"const": "function_call"}, "call_id": _CALL_ID, "name": _NAME,
        "arguments": {"type": "string", "contentMediaType": "application/json"}}},
    {"type": "object", "required": ["type", "call_id", "output"], "properties": {
        "type": {"const": "function_call_output"}, "call_id": _CALL_ID, "output": _INPUT_CONTENT}}]}
_FUNCTION_TOOL = {"type": "object", "required": ["type", "name"], "properties": {
    "type": {"const": "function"}, "name": _NAME, "description": _STRING, "parameters": _OBJECT,
    "strict": _BOOLEAN}}
_TEXT_FORMAT = {"anyOf": [
    {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
    {"type": "object", "required": ["type", "name", "schema"], "properties": {
        "type": {"const": "json_schema"}, "name": _STRING, "schema": _OBJECT, "strict": _BOOLEAN}}]}
RESPONSES_REQUEST: dict[str, Any] = {"type": "object", "required": ["input"], "properties": {
    "model": _STRING,
    "input": {"anyOf": [_TEXT, {"type": "array", "minItems": 1, "items": _INPUT_ITEM}]},
    "instructions": _STRING,
    "max_output_tokens": {"type": "integer", "minimum": 1},
    "temperature": _COMMON["temperature"],
    "top_p": _COMMON["top_p"],
    "tools": {"type": "array", "items": _FUNCTION_TOOL},
    "tool_choice": {"anyOf": [{"enum": ["auto", "none", "required"]}, {
        "type": "object", "required": ["type", "name"], "properties": {"type": {"const": "function"}, "name": _NAME}}]},
    "parallel_tool_calls": _BOOLEAN,
    "text": {"type": "object", "properties": {"format": _TEXT_FORMAT}},
    "stream": _BOOLEAN,
    "store": _BOOLEAN,
    "previous_response_id": _STRING,
    "metadata": _OBJECT,
    "cache_salt": _COMMON["cache_salt"],
    "specprefill": _EXTENSION,
}}

# ``POST /v1/passages`` (``passages``): a corpus to read ahead, after a system part, in a namespace.
PASSAGES_REQUEST: dict[str, Any] = {"type": "object", "required": ["passages"], "additionalProperties": False,
                                    "properties": {
    "passages": {"type": "array", "minItems": 1, "items": {"anyOf": [_STRING, {
        "type": "object", "required": ["text"], "properties": {"text": _STRING, "id": _STRING}}]}},
    "instructions": _STRING,
    "cache_salt": {"type": "string", "minLength": 1},
}}


def request_body(schema: dict[str, Any]) -> dict[str, Any]:
    """A route's ``openapi_extra``: its JSON body, described by ``schema``."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
