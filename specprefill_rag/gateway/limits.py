"""What one request may hold in all, checked before its body is decoded and before its messages
are read one by one, so a hostile body costs time linear in its size and memory bounded by it.

The per-message limits (``messages.MAX_PARTS``: messages, a message's content parts, passages, a
message's documents) bound one message; these bound the request:

* ``decode_body``: the body as a JSON object, decoded only once ``check_containers`` passed;
* ``check_containers``: at most ``MAX_JSON_CONTAINERS`` JSON objects and arrays in the body,
  counted on the raw bytes (strings skipped) before ``json.loads`` builds any: eight megabytes of
  ``{"type": "text", "text": ""}`` parts would otherwise be 300,000 dicts (80 MB) before a check;
* ``check_totals``: at most ``MAX_SEGMENTS`` content parts, and as many tool documents, in all
  messages together, each tool message's documents counted without splitting and the count
  stopping at the limit (``prompt.count_documents``). The segments themselves are capped again
  where they are built (``prompt.message_segments``, ``messages.to_segments``).

docs/gateway.md, "Back-pressure and concurrency", states the limits and what a hostile body costs.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping
from typing import Any

from ..prompt import MAX_SEGMENTS, count_documents
from .responses import APIError

__all__ = ["MAX_JSON_CONTAINERS", "check_containers", "check_totals", "decode_body"]

# JSON objects and arrays in one request body: four per segment a request may make (a message, its
# content list, a part; a call and its function), far above what a context window's worth holds.
MAX_JSON_CONTAINERS = 4 * MAX_SEGMENTS
# A JSON string (escapes included; skipped whole, so brackets in text do not count), else one byte:
# a bracket, or a quote that opens no string (the body is no JSON: counting stops there, so no
# quote is scanned from twice and the count stays linear whatever the bytes).
_TOKEN = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"|["{}[\]]', re.DOTALL)
_QUOTE, _OPEN = 0x22, (0x7B, 0x5B)  # '"', '{' and '['


def check_containers(raw: bytes, limit: int = MAX_JSON_CONTAINERS) -> None:
    """400 when the body holds more than ``limit`` JSON objects and arrays. Linear in the body and
    holding nothing: a count of the raw brackets, and only when that passes the limit (a body of
    code holds many in its text) a count of those outside strings, token by token, stopping one
    past the limit. A body refused so that also nests deeper than ``json.loads`` goes is refused
    for that, as the decoder would have refused it."""
    if raw.count(b"{") + raw.count(b"[") <= limit:
        return
    count = depth = deepest = 0
    for token in _TOKEN.finditer(raw):
        if token.end() - token.start() > 1:  # a string
            continue
        byte = raw[token.start()]
        if byte == _QUOTE:  # an unclosed string: not JSON, which json.loads says
            return
        if byte not in _OPEN:
            depth -= 1
            continue
        count, depth = count + 1, depth + 1
        deepest = max(deepest, depth)
        if count > limit:
            if deepest >= sys.getrecursionlimit():  # the C decoder counts its depth against it
                raise APIError(400, "the request body nests JSON arrays or objects too deeply")
            raise APIError(400, f"the request body holds more than the gateway's limit of {limit} JSON objects and "
                           "arrays (messages, content parts, tool calls, ... in all): send fewer, longer parts")


def decode_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object: its objects and arrays counted first (``check_containers``),
    then decoded; 400 for a body that is no JSON, nests too deeply or is not an object."""
    check_containers(raw)  # before json.loads builds them
    try:
        body = json.loads(raw)
    except ValueError:
        raise APIError(400, "the request body is not valid JSON") from None
    except RecursionError:  # the C decoder counts its depth against the recursion limit
        raise APIError(400, "the request body nests JSON arrays or objects too deeply") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _tool_text(content: object) -> str:
    """A tool message's text as the request parser reads it: its text parts joined by blank lines
    (each a document). Parts of the wrong shape are skipped here: the parser refuses them."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    return "\n\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))


def check_totals(body: Mapping[str, Any], limit: int = MAX_SEGMENTS) -> None:
    """400 naming the message where the content parts, or the tool documents, of all messages
    together pass ``limit``: counted before any message is split, each count stopping there."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    parts = documents = 0
    for n, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):
            parts += len(content)
            if parts > limit:
                raise APIError(400, f"the messages hold more than {limit} content parts in all, passed at "
                               f"messages[{n}]: send fewer, longer parts", param=f"messages[{n}].content")
        if message.get("role") == "tool":
            documents += count_documents(_tool_text(content), limit - documents)
            if documents > limit:
                raise APIError(400, f"the tool messages hold more than {limit} documents in all (texts separated by "
                               f"blank lines, or items of a JSON array), passed at messages[{n}]: return fewer, "
                               "longer documents", param=f"messages[{n}].content")
