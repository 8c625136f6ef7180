"""The prompt side of the pipeline: what the main model (and the draft) read, before any model runs.

- ``segments``: chat messages and retrieved documents → ``Segment`` objects (instructions,
  passages, history, question); the one place segments are built.
- ``render``: segments → chat-templated text → token ids, with the segment map, the protected
  mask and character offsets (``assemble``; ``assemble_cached`` for a retry; ``render.render``,
  the chat-templated text alone).
- ``tool_segments`` / ``layout``: agent chats (tool schemas, tool calls, tool results split per
  document) → segments; segments → chat messages → the templated text with spans by construction.
- ``length_guard``: a prompt refused by its length before it is tokenized (``check_length``).
"""

from .layout import check_tool_support
from .length_guard import check_length, max_chars_per_token
from .render import (
    assemble,
    assemble_cached,
    cut_levels,
    kept_runs,
    markup_tokens,
    sentence_breaks,
    special_token_ids,
)
from .segments import (
    MAX_SEGMENTS,
    Passages,
    as_passages,
    build_segments,
    chat_segments,
    passage_segments,
    request_segments,
    split_documents,
)
from .tool_segments import (
    count_documents,
    echoed_question,
    has_tool_messages,
    message_segments,
    split_tool_result,
    tool_schema,
)

__all__ = [
    "MAX_SEGMENTS",
    "Passages",
    "as_passages",
    "assemble",
    "assemble_cached",
    "build_segments",
    "chat_segments",
    "check_length",
    "check_tool_support",
    "count_documents",
    "cut_levels",
    "echoed_question",
    "has_tool_messages",
    "kept_runs",
    "markup_tokens",
    "message_segments",
    "max_chars_per_token",
    "passage_segments",
    "request_segments",
    "sentence_breaks",
    "special_token_ids",
    "split_documents",
    "split_tool_result",
    "tool_schema",
]
