"""HTTP to a vLLM OpenAI-compatible server: deadlines, retries and server-sent events.

Standard library only (``http.client``). ``VLLMHTTPClient`` is the transport of
``VLLMServerBackend`` (which adds requests, plans and the plugin check) and private to it: the
backend holds one and calls ``get``, ``post`` and ``stream``. A request is re-sent only when no
connection was made or the server answered 502/503/504; a streamed answer is read line by line
under a per-request deadline and a per-read silence limit. Every failure is a ``BackendError``
naming the server (``ServerError`` for HTTP errors and error events, ``BackendTimeoutError`` past
the deadline).
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

from ..errors import BackendError, BackendTimeoutError, ConfigError, ServerError
from ..types import is_int

__all__ = ["RETRY_STATUSES", "VLLMHTTPClient", "describe"]

logger = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({502, 503, 504})  # a proxy or an overloaded server: worth another try
_READ_SIZE = 1 << 16  # bytes asked of the socket per read
_MAX_LINE = 1 << 24  # bytes; a longer server-sent-event line is a broken stream
# I/O errors of a request: socket (incl. timeouts, resets), protocol (IncompleteRead, bad status
# line) and value errors http.client lets through on garbage.
_IO_ERRORS = (OSError, http.client.HTTPException, ValueError)


@dataclass(frozen=True)
class _Deadline:
    """The end of one request's time budget (``timeout`` seconds from its start; None: none)."""

    timeout: float | None  # seconds
    end: float | None  # time.monotonic() value

    @classmethod
    def start(cls, timeout: float | None) -> _Deadline:
        return cls(timeout, None if timeout is None else time.monotonic() + timeout)

    def left(self) -> float | None:
        """Seconds left (negative once passed); None without a deadline."""
        return None if self.end is None else self.end - time.monotonic()

    def passed(self) -> bool:
        left = self.left()
        return left is not None and left <= 0

    def cap(self, seconds: float) -> float:
        """``seconds`` cut to the time left (kept above zero: a zero socket timeout means non-blocking)."""
        left = self.left()
        return seconds if left is None else max(min(seconds, left), 1e-3)


_NO_DEADLINE = _Deadline(None, None)


@dataclass(frozen=True)
class _Exchange:
    """An answered request: its connection, the response (2xx) and the socket under both."""

    conn: http.client.HTTPConnection
    response: http.client.HTTPResponse
    sock: Any  # socket.socket or ssl.SSLSocket; kept because http.client drops conn.sock on "close"

    def close(self) -> None:
        """Close the socket now (the response owns it when the server said ``Connection: close``)."""
        self.response.close()
        self.conn.close()


class _Unreachable(Exception):
    """A connection attempt failed (refused, unreachable, connect timeout); the cause is the OSError."""


class VLLMHTTPClient:
    """Requests to one vLLM server: ``base_url``, timeouts and the retry policy (see the module)."""

    def __init__(self, base_url: str, *, connect_timeout: float, read_timeout: float, max_retries: int,
                 retry_backoff: float, api_key: str | None = None) -> None:
        parsed = urllib.parse.urlsplit(base_url if "://" in base_url else f"http://{base_url}")
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ConfigError(f"base_url must look like http://HOST:PORT, got {base_url!r}")
        if not is_int(max_retries) or max_retries < 0:
            raise ConfigError(f"max_retries must be an int >= 0, got {max_retries!r}")
        self.base_url = base_url.rstrip("/")
        self._scheme, self._host = parsed.scheme, parsed.hostname
        self._port = parsed.port or (443 if parsed.scheme == "https" else 80)
        self._prefix = parsed.path.rstrip("/")
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self.max_retries, self.retry_backoff = int(max_retries), retry_backoff
        # Sent as "Authorization: Bearer KEY" (vLLM's --api-key, a hosted API); never in a message.
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def get(self, path: str) -> bytes:
        """The body of the 2xx answer to ``GET path`` (no deadline: the connect and read timeouts
        bound it; retried as any request)."""
        exchange = self._open("GET", path, None, _NO_DEADLINE)
        try:
            return exchange.response.read()
        except _IO_ERRORS as exc:
            raise self._io_error(exc, self.read_timeout, _NO_DEADLINE, f"while answering {path}") from exc
        finally:
            exchange.close()

    def post(self, path: str, body: dict[str, Any]) -> int:
        """The status of the 2xx answer to ``POST path`` (its body unread; no deadline);
        ``ServerError`` for any other answer."""
        exchange = self._open("POST", path, body, _NO_DEADLINE)
        exchange.close()
        return exchange.response.status

    def stream(self, path: str, body: dict[str, Any], timeout: float | None) -> Generator[dict[str, Any], None, None]:
        """The server-sent events of ``POST path``, until ``[DONE]``. ``timeout`` (seconds, counted
        from the first ``next``; None: none) bounds the whole exchange, retries included; closing
        the iterator closes the connection, which cancels the request on the server."""
        deadline = _Deadline.start(timeout)
        exchange = self._open("POST", path, body, deadline)
        try:
            yield from self._events(exchange, deadline)
        finally:
            exchange.close()

    def malformed(self, exc: Exception, data: bytes) -> BackendError:
        """The error for an event (``data``) that is not shaped as expected (``exc`` says how)."""
        return BackendError(f"the vLLM server at {self.base_url} sent a malformed stream event "
                            f"({describe(exc)}): {data[:200]!r}")

    def _open(self, method: str, path: str, body: dict[str, Any] | None, deadline: _Deadline) -> _Exchange:
        """Send a request and return its 2xx answer, retrying failed connects and 502/503/504
        with exponential backoff while ``max_retries`` and the deadline allow."""
        payload = None if body is None else json.dumps(body).encode()
        delay, began, attempts = self.retry_backoff, time.monotonic(), 0
        while True:
            attempts += 1
            try:
                return self._exchange(method, path, payload, deadline)
            except ServerError as exc:
                if exc.status not in RETRY_STATUSES:
                    raise
                failure: BaseException = exc
            except _Unreachable as exc:
                failure = exc.__cause__ or exc
            left = deadline.left()
            if attempts > self.max_retries or (left is not None and left < delay):
                break
            logger.warning("vLLM server at %s: %s; retry %d of %d in %.2g s",
                           self.base_url, describe(failure), attempts, self.max_retries, delay)
            time.sleep(delay)
            delay *= 2
        tried = f"{attempts} attempt{'s' if attempts > 1 else ''} over {time.monotonic() - began:.1f} s"
        if attempts <= self.max_retries or deadline.passed():  # the deadline cut the retries short
            raise self._timed_out(deadline, f"before answering {path}", f"{tried}; last: {describe(failure)}"
                                  ) from failure
        if isinstance(failure, ServerError):
            if attempts == 1:
                raise failure
            raise ServerError(f"{failure} ({tried})", failure.status) from failure
        raise BackendError(
            f"cannot reach the vLLM server at {self.base_url} ({describe(failure)}; {tried}). "
            "Is it running? Start it with: specprefill-rag serve MODEL"
        ) from failure

    def _exchange(self, method: str, path: str, payload: bytes | None, deadline: _Deadline) -> _Exchange:
        """One attempt: connect, send, read the status. ``_Unreachable`` when no connection was
        made, ``ServerError`` for a non-2xx answer, another ``BackendError`` for any other failure."""
        if deadline.passed():
            raise self._timed_out(deadline, f"before answering {path}")
        cls = http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
        conn = cls(self._host, self._port, timeout=deadline.cap(self.connect_timeout))
        try:
            conn.connect()
        except OSError as exc:
            conn.close()
            raise _Unreachable() from exc
        sock = conn.sock
        limit = deadline.cap(self.read_timeout)
        try:
            sock.settimeout(limit)
            headers = ({"Content-Type": "application/json"} if payload else {}) | self._auth
            conn.request(method, self._prefix + path, body=payload, headers=headers)
            response = conn.getresponse()
        except _IO_ERRORS as exc:
            conn.close()
            raise self._io_error(exc, limit, deadline, f"before answering {path}") from exc
        if not 200 <= response.status < 300:
            text = _read_error_body(response)
            response.close()
            conn.close()
            raise ServerError(
                f"the vLLM server at {self.base_url} answered {path} with HTTP {response.status}: "
                f"{_error_message(text)}",
                response.status,
            )
        return _Exchange(conn, response, sock)

    def _io_error(self, exc: BaseException, limit: float, deadline: _Deadline, where: str) -> BackendError:
        """The error for ``exc``, raised by a read or write under a socket timeout of ``limit`` s;
        ``where`` ("mid-stream", "before answering PATH") ends the message."""
        if isinstance(exc, TimeoutError):
            if limit < self.read_timeout:  # the deadline, not the read timeout, set the limit
                return self._timed_out(deadline, where)
            return BackendError(f"the vLLM server at {self.base_url} sent nothing for {self.read_timeout:g} s {where}")
        return BackendError(f"the connection to the vLLM server at {self.base_url} failed {where}: {describe(exc)}")

    def _timed_out(self, deadline: _Deadline, where: str, detail: str = "") -> BackendTimeoutError:
        return BackendTimeoutError(
            f"the vLLM server at {self.base_url} ran past the request's timeout of {deadline.timeout:g} s {where}"
            + (f" ({detail})" if detail else "")
        )

    def _lines(self, exchange: _Exchange, deadline: _Deadline) -> Iterator[bytes]:
        """The response's lines (line end stripped) as they arrive. The deadline is checked at every
        line and caps every socket read, so neither keep-alive comments nor silence outlast it."""
        buffer = bytearray()
        while True:
            if deadline.passed():
                raise self._timed_out(deadline, "mid-stream")
            end = buffer.find(b"\n")
            if end >= 0:
                line = bytes(buffer[:end]).rstrip(b"\r")
                del buffer[: end + 1]
                yield line
                continue
            if len(buffer) > _MAX_LINE:
                raise BackendError(f"the vLLM server at {self.base_url} sent a stream line over {_MAX_LINE} bytes")
            limit = deadline.cap(self.read_timeout)
            try:
                exchange.sock.settimeout(limit)
                chunk = exchange.response.read1(_READ_SIZE)
            except _IO_ERRORS as exc:
                raise self._io_error(exc, limit, deadline, "mid-stream") from exc
            if not chunk:
                raise BackendError(f"the vLLM server at {self.base_url} closed the stream early")
            buffer += chunk

    def _events(self, exchange: _Exchange, deadline: _Deadline) -> Iterator[dict[str, Any]]:
        """Parsed ``data:`` events of a server-sent-event stream, until ``[DONE]``."""
        for line in self._lines(exchange, deadline):
            if not line.startswith(b"data:"):
                continue  # blank separators, ": keep-alive" comments, other fields
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            try:
                event = json.loads(data.decode("utf-8"))  # SSE is UTF-8 (json.loads would guess)
                if not isinstance(event, dict):
                    raise TypeError(f"an event must be a JSON object, got {type(event).__name__}")
            except (TypeError, ValueError) as exc:  # ValueError covers bad JSON and bad UTF-8
                raise self.malformed(exc, data) from exc
            if event.get("error") is not None:
                raise ServerError(f"the vLLM server at {self.base_url} failed mid-stream: "
                                  f"{_error_message(json.dumps(event))}", None)
            yield event


def describe(exc: BaseException) -> str:
    """An exception as its type and message, for error messages."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _read_error_body(response: http.client.HTTPResponse) -> str:
    """Up to 64 KiB of an error answer's body ("" when it cannot be read)."""
    try:
        return response.read(1 << 16).decode(errors="replace")
    except _IO_ERRORS:
        return ""


def _error_message(text: str) -> str:
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()[:500] or "(empty body)"
    error = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(error, dict):
        return str(error.get("message") or error.get("detail") or error)
    return str(error)
