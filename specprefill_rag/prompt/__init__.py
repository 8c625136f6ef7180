"""The prompt side of the pipeline: what the main model (and the draft) read, before any model runs.

- ``segments``: chat messages and retrieved documents → ``Segment`` objects (instructions,
  passages, history, question); the one place segments are built.
- ``render``: segments → chat-templated text → token ids, with the segment map, the protected
  mask and character offsets (``assemble``; ``assemble_cached`` for a retry; ``render.render``,
  the chat-templated text alone).
- ``length_guard``: a prompt refused by its length before it is tokenized (``check_length``).
"""

from .length_guard import check_length, max_chars_per_token
from .render import assemble, assemble_cached, cut_levels, kept_runs, sentence_breaks, special_token_ids
from .segments import (
    Passages,
    as_passages,
    build_segments,
    chat_segments,
    passage_segments,
    request_segments,
    split_documents,
)

__all__ = [
    "Passages",
    "as_passages",
    "assemble",
    "assemble_cached",
    "build_segments",
    "chat_segments",
    "check_length",
    "cut_levels",
    "kept_runs",
    "max_chars_per_token",
    "passage_segments",
    "request_segments",
    "sentence_breaks",
    "special_token_ids",
    "split_documents",
]
