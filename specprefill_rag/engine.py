"""SpecPrefillEngine: assemble → score (draft) → select → prefill + decode (backend).

The same engine runs the full-prefill baseline (``mode="full"``), so SpecPrefill and full
prefill can be compared side by side on one backend. Every entry point has a streaming and
an async form; all return or end in a typed ``GenerationResult``.

Planning is one pipeline, each stage written once:

- ``request_selection``: a request's options, checked (mode, keep rate, selection);
- ``assemble``: question and passages (or segments) → the main model's prompt;
- ``_choose``: the path: pruned, with what the draft reads (``DraftScorer.choose``), or prefilled
  whole and why (``payoff``: cannot help, cannot read, would not pay);
- ``_plan``: the draft's scores (``DraftScorer.score``: memo, batching, mapping), then
  ``selection.plan_scored``: scores → kept tokens → ``PrefillPlan``, timed;
- decoding: ``prefill_and_decode``, the plan on the backend, streamed, with timings; or, in
  portable mode (``compress``), the plan back to the passages' kept text for any LLM.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Generator, Mapping, Sequence
from typing import Any, Literal, TypedDict, Unpack

import torch

from . import compress as compress_lib
from . import prompt as prompt_lib
from . import selection as selection_lib
from . import toolcalls
from .backends import Backend, create_backend, loads_torch_model
from .backends.base import SelfDrafting
from .caches import PromptMemo
from .compress import Compression
from .config import DraftConfig, GenerationConfig, SelectionConfig, SpecPrefillConfig, check_choice
from .decoding import prefill_and_decode
from .draft import DraftModel, DraftReading, DraftScorer
from .errors import ConfigError, InputError
from .payoff import PrefillCosts, unpruned
from .prompt import Passages
from .streams import AsyncTextStream, TextStream
from .types import (
    AssembledPrompt,
    GenerationResult,
    Passage,
    PassagesRead,
    PathChoice,
    PlannedPrompt,
    PrefillPlan,
    Segment,
    TokenScores,
)

__all__ = ["LazyEngine", "Mode", "RequestOptions", "SpecPrefillEngine", "read_ahead", "request_selection"]

logger = logging.getLogger(__name__)

Mode = Literal["specprefill", "full"]
READ_AHEAD_QUESTION = "?"  # the question of the prompts ``read_passages`` lays passages out in (never scored)
READ_AHEAD_BATCH = 16  # passages per such prompt


class RequestOptions(TypedDict, total=False):
    """The per-call keywords of ``generate``, ``agenerate`` and ``astream``: exactly those of
    ``SpecPrefillEngine.stream``, which documents them and rejects any other."""

    instructions: str | None
    mode: Mode
    keep_rate: float | None
    selection: SelectionConfig | None
    generation: GenerationConfig | None
PromptInput = str | Sequence[Segment]


def request_selection(config: SpecPrefillConfig, mode: str, keep_rate: float | None,
                      selection: SelectionConfig | None) -> SelectionConfig:
    """The selection settings of one request (``selection``, else ``config``'s, with ``keep_rate``
    applied), once ``mode`` is known to be one of ``Mode``."""
    check_choice("mode", mode, Mode)
    sel = selection or config.selection
    if not isinstance(sel, SelectionConfig):
        raise ConfigError(f"selection must be a SelectionConfig, got {type(sel).__name__}")
    if keep_rate is not None:
        sel = dataclasses.replace(sel, keep_rate=keep_rate, token_budget=None)  # validates
    return sel


def _torch_options(backend: str, dtype: str | torch.dtype, device: str | torch.device) -> dict[str, Any]:
    """``dtype`` and ``device`` for a backend that loads a torch model in this process, else none."""
    return {"dtype": dtype, "device": device} if loads_torch_model(backend) else {}


def load_draft(main_backend: Backend, main: str, draft: str | None, config: DraftConfig,
               dtype: str | torch.dtype, device: str | torch.device) -> DraftModel | None:
    """The draft ``from_pretrained`` names: the main model's own weights when ``draft`` is ``main``
    on a ``SelfDrafting`` backend (the capture is inert outside scoring), else loaded; None without one."""
    if draft and draft == main and isinstance(main_backend, SelfDrafting):
        return main_backend.as_draft(config)
    return DraftModel.from_pretrained(draft, config, dtype=dtype, device=device) if draft else None


# -- the planning pipeline's stages, each a function of the engine's scorer ----------------------


def _required(scorer: DraftScorer | None) -> DraftScorer:
    """``scorer``; a ``ConfigError`` for an engine without a draft (SpecPrefill asked of it)."""
    if scorer is None:
        raise ConfigError("this engine has no draft model: pass draft=... or use mode='full'")
    return scorer


def _choose(scorer: DraftScorer | None, prompt: AssembledPrompt, mode: str, sel: SelectionConfig, salt: str | None,
            weigh_cost: bool = True) -> tuple[DraftReading | None, PathChoice | None]:
    """What ``scorer``'s draft reads of ``prompt``, or None and why it is prefilled whole (``payoff``;
    ``weigh_cost``: ``DraftScorer.choose``'s); no draft for SpecPrefill is a ``ConfigError``."""
    if (whole := unpruned(prompt, mode, sel)) is not None:
        return None, whole
    n_context = prompt.n_context
    return _required(scorer).choose(prompt, n_context - sel.budget(n_context), salt, weigh_cost=weigh_cost)


def _plan(scorer: DraftScorer | None, prompt: AssembledPrompt, sel: SelectionConfig, reading: DraftReading | None,
          whole: PathChoice | None) -> PlannedPrompt:
    """The plan of a prompt the draft reads as ``reading``, scored by ``scorer`` and selected;
    prefilled whole for the reason ``whole`` gives when there is nothing to read (``reading`` None)."""
    if reading is None:
        assert whole is not None
        return selection_lib.prefilled_whole(prompt, whole)
    return selection_lib.plan_scored(prompt, sel, _required(scorer).score(reading))


class SpecPrefillEngine:
    """Answers RAG questions with a draft-selected prefill on a main-model backend.

    ``draft`` may be None: the engine then serves only ``mode="full"``. What the draft reads and
    how its scores are cached, batched and mapped is ``scorer``'s (``DraftScorer``): a draft with
    another tokenizer scores its own rendering of the prompt; its scores reach the main tokens
    through character offsets (``DraftConfig.tokenizer_mapping``, docs/cross-family.md).
    """

    def __init__(
        self, backend: Backend, draft: DraftModel | None = None, config: SpecPrefillConfig | None = None
    ) -> None:
        self.backend = backend
        self.draft = draft
        self.tokenizer = backend.tokenizer
        config = config or SpecPrefillConfig()
        self.costs = PrefillCosts()  # the draft's and the main model's running costs (payoff)
        self.scorer = None if draft is None else DraftScorer(draft, self.tokenizer, config.draft, self.costs)
        self.config = config
        # Characters one main token covers at most (None: no bound): refuses a prompt by its length.
        self._chars_per_token = prompt_lib.max_chars_per_token(self.tokenizer)
        # The last prompts' assembly, so a retry skips the template and the tokenizer (DraftConfig.memo_entries).
        self.prompts = PromptMemo(self.config.draft.memo_entries, self.config.draft.memo_bytes)

    @property
    def config(self) -> SpecPrefillConfig:
        """The engine's settings; a new one (``dataclasses.replace``) takes effect at the next
        request, the draft's scoring rule included (the caches keep their sizes)."""
        return self._config

    @config.setter
    def config(self, config: SpecPrefillConfig) -> None:
        self._config = config
        if self.scorer is not None:
            self.scorer.config = config.draft

    @property
    def maps_tokens(self) -> bool:
        """Whether the draft has its own tokenizer (its scores are mapped onto the main tokens)."""
        return self.scorer is not None and self.scorer.maps_tokens

    @classmethod
    def from_pretrained(
        cls,
        main: str,
        draft: str | None = None,
        *,
        backend: str = "transformers",
        config: SpecPrefillConfig | None = None,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "auto",
        **backend_kwargs: Any,
    ) -> SpecPrefillEngine:
        """Build an engine from model names (packaged short names, HF directories, GGUF files).

        ``dtype`` and ``device`` are the draft's, and the main model's on a backend that loads a
        torch model in this process (``register_backend(..., torch_model=True)``: transformers);
        ``"auto"`` (the default) is one precision for both, the fastest the device offers
        (``loading.resolve_dtype``): CUDA + bfloat16 when torch sees a GPU, else the CPU in
        bfloat16 where it multiplies bf16 natively and float32 otherwise. A vLLM main model
        places itself and takes its dtype from the server's ``--dtype`` (``--gpu-memory-utilization``
        leaves the draft its share of a GPU).
        A ``draft`` equal to ``main`` on a ``SelfDrafting`` backend shares the main model's weights.
        """
        config = config or SpecPrefillConfig()
        main_backend = create_backend(backend, main, **_torch_options(backend, dtype, device), **backend_kwargs)
        return cls(main_backend, load_draft(main_backend, main, draft, config.draft, dtype, device), config)

    def warm_up(self) -> None:
        """One tiny answer through the draft and the main model, so that the first real request
        (and any timing) does not pay one-off costs: lazy initialisation, kernel selection, caches.
        A CUDA draft also captures its look-ahead's graphs here (``DraftModel.capture_graphs``,
        ``DraftConfig.cuda_graphs``): for single requests and, with micro-batching, full batches."""
        probe = SelectionConfig(keep_rate=0.5, min_prompt_tokens=16)
        self.generate("Warm-up?", ["Warm-up context. " * 40], mode="specprefill" if self.draft else "full",
                      selection=probe, generation=GenerationConfig(max_new_tokens=2))
        if self.draft is not None:
            draft = self.config.draft
            captured = self.draft.capture_graphs(draft, batches=(1, draft.max_batch))
            if captured:
                logger.info("captured the draft's look-ahead as CUDA graphs for %d loop shapes", captured)

    # -- building blocks -------------------------------------------------------------------

    def assemble(
        self,
        question: PromptInput,
        passages: Passages = (),
        *,
        instructions: str | None = None,
        selection: SelectionConfig | None = None,
        cache_salt: str | None = None,
    ) -> AssembledPrompt:
        """Render and tokenize a prompt; a list of ``Segment`` is taken as is.

        ``selection`` (default: the engine's) decides what is protected (instructions, tail).
        ``cache_salt``: the request's cache namespace; a prompt assembled before is reused only
        under the same salt.
        """
        segments = prompt_lib.request_segments(question, passages, instructions,
                                               default_instructions=self.config.instructions)
        sel = selection or self.config.selection
        window = self.backend.max_context
        prompt_lib.check_length(segments, window, self._chars_per_token)
        prompt = prompt_lib.assemble_cached(
            self.prompts, self.tokenizer, segments, protect_instructions=sel.protect_instructions,
            protect_tail_tokens=sel.protect_tail_tokens, protect_history=sel.protect_history, salt=cache_salt,
        )
        if prompt.n_tokens >= window:
            raise InputError(
                f"the prompt has {prompt.n_tokens} tokens but the main model's window is {window}: "
                "retrieve fewer or shorter passages"
            )
        return prompt

    def score(self, prompt: AssembledPrompt, *, draft: DraftConfig | None = None) -> TokenScores:
        """Draft importance of every token of ``prompt`` (``draft`` overrides the engine's
        ``config.draft`` for this call)."""
        return self.score_many([prompt], draft=draft)[0]

    def score_many(self, prompts: Sequence[AssembledPrompt], *, draft: DraftConfig | None = None
                   ) -> list[TokenScores]:
        """``score`` for several prompts in one batched draft run (each result equals the
        prompt's own within floating-point tolerance); what concurrent requests share."""
        return _required(self.scorer).score_many(prompts, draft)

    def draft_fits(self, prompt: AssembledPrompt, *, draft: DraftConfig | None = None) -> bool:
        """Whether the draft can read ``prompt`` (its own rendering, look-ahead included)."""
        return self.scorer is not None and self.scorer.fits(prompt, draft)

    def draft_reads(self, prompt: AssembledPrompt) -> bool:
        """Whether the draft scores ``prompt``, so that SpecPrefill plans it: it fits in one pass,
        or ``DraftConfig.on_overflow="windows"`` reads it in windows. False when it would be
        prefilled whole (``"full"``, or windows that cannot hold its context); under ``"raise"`` a
        prompt that does not fit raises ``InputError``."""
        return self.scorer is not None and self.scorer.reading(prompt) is not None

    def plan(
        self,
        prompt: AssembledPrompt,
        *,
        mode: Mode = "specprefill",
        selection: SelectionConfig | None = None,
        scores: TokenScores | None = None,
        cache_salt: str | None = None,
    ) -> PlannedPrompt:
        """The prefill plan for ``prompt``, with the scores it was made from (``scores``, when
        given, are reused: e.g. one draft run across keep rates) and the selection's time.
        ``cache_salt``: the request's cache namespace (``GenerationConfig.cache_salt``)."""
        sel = request_selection(self.config, mode, None, selection)
        if scores is None:
            return _plan(self.scorer, prompt, sel, *_choose(self.scorer, prompt, mode, sel, cache_salt))
        whole = unpruned(prompt, mode, sel)
        if whole is not None:
            return selection_lib.prefilled_whole(prompt, whole, scores)
        return selection_lib.plan_scored(prompt, sel, scores)

    def compress(self, question: str, passages: Passages, *, keep_rate: float | None = None,
                 selection: SelectionConfig | None = None, instructions: str | None = None,
                 marker: str = compress_lib.DEFAULT_MARKER, cache_salt: str | None = None) -> Compression:
        """Portable mode (``compress.Compression``): what SpecPrefill would prefill of each passage, as text for
        any LLM, planned as ``plan`` plans but never kept whole for this engine's own cost; errors as ``stream``."""
        started = time.perf_counter()
        items = compress_lib.check_request(question, passages, marker)
        sel = request_selection(self.config, "specprefill", keep_rate, selection)
        prompt = self.assemble(question, items, instructions=instructions, selection=sel, cache_salt=cache_salt)
        reading, whole = _choose(self.scorer, prompt, "specprefill", sel, cache_salt, weigh_cost=False)
        planned = _plan(self.scorer, prompt, sel, reading, whole)
        return compress_lib.compression(planned, items, marker, time.perf_counter() - started)

    def read_passages(self, passages: Passages, *, instructions: str | None = None, cache_salt: str | None = None
                      ) -> PassagesRead:
        """Read ``passages`` into the draft's passage store now, at indexing time, so that a question
        that retrieves them later costs the draft only its own tokens (``DraftConfig.passages``; a
        passage never read before is read on first sight anyway). ``instructions`` (default the
        engine's) and ``cache_salt`` must be those of the later requests: a passage's reading
        belongs to the system part it was read after and to its namespace (``read_ahead``)."""
        return read_ahead(self, _required(self.scorer), prompt_lib.as_passages(passages), instructions, cache_salt)

    # -- generation ------------------------------------------------------------------------

    def execute(
        self,
        prompt: AssembledPrompt,
        plan: PrefillPlan,
        *,
        scores: TokenScores | None = None,
        generation: GenerationConfig | None = None,
    ) -> TextStream:
        """Prefill and decode a plan you built (``plan(prompt, ...)``, or your own); the result's
        timings count from this call, its ``draft_s`` is ``scores.seconds`` when given."""
        planned = PlannedPrompt(prompt, plan, scores, 0.0, None)
        stop = threading.Event()
        run = prefill_and_decode(self.backend, planned, generation or self.config.generation, stop=stop)
        return TextStream(run, stop)

    def stream(
        self,
        question: PromptInput,
        passages: Passages = (),
        *,
        instructions: str | None = None,
        mode: Mode = "specprefill",
        keep_rate: float | None = None,
        selection: SelectionConfig | None = None,
        generation: GenerationConfig | None = None,
    ) -> TextStream:
        """Stream the answer as text deltas; ``.result`` is set once the stream ends.

        Bad input (empty question or context, prompt over the window, keep rate out of
        range, SpecPrefill asked of an engine without a draft, a prompt the draft cannot read
        under ``on_overflow="raise"``) raises here, before any model runs: ``InputError`` /
        ``ConfigError`` (both ``ValueError``), or ``InputTypeError`` / ``ConfigTypeError``
        (``TypeError``) for values of the wrong type. The draft scores and the selection run at
        the first ``next``. ``generation.cache_salt`` names the request's cache namespace: the
        engine's caches and a vLLM upstream's prefix cache serve it only what was computed under
        the same salt.
        """
        started = time.perf_counter()
        sel = request_selection(self.config, mode, keep_rate, selection)
        gen = generation or self.config.generation
        prompt = self.assemble(question, passages, instructions=instructions, selection=sel, cache_salt=gen.cache_salt)
        gen, read_calls = toolcalls.answer_setup(prompt.segments, self.tokenizer, gen, self.backend)
        reading, whole = _choose(self.scorer, prompt, mode, sel, gen.cache_salt)

        def run() -> Generator[str, None, GenerationResult]:
            assembled = time.perf_counter()
            plan = _plan(self.scorer, prompt, sel, reading, whole)
            planned = dataclasses.replace(plan, assemble_s=assembled - started)
            result = yield from prefill_and_decode(self.backend, planned, gen, started=started, stop=stop)
            self.costs.observe_prefill(result.prefilled_tokens, result.timings.prefill_s)
            return result if read_calls is None else read_calls(result)

        stop = threading.Event()
        return TextStream(run(), stop)

    def chat(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = (),
             passages: Passages = (), **options: Unpack[RequestOptions]) -> GenerationResult:
        """``generate`` for OpenAI-style ``messages`` offering ``tools`` (docs/tools.md)."""
        return self.generate(list(prompt_lib.message_segments(messages, tools, passages)), **options)

    def generate(
        self, question: PromptInput, passages: Passages = (), **options: Unpack[RequestOptions]
    ) -> GenerationResult:
        """Answer ``question`` from ``passages`` (or answer a list of ``Segment``).

        The keywords are ``stream``'s: ``mode="full"`` prefills the whole prompt (the baseline),
        ``keep_rate`` overrides the configured keep rate for this call, and so on.
        """
        return self.stream(question, passages, **options).wait()

    async def agenerate(
        self, question: PromptInput, passages: Passages = (), **options: Unpack[RequestOptions]
    ) -> GenerationResult:
        """``generate`` with each step in a worker thread, so the event loop stays free.

        Cancelling the awaiting task stops the generation at the next token and closes the
        backend's stream.
        """
        stream = await self.astream(question, passages, **options)
        async with stream:
            async for _ in stream:
                pass
        assert stream.result is not None
        return stream.result

    async def astream(
        self, question: PromptInput, passages: Passages = (), **options: Unpack[RequestOptions]
    ) -> AsyncTextStream:
        """``stream`` as an async iterator of text deltas (``.result`` once exhausted)."""
        stream = await asyncio.to_thread(self.stream, question, passages, **options)
        return AsyncTextStream(stream)


def read_ahead(engine: SpecPrefillEngine, scorer: DraftScorer, items: Sequence[Passage], instructions: str | None,
               salt: str | None) -> PassagesRead:
    """``SpecPrefillEngine.read_passages``: the passages laid out as ``engine``'s prompts lay them
    out, up to ``READ_AHEAD_BATCH`` per prompt (fewer where they would not fit the window), each
    prompt's passages read into the store by ``scorer``."""
    found = read = 0
    start, size = 0, READ_AHEAD_BATCH
    while start < len(items):
        try:
            prompt = engine.assemble(READ_AHEAD_QUESTION, items[start: start + size], instructions=instructions,
                                     cache_salt=salt)
        except InputError:
            if size == 1:
                raise
            size = max(1, size // 2)  # over the window: fewer passages per prompt
            continue
        got = scorer.read_passages(prompt, salt)
        found, read, start = found + got[0], read + got[1], start + size
    return PassagesRead(found, read)


class LazyEngine:
    """One engine, built from model names on the first ``get`` and only then, once even when many
    threads ask at the same time: what the LangChain and LlamaIndex integrations hold when they are
    given model names instead of an engine."""

    def __init__(self) -> None:
        self._engine: SpecPrefillEngine | None = None
        self._lock = threading.Lock()

    def get(self, main: str, draft: str | None, *, backend: str, max_retries: int) -> SpecPrefillEngine:
        """The engine (``from_pretrained(main, draft, backend=backend)``; ``max_retries`` goes to the
        ``vllm_server`` backend, the one that retries); later calls return the same one."""
        if self._engine is None:
            with self._lock:
                if self._engine is None:
                    logger.info("loading SpecPrefill engine: main=%s draft=%s", main, draft)
                    options: dict[str, Any] = {"max_retries": max_retries} if backend == "vllm_server" else {}
                    self._engine = SpecPrefillEngine.from_pretrained(main, draft, backend=backend, **options)
        return self._engine
