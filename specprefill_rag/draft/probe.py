"""The draft wing's research hooks: unstable, for the benchmarks, not for applications.

``bench evidence``, ``bench ttft``, ``gpu_ttft`` and their kin take the draft apart to measure one
piece at a time (a look-ahead variant on a shared forward, one layer's rows, the short-query
kernel against the reference, how micro-batches bucket). They reach the wing's rooms through
this module, the wing's second door, and nothing here is promised to stay: a name moves or goes
whenever the room behind it changes. Applications use ``specprefill_rag.draft`` (``DraftModel``,
``DraftScorer``) or, better, the engine.
"""

from __future__ import annotations

from .batching import in_buckets, length_buckets, padding_share
from .capture import Recorder, recording
from .early_exit import DecoderParts, ExitedPrompts, tree_mask, upper_greedy
from .lookahead import reading_sets, upper_layer_logits
from .lookahead_spec import LookaheadSpec
from .scoring import importance, layer_rows, query_weights
from .short_query_attention import SHORT_QUERY_TOKENS, attend_short_queries, short_query_limit

__all__ = [
    "SHORT_QUERY_TOKENS",
    "DecoderParts",
    "ExitedPrompts",
    "LookaheadSpec",
    "Recorder",
    "attend_short_queries",
    "importance",
    "in_buckets",
    "layer_rows",
    "length_buckets",
    "padding_share",
    "query_weights",
    "reading_sets",
    "recording",
    "short_query_limit",
    "tree_mask",
    "upper_greedy",
    "upper_layer_logits",
]
