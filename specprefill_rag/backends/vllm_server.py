"""Main model behind a vLLM OpenAI-compatible server with the SpecPrefill plugin loaded.

Each plan becomes one streamed ``/v1/completions`` request: the kept token ids as the prompt,
their original positions in ``vllm_xargs``; the plugin makes vLLM's prefix-cache block hashes
position-aware, so planned and full requests share the blocks before a plan's first gap and
never a block computed at other positions. A full plan is sent as a plain request, exactly what
stock vLLM serves. The tokenizer is loaded locally from the same
HF directory the server serves. Standard library HTTP only (``http.client``, through the
backend's own ``vllm_http.VLLMHTTPClient``: deadlines, retries, server-sent events), no extra
dependency.
Start the server with ``specprefill-rag serve MODEL`` (docs/vllm.md).
``chat_upstream`` offers the same server as a plain chat endpoint: the gateway's text mode.

Failures: every failure of the server path is a ``BackendError`` (``ServerError`` for an HTTP
error or an error event, ``BackendTimeoutError`` past the deadline) naming the server, with the
underlying exception chained. ``GenerationConfig.timeout`` is a deadline over the whole request:
connecting, retries and the entire stream (keep-alive comments do not extend it); ``None`` leaves
only ``read_timeout``, the longest silence allowed. A request is re-sent, unchanged, only when the
connection could not be made or the server answered 502/503/504, so always before the first
token; with exponential backoff, at most ``max_retries`` times and never past the deadline.

Plugin check: stock vLLM accepts any ``vllm_xargs`` and would answer a plan at contiguous
positions. Two checks keep that from ever reaching a caller:

- the proof, per request: the plugin puts ``wire.plan_proof`` of the prompt and plan it applied
  into every chunk of a planned answer (``wire.PROOF_FIELD``), and the backend requires the proof
  it expects before it yields a token. Behind a router each request may reach another replica;
  one without the plugin (a rolling upgrade, a pod from another image) sends no proof, and the
  request fails with a ``PluginMissingError`` (a ``BackendError``) instead of a silently wrong answer;
- the handshake, once per backend: before its first planned request a backend sends one tiny,
  deliberately invalid plan and requires the plugin's own HTTP 400, so a server without the
  plugin is named with the fix before any plan is sent. A refusal stands for
  ``ConnectionOptions.plugin_retry_s`` seconds (plans fail at once, with no probe: the gateway's
  ``--fallback-text-mode`` answers them in text mode), then the server is checked again.

Full plans are plain requests and need neither. ``ConnectionOptions(verify_plugin=False)`` skips
both (fake servers in tests).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

from ..config import GenerationConfig
from ..errors import BackendError, ConfigError, PluginMissingError, ServerError
from ..grammar import declared
from ..loading import eos_ids
from ..types import PrefillPlan, is_int, is_number
from ..wire import INVALID_PLAN, NEXT_POSITION_KEY, POSITIONS_KEY, PROOF_FIELD, is_contiguous, plan_proof, plan_to_xargs
from .base import BackendCapabilities, ModelIdentity, TokenStep, checked_xargs, max_new_tokens
from .openai_chat import ChatUpstream
from .vllm_http import VLLMHTTPClient, describe

__all__ = ["DEFAULT_MAX_RETRIES", "ConnectionOptions", "VLLMServerBackend", "request_body"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_RETRIES = 2  # re-sends of a request whose connection failed or that got HTTP 502/503/504

# One prompt token at position 0 whose next position is not above it: every plugin rejects it.
_PROBE_XARGS = plan_to_xargs([0], 0)
_PLUGIN_FIX = (
    "Plans need the specprefill-rag vLLM plugin in every vLLM process: install specprefill-rag in "
    "vLLM's own environment; if VLLM_PLUGINS is set, include 'specprefill' in it; simplest, start the "
    "server with `specprefill-rag serve MODEL`. Full plans (no pruning) still work without the plugin."
)


def request_body(
    plan: PrefillPlan,
    generation: GenerationConfig,
    *,
    model: str,
    max_tokens: int,
    logprobs: bool,
    stream: bool,
    cache_salt: str | None = None,
) -> dict[str, Any]:
    """The ``/v1/completions`` JSON for a plan (stop strings are applied client side).

    ``cache_salt`` is vLLM's own per-request prefix-cache salt (requests share cached blocks only
    when their salts are equal), sent as given: positions are the plugin's part of the block hash.
    """
    positions = plan.position_ids.tolist()
    body: dict[str, Any] = {
        "model": model,
        "prompt": plan.token_ids.tolist(),
        "max_tokens": max_tokens,
        "temperature": 0.0 if generation.greedy else generation.temperature,
        "top_p": generation.top_p,
        "stream": stream,
        "return_token_ids": True,
        "skip_special_tokens": False,
    }
    if generation.top_k:
        body["top_k"] = generation.top_k
    if generation.seed is not None:
        body["seed"] = generation.seed
    if logprobs:
        body["logprobs"] = 0  # the sampled token's own log-probability only
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    if generation.grammar is not None:  # vLLM's structured outputs, on llguidance (grammar.declared)
        body["structured_outputs"] = {"grammar": declared(generation.grammar)}
    if not is_contiguous(positions, plan.next_position):
        body["vllm_xargs"] = plan_to_xargs(positions, plan.next_position)
    return body


_UNKNOWN_CONTEXT = 1 << 30  # the server states no max_model_len


@dataclass(frozen=True)
class ConnectionOptions:
    """How a ``VLLMServerBackend`` talks to its server: timeouts, retries, the plugin check.

    Given to the constructor as ``connection=``; ``from_pretrained`` (and so ``create_backend``
    and ``SpecPrefillEngine.from_pretrained``) also takes each field as a keyword.
    """

    connect_timeout: float = 5.0  # seconds per connection attempt
    read_timeout: float = 300.0  # seconds without any byte from the server
    max_retries: int = DEFAULT_MAX_RETRIES  # extra attempts after a failed connect or HTTP 502/503/504
    retry_backoff: float = 0.5  # seconds before the first retry, doubled each time
    verify_plugin: bool = True  # the handshake and the per-request proof (module docstring)
    plugin_retry_s: float = 5.0  # seconds a failed handshake stands before the next (0: check every plan)
    api_key: str | None = field(default=None, repr=False)  # sent as "Authorization: Bearer KEY"; None: none

    def __post_init__(self) -> None:
        for name in ("connect_timeout", "read_timeout"):
            value = getattr(self, name)
            if not is_number(value) or not value > 0:
                raise ConfigError(f"{name} must be a number of seconds > 0, got {value!r}")
        for name in ("retry_backoff", "plugin_retry_s"):
            value = getattr(self, name)
            if not is_number(value) or not value >= 0:
                raise ConfigError(f"{name} must be a number of seconds >= 0, got {value!r}")
        if not is_int(self.max_retries) or self.max_retries < 0:
            raise ConfigError(f"max_retries must be an int >= 0, got {self.max_retries!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()):
            raise ConfigError("api_key must be a non-empty string or None")

    @classmethod
    def take(cls, keywords: dict[str, Any], base: ConnectionOptions | None = None) -> ConnectionOptions:
        """``base`` (None: the defaults) with the fields ``keywords`` names, which are removed from it."""
        fields = {f.name: keywords.pop(f.name) for f in dataclasses.fields(cls) if f.name in keywords}
        return dataclasses.replace(base or cls(), **fields)


DEFAULT_CONNECTION = ConnectionOptions()


class VLLMServerBackend(ModelIdentity):
    """HTTP client for ``vllm serve`` with the plugin; TTFT is the first streamed token here.

    ``generation.timeout`` bounds a whole request (connect, retries, stream); ``read_timeout``
    bounds each silence. Refused or timed-out connections and HTTP 502/503/504 answers are
    retried up to ``max_retries`` times, ``retry_backoff`` seconds apart, doubled each time, while
    the deadline allows the wait; other HTTP errors (4xx, 500) and failures mid-stream are not.
    """

    name = "vllm_server"
    capabilities = BackendCapabilities(exact_positions=True, grammar=True)

    def __init__(
        self,
        base_url: str,
        tokenizer: Any,
        *,
        model: str | None = None,
        max_context: int | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
        connection: ConnectionOptions = DEFAULT_CONNECTION,
        cache_salt: str | None = None,  # vLLM prefix-cache salt sent with every request (None: shared cache)
    ) -> None:
        # The transport (``http.base_url``, timeouts, ``http.max_retries``): private to this backend.
        self.http = VLLMHTTPClient(base_url, connect_timeout=connection.connect_timeout,
                                   read_timeout=connection.read_timeout, max_retries=connection.max_retries,
                                   retry_backoff=connection.retry_backoff, api_key=connection.api_key)
        self.connection = connection
        self._tokenizer = tokenizer
        # Public: requests share prefix-cache blocks only with requests of the same salt (tenants,
        # or a benchmark that must measure cold prefills); may be changed between requests.
        self.cache_salt = cache_salt
        self.verify_plugin = connection.verify_plugin
        self._plugin_verified = False  # set once the plugin answered the check; never unset
        self._plugin_refusal: tuple[float, str] | None = None  # (monotonic time, message) of the last refusal
        self._plugin_lock = threading.Lock()
        self.eos_token_ids = eos_token_ids or eos_ids(None, tokenizer)
        if model is None or max_context is None:
            card = self._model_card(model)
            model = model or str(card["id"])
            if max_context is None:
                max_context = card.get("max_model_len") or None
        self._name = model
        self._max_context = max_context or _UNKNOWN_CONTEXT

    @classmethod
    def from_pretrained(cls, name_or_path: str, *, base_url: str = "http://127.0.0.1:8000", **kwargs: Any
                        ) -> VLLMServerBackend:
        """Client for the server at ``base_url`` serving ``name_or_path`` (tokenizer loaded locally).

        ``kwargs``: the constructor's keywords (``model``, ``max_context``, ``cache_salt``,
        ``connection``) and any ``ConnectionOptions`` field by name (``read_timeout=60``,
        ``max_retries=0``, ...), which overrides that field of ``connection``: what
        ``create_backend("vllm_server", ...)`` and ``SpecPrefillEngine.from_pretrained`` pass on.
        """
        from ..loading import load_tokenizer, resolve_model_dir

        connection = ConnectionOptions.take(kwargs, kwargs.pop("connection", DEFAULT_CONNECTION))
        model_dir = resolve_model_dir(name_or_path)
        tokenizer = load_tokenizer(model_dir)
        backend = cls(base_url, tokenizer, eos_token_ids=eos_ids(_generation_eos(model_dir), tokenizer),
                      connection=connection, **kwargs)
        embeddings = _max_position_embeddings(model_dir)
        if embeddings and backend._max_context == _UNKNOWN_CONTEXT:
            # only when the server states no max_model_len: for rope-scaled models (YaRN) the
            # server's limit is above the config's pre-scaling max_position_embeddings
            backend._max_context = embeddings
        return backend

    def _model_card(self, model: str | None) -> dict[str, Any]:
        raw = self.http.get("/v1/models")
        try:
            cards = _model_cards(raw)
        except (TypeError, ValueError) as exc:
            raise BackendError(f"the vLLM server at {self.http.base_url} answered /v1/models with no valid model "
                               f"list ({describe(exc)}): {raw[:200]!r}") from exc
        for card in cards:
            if model is None or card["id"] == model:
                return card
        raise BackendError(
            f"the vLLM server at {self.http.base_url} does not serve {model!r}; it serves "
            f"{', '.join(str(c['id']) for c in cards) or 'nothing'}"
        )

    def chat_upstream(self) -> ChatUpstream:
        """The same server as a plain chat endpoint (``/v1/chat/completions``, the model's own
        chat template): the gateway's text mode, which needs no plugin. Shares this backend's
        transport: URL, timeouts and retries."""
        return ChatUpstream(self.http, self.model_name)

    def ping(self) -> None:
        """``BackendError`` unless the server answers ``/v1/models`` now (the gateway's ``/ready``)."""
        self._model_card(self.model_name)

    # -- plugin check ----------------------------------------------------------------------

    def ensure_plugin(self) -> None:
        """Verify, once per backend, that the server honours plans (``BackendError`` if not).

        Sends a one-token prompt with an invalid plan (``max_tokens=1``) and requires the plugin's
        HTTP 400. Thread-safe: concurrent first requests wait for one check. Success is
        remembered for good; a refusal (``PluginMissingError``) for ``plugin_retry_s`` seconds, in
        which plans fail at once without a probe, so a server restarted with the plugin is
        accepted on the first plan after that. A server error is not remembered. The check is
        bounded by ``connect_timeout``/``read_timeout`` and retried like any request, outside the
        deadline of the request that triggered it.
        """
        if self._plugin_verified:
            return
        with self._plugin_lock:
            if self._plugin_verified:
                return
            if self._plugin_refusal is not None:
                at, message = self._plugin_refusal
                age = time.monotonic() - at
                if age < self.connection.plugin_retry_s:
                    raise PluginMissingError(f"{message} (the plugin check {age:.1f} s ago; the next in "
                                             f"{self.connection.plugin_retry_s - age:.1f} s)")
            try:
                self._check_plugin()
            except PluginMissingError as error:
                self._plugin_refusal = (time.monotonic(), str(error))
                raise
            self._plugin_verified, self._plugin_refusal = True, None

    def _check_plugin(self) -> None:
        body = {"model": self.model_name, "prompt": [0], "max_tokens": 1, "temperature": 0.0,
                "stream": False, "vllm_xargs": _PROBE_XARGS}
        try:
            status = self.http.post("/v1/completions", body)  # a 2xx answer: nothing in it matters
        except ServerError as exc:
            if exc.status == 400 and INVALID_PLAN in str(exc):
                logger.debug("vLLM server at %s: SpecPrefill plugin active", self.http.base_url)
                return
            if exc.status is not None and exc.status >= 500:
                raise  # the server failed (after retries on 502/503/504): no verdict, checked again next time
            raise PluginMissingError(
                f"refusing to send SpecPrefill plans to the vLLM server at {self.http.base_url}: it did not answer "
                f"the plugin check (an invalid plan) with the plugin's HTTP 400 ({exc}), so its plugin is not "
                f"active. {_PLUGIN_FIX}"
            ) from exc
        raise PluginMissingError(
            f"refusing to send SpecPrefill plans to the vLLM server at {self.http.base_url}: it accepted an invalid "
            f"plan (HTTP {status}), so the specprefill plugin is not active there and a plan "
            f"would be answered at contiguous positions, silently wrong. {_PLUGIN_FIX}"
        )

    def _unproven(self, event: dict[str, Any]) -> PluginMissingError:
        """The error for a chunk of a planned answer without the proof this request expects."""
        got = event.get(PROOF_FIELD)
        what = (f"without the plugin's proof (no {PROOF_FIELD!r} field), so the vLLM process that served it "
                "does not run the specprefill plugin and answered at contiguous positions" if got is None else
                f"with the proof of another plan ({got!r:.60}), so what it served is not this request's plan")
        return PluginMissingError(
            f"discarded the answer of the vLLM server at {self.http.base_url} to a SpecPrefill plan (response "
            f"{str(event.get('id'))!r:.60}): it came {what}. Behind a router or load balancer, every replica "
            f"needs the plugin. {_PLUGIN_FIX}"
        )

    # -- generation ------------------------------------------------------------------------

    def salt_of(self, generation: GenerationConfig) -> str | None:
        """The ``cache_salt`` sent for a request: the request's own (``generation.cache_salt``)
        within this backend's (``cache_salt``), so a request can narrow the backend's namespace but
        never leave it; None when neither is set (vLLM's shared namespace)."""
        own = generation.cache_salt
        if self.cache_salt is None or own is None:
            return own if own is not None else self.cache_salt
        return json.dumps([self.cache_salt, own])  # unambiguous: no two pairs give one salt

    def check_plan(self, plan: PrefillPlan, max_tokens: int) -> None:
        """Client-side validation, the same rules the server applies (``PlanError``)."""
        checked_xargs(plan, max_tokens=max_tokens, window=self.max_context, model=self.model_name)

    def stream_steps(
        self, plan: PrefillPlan, generation: GenerationConfig, *, logprobs: bool = False
    ) -> Generator[TokenStep, None, None]:
        """Generated tokens (EOS excluded) as they stream in, with log-probabilities if asked.

        ``generation.timeout`` (seconds, counted from the first ``next``) bounds the whole request;
        closing the generator closes the connection, which cancels the request on the server.
        """
        max_tokens = max_new_tokens(plan, generation, self.max_context)
        if max_tokens == 0:
            return
        self.check_plan(plan, max_tokens)
        body = request_body(plan, generation, model=self.model_name, max_tokens=max_tokens,
                            logprobs=logprobs, stream=True, cache_salt=self.salt_of(generation))
        proof = None
        if "vllm_xargs" in body and self.verify_plugin:
            self.ensure_plugin()  # before the deadline starts: bounded by its own timeouts
            xargs = body["vllm_xargs"]
            proof = plan_proof([body["prompt"]], xargs[POSITIONS_KEY], xargs[NEXT_POSITION_KEY])
        # Closed when this generator is: that cancels the request on the server when the caller stops early.
        with contextlib.closing(self.http.stream("/v1/completions", body, generation.timeout)) as events:
            for event in events:
                if proof is not None and event.get(PROOF_FIELD) != proof:
                    raise self._unproven(event)
                try:
                    steps = _token_steps(event, logprobs)
                except (TypeError, ValueError) as exc:
                    raise self.http.malformed(exc, json.dumps(event).encode()) from exc
                for step in steps:
                    if step.token_id in self.eos_token_ids:
                        return
                    yield step

    def stream_tokens(self, plan: PrefillPlan, generation: GenerationConfig) -> Generator[int, None, None]:
        for step in self.stream_steps(plan, generation):
            yield step.token_id


def _token_steps(event: dict[str, Any], logprobs: bool) -> list[TokenStep]:
    """The tokens of one completion chunk; ``TypeError`` for a chunk not shaped like vLLM's."""
    choices = event.get("choices")
    if choices is None:
        return []
    if not isinstance(choices, list):
        raise TypeError(f"'choices' must be a list, got {type(choices).__name__}")
    steps = []
    for choice in choices:
        if not isinstance(choice, dict):
            raise TypeError(f"a choice must be a JSON object, got {type(choice).__name__}")
        ids = choice.get("token_ids")
        if ids is None and choice.get("text"):
            raise TypeError("text came without 'token_ids': the server ignores return_token_ids (old vLLM?)")
        ids = [] if ids is None else ids
        if not isinstance(ids, list) or not all(is_int(t) for t in ids):
            raise TypeError(f"'token_ids' must be a list of ints, got {ids!r:.100}")
        block = choice.get("logprobs") if logprobs else None
        if block is not None and not isinstance(block, dict):
            raise TypeError(f"'logprobs' must be a JSON object, got {type(block).__name__}")
        lps = (block or {}).get("token_logprobs")
        lps = [] if lps is None else lps
        if not isinstance(lps, list) or not all(lp is None or is_number(lp) for lp in lps):
            raise TypeError(f"'logprobs.token_logprobs' must be a list of numbers, got {lps!r:.100}")
        steps += [TokenStep(t, float(lps[j]) if j < len(lps) and lps[j] is not None else None)
                  for j, t in enumerate(ids)]
    return steps


def _model_cards(raw: bytes) -> list[dict[str, Any]]:
    """The model cards of a ``/v1/models`` answer; ``TypeError``/``ValueError`` when malformed."""
    data = json.loads(raw)
    cards = data.get("data") if isinstance(data, dict) else None
    if not isinstance(cards, list):
        raise TypeError(f"'data' must be a list, got {type(cards).__name__}")
    for card in cards:
        if not isinstance(card, dict) or not isinstance(card.get("id"), str):
            raise TypeError(f"a model card must be an object with a string 'id', got {card!r:.100}")
        length = card.get("max_model_len")
        if length is not None and not (is_int(length) and length > 0):
            raise TypeError(f"'max_model_len' must be a positive int, got {length!r:.100}")
    return cards


def _generation_eos(model_dir: Any) -> list[int]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    return [eos] if isinstance(eos, int) else [int(e) for e in eos or []]


def _max_position_embeddings(model_dir: Any) -> int | None:
    path = model_dir / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    value = config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")
    return int(value) if value else None
