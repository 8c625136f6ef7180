"""Main model behind a vLLM OpenAI-compatible server with the SpecPrefill plugin loaded.

Each plan becomes one streamed ``/v1/completions`` request: the kept token ids as the prompt,
their original positions in ``vllm_xargs`` and a ``cache_salt`` derived from them (so the
prefix cache never mixes blocks computed at different positions). A full plan is sent as a
plain request, exactly what stock vLLM serves. The tokenizer is loaded locally from the same
HF directory the server serves. Standard library HTTP only (``http.client``), no extra
dependency. Start the server with ``specprefill-rag serve MODEL`` (docs/vllm.md).
"""

from __future__ import annotations

import http.client
import json
import logging
import time
import urllib.parse
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any

from ..config import GenerationConfig
from ..types import PrefillPlan
from ..vllm_plugin.protocol import PlanError, is_contiguous, parse_plan, plan_salt, plan_to_xargs
from .base import BackendCapabilities, BackendError

__all__ = ["ServerError", "TokenStep", "VLLMServerBackend", "request_body"]

logger = logging.getLogger(__name__)


class ServerError(BackendError):
    """The server answered with an error; ``status`` is the HTTP status (None: error event in a stream)."""

    def __init__(self, message: str, status: int | None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class TokenStep:
    """One generated token and, when asked for, its log-probability under the main model."""

    token_id: int
    logprob: float | None


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
    when their salts are equal); a plan's position salt is appended to it, as the plugin does.
    """
    positions = plan.position_ids.tolist()
    body: dict[str, Any] = {
        "model": model,
        "prompt": plan.token_ids.tolist(),
        "max_tokens": max_tokens,
        "temperature": generation.temperature,
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
    if not is_contiguous(positions, plan.next_position):
        body["vllm_xargs"] = plan_to_xargs(positions, plan.next_position)
        salt = plan_salt(positions, plan.next_position)
        body["cache_salt"] = salt if cache_salt is None else f"{cache_salt}-{salt}"
    return body


class VLLMServerBackend:
    """HTTP client for ``vllm serve`` with the plugin; TTFT is the first streamed token here."""

    name = "vllm_server"
    capabilities = BackendCapabilities(exact_positions=True, streaming=True, native_async=False)

    def __init__(
        self,
        base_url: str,
        tokenizer: Any,
        *,
        model: str | None = None,
        max_context: int | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
        connect_timeout: float = 5.0,  # seconds per connection attempt
        read_timeout: float = 300.0,  # seconds without any byte from the server
        connect_retries: int = 3,  # extra attempts when the connection is refused or times out
        retry_backoff: float = 0.5,  # seconds before the first retry, doubled each time
        cache_salt: str | None = None,  # vLLM prefix-cache salt sent with every request (None: shared cache)
    ) -> None:
        parsed = urllib.parse.urlsplit(base_url if "://" in base_url else f"http://{base_url}")
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"base_url must look like http://HOST:PORT, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self._scheme, self._host = parsed.scheme, parsed.hostname
        self._port = parsed.port or (443 if parsed.scheme == "https" else 80)
        self._prefix = parsed.path.rstrip("/")
        self._tokenizer = tokenizer
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self.connect_retries, self.retry_backoff = connect_retries, retry_backoff
        # Public: requests share prefix-cache blocks only with requests of the same salt (tenants,
        # or a benchmark that must measure cold prefills); may be changed between requests.
        self.cache_salt = cache_salt
        self.eos_token_ids = eos_token_ids or frozenset(
            [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        )
        if model is None or max_context is None:
            card = self._model_card(model)
            model = model or str(card["id"])
            if max_context is None:
                max_context = int(card.get("max_model_len") or 0) or None
        self._model = model
        self._max_context = max_context or (1 << 30)

    @classmethod
    def from_pretrained(cls, name_or_path: str, *, base_url: str = "http://127.0.0.1:8000", **kwargs: Any
                        ) -> VLLMServerBackend:
        """Client for the server at ``base_url`` serving ``name_or_path`` (tokenizer loaded locally)."""
        from ..models import load_tokenizer, resolve_model_dir

        model_dir = resolve_model_dir(name_or_path)
        tokenizer = load_tokenizer(model_dir)
        eos = set(_generation_eos(model_dir))
        if tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        backend = cls(base_url, tokenizer, eos_token_ids=frozenset(eos), **kwargs)
        embeddings = _max_position_embeddings(model_dir)
        if embeddings:
            backend._max_context = min(backend._max_context, embeddings)
        return backend

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def model_name(self) -> str:
        return self._model

    # -- HTTP ------------------------------------------------------------------------------

    def _connect(self) -> http.client.HTTPConnection:
        """An open connection, retrying refused/timed-out connects with exponential backoff."""
        cls = http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
        delay, error = self.retry_backoff, None
        began = time.perf_counter()
        for attempt in range(self.connect_retries + 1):
            conn = cls(self._host, self._port, timeout=self.connect_timeout)
            try:
                conn.connect()
                assert conn.sock is not None
                conn.sock.settimeout(self.read_timeout)
                return conn
            except OSError as exc:  # refused, unreachable, connect timeout
                conn.close()
                error = exc
                if attempt < self.connect_retries:
                    time.sleep(delay)
                    delay *= 2
        raise BackendError(
            f"cannot reach the vLLM server at {self.base_url} ({type(error).__name__}: {error}; "
            f"{self.connect_retries + 1} attempts over {time.perf_counter() - began:.1f} s). "
            "Is it running? Start it with: specprefill-rag serve MODEL"
        )

    def _send(self, method: str, path: str, body: dict[str, Any] | None = None
              ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn = self._connect()
        try:
            payload = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"} if payload else {}
            conn.request(method, self._prefix + path, body=payload, headers=headers)
            response = conn.getresponse()
        except TimeoutError as exc:
            conn.close()
            raise BackendError(
                f"the vLLM server at {self.base_url} sent nothing for {self.read_timeout:g} s ({path})"
            ) from exc
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise BackendError(f"request to the vLLM server at {self.base_url}{path} failed: {exc}") from exc
        if response.status >= 400:
            text = response.read().decode(errors="replace")
            conn.close()
            raise ServerError(
                f"the vLLM server at {self.base_url} answered {path} with HTTP {response.status}: "
                f"{_error_message(text)}",
                response.status,
            )
        return conn, response

    def _model_card(self, model: str | None) -> dict[str, Any]:
        conn, response = self._send("GET", "/v1/models")
        try:
            cards = json.loads(response.read()).get("data") or []
        finally:
            conn.close()
        for card in cards:
            if model is None or card.get("id") == model:
                return dict(card)
        raise BackendError(
            f"the vLLM server at {self.base_url} does not serve {model!r}; it serves "
            f"{', '.join(str(c.get('id')) for c in cards) or 'nothing'}"
        )

    def _events(self, response: http.client.HTTPResponse) -> Iterator[dict[str, Any]]:
        """Parsed ``data:`` events of a server-sent-event stream, until ``[DONE]``."""
        while True:
            try:
                line = response.readline()
            except TimeoutError as exc:
                raise BackendError(
                    f"the vLLM server at {self.base_url} sent nothing for {self.read_timeout:g} s mid-stream"
                ) from exc
            if not line:
                raise BackendError(f"the vLLM server at {self.base_url} closed the stream early")
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            event = json.loads(data)
            if "error" in event:
                raise ServerError(f"the vLLM server at {self.base_url} failed mid-stream: "
                                  f"{_error_message(json.dumps(event))}", None)
            yield event

    # -- generation ------------------------------------------------------------------------

    def check_plan(self, plan: PrefillPlan, max_tokens: int) -> None:
        """Client-side validation, the same rules the server applies (``ValueError``)."""
        positions = plan.position_ids.tolist()
        if plan.n_kept == 0:
            raise ValueError("the plan keeps no tokens")
        try:
            parse_plan(plan_to_xargs(positions, plan.next_position), prompt_len=plan.n_kept,
                       max_tokens=max_tokens, max_len=self.max_context)
        except PlanError as error:
            raise ValueError(f"invalid prefill plan for {self.model_name}: {error}") from None

    def stream_steps(
        self, plan: PrefillPlan, generation: GenerationConfig, *, logprobs: bool = False
    ) -> Generator[TokenStep, None, None]:
        """Generated tokens (EOS excluded) as they stream in, with log-probabilities if asked."""
        max_tokens = _max_tokens(plan, generation, self.max_context)
        if max_tokens == 0:
            return
        self.check_plan(plan, max_tokens)
        body = request_body(plan, generation, model=self.model_name, max_tokens=max_tokens,
                            logprobs=logprobs, stream=True, cache_salt=self.cache_salt)
        conn, response = self._send("POST", "/v1/completions", body)
        try:
            for event in self._events(response):
                for choice in event.get("choices") or ():
                    ids = choice.get("token_ids") or []
                    lps = ((choice.get("logprobs") or {}).get("token_logprobs") or []) if logprobs else []
                    for j, token in enumerate(ids):
                        if token in self.eos_token_ids:
                            return
                        yield TokenStep(int(token), float(lps[j]) if j < len(lps) else None)
        finally:
            conn.close()  # also cancels the request on the server when the caller stops early

    def stream_tokens(self, plan: PrefillPlan, generation: GenerationConfig) -> Generator[int, None, None]:
        for step in self.stream_steps(plan, generation):
            yield step.token_id


def _max_tokens(plan: PrefillPlan, generation: GenerationConfig, window: int) -> int:
    """Tokens to generate: the configured limit, cut at the end of the window (as transformers)."""
    if plan.next_position > window:
        raise ValueError(
            f"plan reaches position {plan.next_position}, beyond the main model's window of {window} tokens"
        )
    return min(generation.max_new_tokens, window - plan.next_position)


def _error_message(text: str) -> str:
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()[:500] or "(empty body)"
    error = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(error, dict):
        return str(error.get("message") or error.get("detail") or error)
    return str(error)


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
