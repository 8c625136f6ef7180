"""The draft's settings: its scoring rule (``ScoringConfig``, what the score memo keys on) and how
it runs (``DraftRuntime``), together as ``DraftConfig``."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, get_args

import torch

from ..errors import ConfigError
from ..types import HeadReduction, is_int
from .checks import check as _check
from .checks import check_choice, describe_choices
from .checks import check_types as _check_types

LayerChoice = Literal["all", "upper_half", "lower_half", "middle_half"]
TokenizerMapping = Literal["auto", "same", "offsets"]
OverflowPolicy = Literal["windows", "full", "raise"]
LookaheadTokens = Literal["siblings", "greedy"]
RecomputeKind = Literal["none", "all", "first", "scored", "deviation"]
_Part = TypeVar("_Part")

__all__ = [
    "DraftConfig", "DraftRuntime", "LayerChoice", "LookaheadTokens", "OverflowPolicy", "PassageReading",
    "RecomputeKind", "ScoringConfig", "TokenizerMapping",
]


@dataclass(frozen=True)
class PassageReading:
    """How the draft reads passages apart (``ScoringConfig.passages``, ``draft.passage_reading``):
    each passage against the prompt's anchor (the tokens before its first non-system segment) and
    itself, kept in the draft's passage store and reused wherever it appears again, its rotary keys
    re-rotated to where it sits; the rest of the prompt (the question, separators, the template's
    tail) and the look-ahead read everything. A passage read alone misses what its neighbours say:
    ``recompute`` chooses passage tokens whose layers from ``recompute_from`` on are read again
    jointly, over every other token, on each request."""

    # "all" (the default, measured: the one that keeps joint reading's evidence): every passage
    # token is read again jointly from recompute_from on, so the store keeps only the layers below
    # it; "none": no passage token is read jointly; "first": the first first_tokens of each passage;
    # "scored": the recompute_share of the passages' tokens the question and the last token attend
    # to most in a first pass; "deviation": every token through layer recompute_from jointly, then
    # the recompute_share whose hidden states that moved most (CacheBlend) on through the rest.
    recompute: RecomputeKind = "all"
    recompute_from: int | None = None  # draft layer; None: the lowest aggregated layer
    recompute_share: float = 0.15  # "scored", "deviation": share of the passages' tokens, in (0, 1]
    first_tokens: int = 8  # "first": tokens at the start of each passage

    def __post_init__(self) -> None:
        _check_types(self, ints=("recompute_from", "first_tokens"), numbers=("recompute_share",))
        check_choice("recompute", self.recompute, RecomputeKind)
        _check(self.recompute_from is None or self.recompute_from >= 0,
               f"recompute_from must be a layer index >= 0 or None, got {self.recompute_from}")
        _check(0.0 < self.recompute_share <= 1.0, f"recompute_share must be in (0, 1], got {self.recompute_share}")
        _check(self.first_tokens >= 1, f"first_tokens must be >= 1, got {self.first_tokens}")

    def start_layer(self, aggregated: list[int]) -> int:
        """The layer recomputed tokens are read jointly from, for these ``aggregated`` layers."""
        return min(aggregated) if self.recompute_from is None else self.recompute_from


@dataclass(frozen=True)
class ScoringConfig:
    """The draft's scoring rule: how it turns a prompt into per-token importance. Two equal
    rules give the same scores for the same prompt; the score memo keys on this.

    Queries come in two groups: the question's own tokens (their attention over the context
    finds the passages that match what is asked) and the look-ahead (the last prompt token plus
    the draft's greedy continuation, the reference's query set, which finds the value the draft
    is about to write). ``lookahead_weight`` splits the vote. Defaults are measured on
    ``bench evidence`` (docs/benchmarks.md, docs/algorithm.md).
    """

    # L: queries of the last prompt token + (L - 1) tokens after it, chosen by lookahead_tokens.
    lookahead: int = 8
    # Which L - 1 tokens: "greedy" = the reference's L - 1 sequential greedy decode steps (L - 1
    # more forwards); "siblings" = the L - 1 likeliest next tokens, scored together in ONE more
    # forward, each at position n seeing the prompt and itself. Siblings cost one forward and
    # match greedy with the Qwen 0.5B draft, but lose near-miss evidence with SmolLM2-135M, whose
    # answers open with a preamble the siblings never get past (docs/configuration.md).
    lookahead_tokens: LookaheadTokens = "greedy"
    # Share of the look-ahead queries in the score, in [0, 1]; the question's tokens get the rest.
    # 0 skips the look-ahead decode entirely: the draft then costs one plain prefill.
    lookahead_weight: float = 0.5
    pool_kernel: int = 13  # tokens; odd width of the average pool along the prompt
    layers: LayerChoice | tuple[int, ...] = "middle_half"  # draft layers whose attention is aggregated
    heads: HeadReduction = "max"  # how one layer's heads are combined
    normalize: bool = False  # renormalise each attention row over the context tokens
    # How draft scores reach the main model's tokens: "same" demands the main tokenizer (scores
    # are read index by index); "offsets" renders the prompt with the draft's own tokenizer and
    # maps scores through character offsets (any draft family); "auto" = "same" when the
    # tokenizers are identical, else "offsets".
    tokenizer_mapping: TokenizerMapping = "auto"
    # Stop the draft's forward over the prompt after the highest aggregated layer: no upper layer
    # and no LM head over the whole prompt. The rows of the aggregated layers are exactly those of
    # the full forward; the look-ahead tokens come from the upper layers run over a reading set
    # (upper_keep), in every greedy step too. False: full forwards (the reference).
    early_exit: bool = True
    # With early exit: share of the prompt's tokens, in (0, 1], the draft's upper layers read to
    # choose the look-ahead tokens (the best by the aggregated layers' rows of the question and
    # the last token, plus the question, the first and the last tokens). 1.0: the full forward's
    # tokens exactly.
    upper_keep: float = 0.3
    # With early exit, greedy tokens may be found by verification: each forward feeds the next
    # token plus up to lookahead_guesses guesses of the ones after it (what followed the same
    # tokens in the prompt: RAG answers copy) and keeps those the draft's own argmax confirms.
    # The tokens and queries are exactly the steps' (tested); only the forwards change: 4.1
    # instead of 7 on average (Qwen 0.5B, 110 RAG prompts), but each feeds 7 tokens. 0: one
    # decode step per token. None (auto): L - 2 where a forward of 7 tokens costs what one of a
    # single token does, reading the weights: a CUDA draft, and a CPU draft in bf16/fp16 (0.10 s
    # either way for the Qwen 0.5B draft over 1.7k tokens); 0 for a CPU draft in float32, where a
    # 7-token forward costs ~4.6x a step.
    lookahead_guesses: int | None = None
    # Greedy look-ahead only: stop where the draft's answer ends. Its queries are those of the
    # tokens before its first end-of-turn token (``DraftModel.end_ids``: the tokenizer's EOS and
    # the generation config's); the tokens it would write after its answer ("\n", "I apologize
    # ...") are not fed. Fewer sequential forwards whenever the answer is short: 4.4 instead of 7
    # with the Qwen 0.5B draft on RAG prompts, evidence unchanged (paired, HotpotQA n=200).
    # False: always L - 1 tokens (the reference).
    lookahead_stop_at_eos: bool = True
    # Where context follows the question (tool results after the user's turn), the draft reads the
    # question once more after the last message, so the question's queries see that context and
    # the look-ahead answers it instead of continuing the tool's turn (scores carried back by
    # segment). False: the draft reads the main prompt as is (docs/tools.md has the measurements).
    echo_question: bool = True
    # Read each passage once (``PassageReading()``): the draft reads passages apart and keeps each
    # reading's lower layers in its passage store (DraftRuntime.passage_store_bytes), so a passage
    # seen before costs it only the layers from the lowest aggregated one on. Needs early exit and
    # a draft whose layers can be run by hand (else it reads jointly). None (the default): every
    # token of every prompt jointly, a repeated head served by the prefix store. PassageReading()
    # holds joint reading's evidence with the Qwen 0.5B draft and not (yet) with SmolLM2-135M
    # (docs/findings.md#reading-each-passage-once): an option until it holds for every draft.
    passages: PassageReading | None = None

    def __post_init__(self) -> None:
        _check(self.passages is None or isinstance(self.passages, PassageReading),
               f"passages must be a PassageReading or None, got {type(self.passages).__name__}")
        _check_types(self, ints=("lookahead", "pool_kernel", "lookahead_guesses"),
                     numbers=("lookahead_weight", "upper_keep"),
                     bools=("normalize", "early_exit", "lookahead_stop_at_eos", "echo_question"))
        _check(self.lookahead >= 1, f"lookahead must be >= 1, got {self.lookahead}")
        _check(
            0.0 <= self.lookahead_weight <= 1.0,
            f"lookahead_weight must be in [0, 1], got {self.lookahead_weight}",
        )
        check_choice("heads", self.heads, HeadReduction)
        _check(0.0 < self.upper_keep <= 1.0, f"upper_keep must be in (0, 1], got {self.upper_keep}")
        _check(
            self.lookahead_guesses is None or self.lookahead_guesses >= 0,
            f"lookahead_guesses must be >= 0 or None (auto), got {self.lookahead_guesses}",
        )
        check_choice("lookahead_tokens", self.lookahead_tokens, LookaheadTokens)
        _check(
            self.pool_kernel >= 1 and self.pool_kernel % 2 == 1,
            f"pool_kernel must be a positive odd number of tokens, got {self.pool_kernel}",
        )
        if isinstance(self.layers, tuple):
            _check(len(self.layers) > 0, "layers must name at least one layer index")
            _check(all(is_int(i) and i >= 0 for i in self.layers), f"layer indices must be ints >= 0: {self.layers}")
        else:
            _check(
                self.layers in get_args(LayerChoice),
                f"layers must be {describe_choices(LayerChoice, other='a tuple of indices')}, got {self.layers!r}",
            )
        check_choice("tokenizer_mapping", self.tokenizer_mapping, TokenizerMapping)

    def lookahead_for(self, n_question: int) -> int:
        """Look-ahead length to run for a prompt with ``n_question`` question tokens: 1 (no
        decoding) when the look-ahead gets no vote and the question can carry the score."""
        return 1 if n_question and self.lookahead_weight == 0.0 else self.lookahead

    def guesses_on(self, device_type: str, lookahead: int | None = None, dtype: Any = None) -> int:
        """Guesses verified per greedy forward by a draft on ``device_type`` ("cuda", "cpu", ...)
        in ``dtype`` for a look-ahead of ``lookahead`` (default this config's):
        ``lookahead_guesses``, or for None (auto) every remaining token where a forward of 7
        tokens costs what one of a single token does (reading the weights: on CUDA, and on a CPU
        in bf16/fp16), none where it costs several times more (a CPU in float32)."""
        if self.lookahead_guesses is not None:
            return self.lookahead_guesses
        all_of_them = max(0, (self.lookahead if lookahead is None else lookahead) - 2)
        if device_type == "cuda":
            return all_of_them
        return all_of_them if device_type == "cpu" and dtype in (torch.bfloat16, torch.float16) else 0

    def extra_positions(self, lookahead: int, tokens: LookaheadTokens | None = None) -> int:
        """Positions past the prompt a look-ahead of ``lookahead`` queries of ``tokens`` (default:
        ``lookahead_tokens``) occupies: the siblings share one, greedy tokens take one each."""
        if lookahead <= 1:
            return 0
        return 1 if (tokens or self.lookahead_tokens) == "siblings" else lookahead - 1

    def layer_indices(self, n_layers: int) -> list[int]:
        """Indices of the aggregated layers of a draft with ``n_layers`` layers."""
        quarter = n_layers // 4
        named = {
            "all": range(n_layers),
            "upper_half": range(n_layers // 2, n_layers),
            "lower_half": range(max(1, n_layers // 2)),
            "middle_half": range(quarter, max(quarter + 1, n_layers - quarter)),
        }
        if isinstance(self.layers, str):
            return list(named[self.layers])
        bad = [i for i in self.layers if i >= n_layers]
        if bad:
            raise ConfigError(f"draft has {n_layers} layers; layer indices {bad} do not exist")
        return sorted(set(self.layers))


@dataclass(frozen=True)
class DraftRuntime:
    """How the draft runs, never what it scores: batching, overflow, the caches and CUDA graphs.
    Two configs that differ only here give the same scores (within floating-point tolerance)."""

    # Concurrent requests' scoring runs as one padded draft batch of up to max_batch prompts,
    # formed within batch_window_s of the first one's arrival. 1: each request scores alone.
    # Worth it on a GPU (one pass for many prompts); on a CPU the draft is compute-bound.
    max_batch: int = 1
    batch_window_s: float = 0.002  # seconds
    # Concurrent requests' draft passes run one at a time, in arrival order (``draft.batching.TurnLock``):
    # the k-th of N requests that start together has its scores after k passes, not all N after N
    # passes, and goes on to the main model while the next pass runs. False (the default): all at
    # once, sharing the device. On a 2-core CPU with vLLM beside it, 16 clients at once: in order
    # cut the gateway's p50 TTFT but raised its p95 (docs/configuration.md), so it is opt-in.
    passes_in_order: bool = False
    # A batch of prompts of different lengths runs as padded passes of near-equal lengths
    # (``draft.batching.length_buckets``): a prompt shares a pass while padding stays at most
    # this share of it. 1.0: one padded pass for the whole batch; 0.0: equal lengths only.
    batch_pad_limit: float = 0.25
    # A prompt that fits the main model but not the draft's window (look-ahead included):
    # "windows" reads it in windows that each hold the protected tokens (instructions, question)
    # and a run of the context (``DraftModel.windows``), falling back to "full" when the protected
    # part alone fills the window; "full" prefills it whole and logs a warning; "raise" refuses it
    # with InputError.
    on_overflow: OverflowPolicy = "windows"
    # The engine keeps the scores of its last memo_entries prompts (at most memo_bytes of score
    # tensors together), keyed by what the draft reads and the scoring fields of this config:
    # an identical request (a retry, "regenerate") skips the draft. 0: no memo.
    memo_entries: int = 32
    memo_bytes: int = 64 * 2**20
    # The draft keeps its keys and values of the protected start of its last prefix_cache_entries
    # prompts (at most prefix_cache_bytes together; ``draft.prefix_store``): a prompt that begins with one
    # (the same system prompt, a chat's earlier turns) is read from where it ends. About 20 KB
    # per token with the Qwen 0.5B draft in float32. Scores equal a full read's within
    # floating-point tolerance. 0: every prompt is read whole.
    prefix_cache_entries: int = 8
    prefix_cache_bytes: int = 512 * 2**20
    # CUDA graphs of the greedy look-ahead's forwards (``draft.cuda_graphs``), captured by the engine's
    # warm-up for padded prompt widths 512, 1024, … up to graph_max_tokens (and the draft's
    # window) and replayed per request: one launch per forward instead of one per kernel. A
    # prompt wider than that, or a batch size not captured, runs the same loop eagerly. Static
    # buffers cost about (draft layers × 2 × kv_heads × head_dim × dtype bytes) per token per
    # width (~32 KB/token for a 1B Llama in bf16: ~2 GB for all widths up to 32k).
    # Only a CUDA draft captures graphs; False: never (every forward eager).
    cuda_graphs: bool = True
    graph_max_tokens: int = 32768
    # Prefill a prompt whole when pruning would not pay right now: the draft tokens queued ahead of
    # it plus its own, at the draft's measured seconds per token, would take at least the
    # main-model prefill pruning saves, at the main model's (``payoff.PrefillCosts``: running
    # measurements of the engine's own requests; the first requests prune). For servers under load.
    # The answer's ``path`` says "draft_slower". False: every prompt the draft can read is pruned.
    skip_when_slower: bool = False
    # The draft's passage store (ScoringConfig.passages): its readings of passages in memory, at
    # most passage_store_bytes together, least recently used first out (``draft.passage_store``).
    # passage_store_dir: a directory that keeps them beyond memory and restarts, at most
    # passage_store_disk_bytes of files (None: memory only).
    passage_store_bytes: int = 1 << 30
    passage_store_dir: str | None = None
    passage_store_disk_bytes: int = 16 << 30

    def __post_init__(self) -> None:
        _check_types(
            self, ints=("max_batch", "memo_entries", "memo_bytes", "prefix_cache_entries", "prefix_cache_bytes",
                        "graph_max_tokens", "passage_store_bytes", "passage_store_disk_bytes"),
            numbers=("batch_window_s", "batch_pad_limit"),
        )
        _check(self.max_batch >= 1, f"max_batch must be >= 1, got {self.max_batch}")
        _check(self.memo_entries >= 0, f"memo_entries must be >= 0, got {self.memo_entries}")
        _check(self.memo_bytes >= 0, f"memo_bytes must be >= 0, got {self.memo_bytes}")
        _check(self.prefix_cache_entries >= 0, f"prefix_cache_entries must be >= 0, got {self.prefix_cache_entries}")
        _check(self.prefix_cache_bytes >= 0, f"prefix_cache_bytes must be >= 0, got {self.prefix_cache_bytes}")
        _check(self.passage_store_bytes >= 0 and self.passage_store_disk_bytes >= 0,
               "passage_store_bytes and passage_store_disk_bytes must be >= 0")
        where = self.passage_store_dir
        _check(where is None or (isinstance(where, str) and where != ""),
               f"passage_store_dir must be a directory path or None, got {self.passage_store_dir!r:.80}")
        _check_types(self, bools=("cuda_graphs", "passes_in_order", "skip_when_slower"))
        _check(self.graph_max_tokens >= 1, f"graph_max_tokens must be >= 1, got {self.graph_max_tokens}")
        _check(
            math.isfinite(self.batch_window_s) and self.batch_window_s >= 0,
            f"batch_window_s must be >= 0 seconds, got {self.batch_window_s}",
        )
        _check(0 <= self.batch_pad_limit <= 1, f"batch_pad_limit must be within [0, 1], got {self.batch_pad_limit}")
        check_choice("on_overflow", self.on_overflow, OverflowPolicy)

    def graphs_on(self, device_type: str) -> bool:
        """Whether a draft on ``device_type`` captures its look-ahead as CUDA graphs."""
        return device_type == "cuda" and self.cuda_graphs


def _part(config: object, part: type[_Part]) -> _Part:
    """The fields of ``part`` (a dataclass ``config`` inherits from) read off ``config``."""
    return part(**{f.name: getattr(config, f.name) for f in dataclasses.fields(part)})  # type: ignore[arg-type]


@dataclass(frozen=True)
class DraftConfig(ScoringConfig, DraftRuntime):
    """Everything about the draft, in one flat set of keywords: the scoring rule
    (``ScoringConfig``: what the scores are, what the memo keys on, ``rule``) and how the draft
    runs (``DraftRuntime``: batching, overflow, caches, CUDA graphs, ``runtime``). Each part
    documents and validates its own fields."""

    def __post_init__(self) -> None:
        DraftRuntime.__post_init__(self)
        ScoringConfig.__post_init__(self)

    @property
    def rule(self) -> ScoringConfig:
        """The scoring rule alone: what the engine's score memo keys on."""
        return _part(self, ScoringConfig)

    @property
    def runtime(self) -> DraftRuntime:
        """The run-time settings alone."""
        return _part(self, DraftRuntime)
