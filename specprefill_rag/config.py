"""Frozen, validated configuration: one small object per concern.

``SpecPrefillConfig`` bundles the draft, selection and generation settings an engine uses;
every per-request override is a ``dataclasses.replace`` of one of these.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, get_args

import torch

from .errors import ConfigError, ConfigTypeError
from .types import HeadReduction, is_int, is_number

LayerChoice = Literal["all", "upper_half", "lower_half", "middle_half"]
PositionMode = Literal["original", "contiguous"]
SelectionUnit = Literal["sentence", "chunk"]
TokenizerMapping = Literal["auto", "same", "offsets"]
OverflowPolicy = Literal["windows", "full", "raise"]
LookaheadTokens = Literal["siblings", "greedy"]
_Part = TypeVar("_Part")

__all__ = [
    "GREEDY_BELOW",
    "DraftConfig",
    "DraftRuntime",
    "GenerationConfig",
    "LayerChoice",
    "LookaheadTokens",
    "OverflowPolicy",
    "PositionMode",
    "SelectionConfig",
    "ScoringConfig",
    "SelectionUnit",
    "SpecPrefillConfig",
    "TokenizerMapping",
    "check_choice",
    "describe_choices",
]


# Temperatures below this decode greedily, in every backend: vLLM's rule (its _SAMPLING_EPS), and
# dividing logits by less overflows float32 into inf/nan probabilities.
GREEDY_BELOW = 1e-5
_INT64 = (-(1 << 63), (1 << 63) - 1)  # the range of a seed: OpenAI's and vLLM's int64


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def describe_choices(literal: Any, *, other: str | None = None) -> str:
    """The values of a ``Literal`` for a message: "'a', 'b' or 'c'" (``other`` last, if given)."""
    items = [repr(value) for value in get_args(literal)] + ([other] if other else [])
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def check_choice(name: str, value: object, literal: Any) -> None:
    """``ConfigError`` unless ``value`` is one of the values of the ``Literal`` ``literal``, the
    one place the choices of a field are written."""
    _check(value in get_args(literal), f"{name} must be {describe_choices(literal)}, got {value!r}")


def _check_types(obj: object, ints: tuple[str, ...] = (), numbers: tuple[str, ...] = (),
                 bools: tuple[str, ...] = ()) -> None:
    """ConfigTypeError for a field of the wrong type (a bool is not a number; 2.5 is not a count);
    ConfigError for a switch that is not True or False."""
    for name in bools:
        value = getattr(obj, name)
        _check(isinstance(value, bool), f"{name} must be True or False, got {value!r:.40}")
    for name in ints:
        value = getattr(obj, name)
        if value is not None and not is_int(value):
            raise ConfigTypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    for name in numbers:
        value = getattr(obj, name)
        if value is not None and not is_number(value):
            raise ConfigTypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")


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

    def __post_init__(self) -> None:
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

    def __post_init__(self) -> None:
        _check_types(
            self, ints=("max_batch", "memo_entries", "memo_bytes", "prefix_cache_entries", "prefix_cache_bytes",
                        "graph_max_tokens"),
            numbers=("batch_window_s", "batch_pad_limit"),
        )
        _check(self.max_batch >= 1, f"max_batch must be >= 1, got {self.max_batch}")
        _check(self.memo_entries >= 0, f"memo_entries must be >= 0, got {self.memo_entries}")
        _check(self.memo_bytes >= 0, f"memo_bytes must be >= 0, got {self.memo_bytes}")
        _check(self.prefix_cache_entries >= 0, f"prefix_cache_entries must be >= 0, got {self.prefix_cache_entries}")
        _check(self.prefix_cache_bytes >= 0, f"prefix_cache_bytes must be >= 0, got {self.prefix_cache_bytes}")
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


@dataclass(frozen=True)
class SelectionConfig:
    """Which prompt tokens the main model prefills.

    The budget is over the CONTEXT, the prunable tokens (retrieved passages, chat history):
    ``keep_rate`` of them (or ``token_budget`` of them). Protected tokens (instructions,
    question, template, tail) are always prefilled on top of it. The budget is filled with the
    best-scoring units of the context — whole sentences by default, never crossing a passage —
    best first; the last unit may overshoot the budget. With ``keep_mass`` the budget adapts:
    the smallest set of units holding that share of the draft's score mass over the context,
    with ``keep_rate`` as its ceiling. A prompt with context always keeps at least one unit.
    """

    keep_rate: float = 0.2  # fraction of the context's tokens prefilled, in (0, 1]
    token_budget: int | None = None  # context tokens prefilled; overrides keep_rate when set
    min_keep_tokens: int = 0  # context tokens; lower clamp on the budget
    max_keep_tokens: int | None = None  # context tokens; upper clamp on the budget
    keep_mass: float | None = None  # adaptive budget: share of the context's score mass, in (0, 1]
    unit: SelectionUnit = "sentence"  # what is kept or dropped whole: sentences or fixed chunks
    chunk_size: int = 32  # tokens per chunk (unit="chunk"; also text without sentence ends)
    max_sentence_tokens: int = 64  # tokens; a longer sentence is cut into pieces of this size
    passage_weight: float = 0.0  # in [0, 1]: share of a unit's rank taken from its passage's score
    # In [0, 1]: share of a unit's rank taken from its passage's retriever score (the number in
    # Passage.metadata["score"], higher = more relevant, e.g. a cosine similarity); used only when
    # passages carry one. 0 ignores the retriever. Measured on bench evidence (docs/benchmarks.md).
    retriever_weight: float = 0.25
    min_prompt_tokens: int = 256  # tokens; shorter prompts skip speculation (full prefill)
    protect_instructions: bool = True  # never prune the system instructions
    # Never prune earlier chat turns (history segments): turn k's prompt begins with turn k − 1's
    # conversation, which vLLM's prefix cache holds, so kept whole it costs little to prefill and a
    # plan's first gap comes after it. False lets a long history be pruned (no prefix cache).
    protect_history: bool = True
    protect_tail_tokens: int = 8  # tokens at the end of the prompt always kept
    positions: PositionMode = "original"  # "contiguous" re-indexes kept tokens (ablation only)

    def __post_init__(self) -> None:
        _check_types(
            self,
            ints=(
                "token_budget", "min_keep_tokens", "max_keep_tokens", "chunk_size",
                "max_sentence_tokens", "min_prompt_tokens", "protect_tail_tokens",
            ),
            numbers=("keep_rate", "keep_mass", "passage_weight", "retriever_weight"),
        )
        _check(
            0.0 < self.keep_rate <= 1.0,
            f"keep_rate must be in (0, 1], got {self.keep_rate!r}; "
            "use 1.0 to prefill everything or a token_budget for an absolute size",
        )
        _check(
            self.token_budget is None or self.token_budget >= 1,
            f"token_budget must be >= 1 or None, got {self.token_budget}",
        )
        _check(self.min_keep_tokens >= 0, f"min_keep_tokens must be >= 0, got {self.min_keep_tokens}")
        _check(
            self.max_keep_tokens is None or self.max_keep_tokens >= max(1, self.min_keep_tokens),
            f"max_keep_tokens ({self.max_keep_tokens}) must be >= max(1, min_keep_tokens)",
        )
        _check(
            self.keep_mass is None or 0.0 < self.keep_mass <= 1.0,
            f"keep_mass must be in (0, 1] or None, got {self.keep_mass}",
        )
        check_choice("unit", self.unit, SelectionUnit)
        _check(self.chunk_size >= 1, f"chunk_size must be >= 1, got {self.chunk_size}")
        _check(self.max_sentence_tokens >= 1, f"max_sentence_tokens must be >= 1, got {self.max_sentence_tokens}")
        _check(
            0.0 <= self.passage_weight <= 1.0, f"passage_weight must be in [0, 1], got {self.passage_weight}"
        )
        _check(
            0.0 <= self.retriever_weight <= 1.0,
            f"retriever_weight must be in [0, 1], got {self.retriever_weight}",
        )
        _check(self.min_prompt_tokens >= 0, "min_prompt_tokens must be >= 0")
        _check(self.protect_tail_tokens >= 0, "protect_tail_tokens must be >= 0")
        _check_types(self, bools=("protect_instructions", "protect_history"))
        check_choice("positions", self.positions, PositionMode)

    def budget(self, n_context: int) -> int:
        """Context tokens to prefill out of ``n_context`` prunable ones (protected come on top).

        At least one token whenever there is context: no keep rate leaves the main model with
        the question alone.
        """
        if n_context <= 0:
            return 0
        if self.token_budget is not None:
            budget = self.token_budget
        else:
            budget = math.ceil(self.keep_rate * n_context)
        budget = max(budget, self.min_keep_tokens, 1)
        if self.max_keep_tokens is not None:
            budget = min(budget, self.max_keep_tokens)
        return min(budget, n_context)


@dataclass(frozen=True)
class GenerationConfig:
    """Decoding settings for the main model."""

    max_new_tokens: int = 256  # tokens
    temperature: float = 0.0  # 0 (or below GREEDY_BELOW) = greedy
    top_p: float = 1.0  # nucleus sampling mass, in (0, 1]
    top_k: int = 0  # 0 = no top-k filter
    seed: int | None = None  # sampling seed, a signed 64-bit int; None = nondeterministic
    stop: tuple[str, ...] = ()  # stop strings; the text is cut before the first match
    # Seconds for the whole request (draft, prefill, every token; the backend gets what is left);
    # past it: BackendTimeoutError. None: no deadline.
    timeout: float | None = None
    # The request's cache namespace, vLLM's ``cache_salt`` (forwarded; the engine's caches key on
    # it too): cached work is shared only between requests of the same salt. None: shared.
    cache_salt: str | None = None
    # With tools offered: "auto", "required", "none" or a tool's name; decoded under the calls'
    # grammar where the backend can, checked always. False: at most one call (docs/tools.md).
    tool_choice: str = "auto"
    parallel_tool_calls: bool = True
    # Lark (llguidance's) the answer must match, e.g. ``grammar.json_grammar(schema)``. None: free.
    grammar: str | None = None

    def __post_init__(self) -> None:
        _check(self.grammar is None or (isinstance(self.grammar, str) and self.grammar.strip() != ""), "grammar must "
               f"be a non-empty string (Lark) or None, got {self.grammar!r:.80}")
        _check(isinstance(self.tool_choice, str) and self.tool_choice != "",
               f"tool_choice must be 'auto', 'required', 'none' or a tool's name, got {self.tool_choice!r:.80}")
        _check_types(self, ints=("max_new_tokens", "top_k", "seed"), numbers=("temperature", "top_p", "timeout"),
                     bools=("parallel_tool_calls",))
        _check(self.cache_salt is None or (isinstance(self.cache_salt, str) and self.cache_salt != ""),
               f"cache_salt must be a non-empty string or None, got {self.cache_salt!r:.80}")
        _check(self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        _check(
            math.isfinite(self.temperature) and self.temperature >= 0.0,
            f"temperature must be >= 0, got {self.temperature}",
        )
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}")
        _check(
            self.seed is None or _INT64[0] <= self.seed <= _INT64[1],
            f"seed must be a signed 64-bit integer, in [{_INT64[0]}, {_INT64[1]}], got {self.seed}",
        )
        _check(isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop),
               "stop must be a tuple of non-empty strings")
        _check(
            self.timeout is None or (math.isfinite(self.timeout) and self.timeout > 0),
            f"timeout must be a positive number of seconds or None, got {self.timeout}",
        )

    @property
    def greedy(self) -> bool:
        """Whether decoding takes the most likely token: a temperature below ``GREEDY_BELOW``."""
        return self.temperature < GREEDY_BELOW

    def with_overrides(self, **changes: Any) -> GenerationConfig:
        """A validated copy with ``changes`` applied; ``None`` values are skipped (a per-call
        option the caller did not set), ``stop`` may be any sequence of strings."""
        changes = {k: v for k, v in changes.items() if v is not None}
        if "stop" in changes and not isinstance(changes["stop"], tuple):
            changes["stop"] = tuple(s for s in changes["stop"] if s)
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class SpecPrefillConfig:
    """Everything an engine needs to know besides its models."""

    draft: DraftConfig = field(default_factory=DraftConfig)
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    instructions: str = (
        "Answer the question using only the provided context. "
        "Be concise. If the context does not contain the answer, say so."
    )
