"""The draft wing: a small model reads the whole prompt and scores how much each token matters.

The one door of the wing: the rest of the package, the benchmarks and the examples import these
names from ``specprefill_rag.draft``, never from a module inside it. The rooms:

- ``scorer``: ``DraftScorer``, what the engine calls: the draft's reading of a prompt (its own
  rendering; overflow and windows decided once), the score memo, micro-batching and the
  cross-tokenizer mapping around ``DraftModel.score_batch``.
- ``model``: ``DraftModel``, the draft loaded and switched to the capturing attention;
  ``capture`` / ``capture_batch`` record one prompt or a batch, ``score`` / ``score_batch``
  turn the capture into ``TokenScores``.
- ``capture``: the attention-registry wrapper and hooks that record query and key rows.
- ``forward``: the prompt's forward, the KV cache, padding and the prefix store's heads.
- ``lookahead``: the look-ahead drivers (greedy steps, siblings, verified guesses).
- ``lookahead_spec``: ``LookaheadSpec``, one look-ahead's settings, built from a ``DraftConfig``.
- ``early_exit``: the prompt's forward stops after the highest aggregated layer; the upper
  layers read a reading set to choose the look-ahead tokens.
- ``cuda_graphs``, ``short_query_attention``: the look-ahead's forwards made cheap on a GPU.
- ``prefix_store``: keys and values of prompt heads read once.
- ``windows``: a prompt longer than the draft's window, read in windows.
- ``scoring``: pure torch, attention rows → per-token importance.
- ``token_mapping``: a draft of another family's scores mapped onto the main prompt's tokens.
- ``batching``: concurrent score requests run as one batch.
"""

from .batching import MicroBatcher, TurnLock, length_buckets, padding_share
from .capture import CAPTURE_ATTENTION, DraftCapture, Recorder, recording
from .early_exit import DecoderParts, ExitedPrompts, tree_mask, upper_greedy
from .lookahead import reading_sets, upper_layer_logits
from .lookahead_spec import LookaheadSpec
from .model import DraftModel
from .scorer import DraftReading, DraftScorer
from .scoring import importance, layer_rows, query_weights
from .short_query_attention import SHORT_QUERY_TOKENS, attend_short_queries, short_query_limit
from .token_mapping import map_scores, needs_mapping
from .windows import MIN_WINDOW_CONTEXT

__all__ = [
    "CAPTURE_ATTENTION",
    "MIN_WINDOW_CONTEXT",
    "SHORT_QUERY_TOKENS",
    "DecoderParts",
    "DraftCapture",
    "DraftModel",
    "DraftReading",
    "DraftScorer",
    "ExitedPrompts",
    "LookaheadSpec",
    "MicroBatcher",
    "Recorder",
    "TurnLock",
    "attend_short_queries",
    "importance",
    "layer_rows",
    "length_buckets",
    "map_scores",
    "needs_mapping",
    "padding_share",
    "query_weights",
    "reading_sets",
    "recording",
    "short_query_limit",
    "tree_mask",
    "upper_greedy",
    "upper_layer_logits",
]
