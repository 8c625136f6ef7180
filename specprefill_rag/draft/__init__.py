"""The draft wing: a small model reads the whole prompt and scores how much each token matters.

The one door of the wing: the rest of the package, the examples and the integrations import
these four names from ``specprefill_rag.draft``, never from a module inside it: ``DraftModel``
(the draft loaded, ``DraftModel.from_pretrained``), ``DraftScorer`` and ``DraftReading`` (what the
engine calls) and ``CAPTURE_ATTENTION`` (the attention implementation the draft reads through).
Research hooks (the capture's recorder, the early exit's parts, the look-ahead's drivers, the
scoring's pieces) are in ``specprefill_rag.draft.probe``: unstable, for the benchmarks, changed
whenever the wing's rooms change. The rooms:

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
- ``passage_reading``, ``passage_kv``, ``passage_store``: passages read apart, once, and kept.
- ``probe``: the research hooks above, for the benchmarks (unstable).
"""

from .capture import CAPTURE_ATTENTION
from .model import DraftModel
from .scorer import DraftReading, DraftScorer

__all__ = ["CAPTURE_ATTENTION", "DraftModel", "DraftReading", "DraftScorer"]
