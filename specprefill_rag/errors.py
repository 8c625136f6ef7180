"""The exceptions this package raises on purpose, under one base class.

Catch ``SpecPrefillError`` for everything; the subclasses say whose fault it was. Value
problems also subclass ``ValueError`` and type problems ``TypeError``, so code written
against the built-in types keeps working. docs/configuration.md ("Errors") lists which
failure raises what.

    SpecPrefillError
    ├── ConfigError (ValueError)         a config field out of range
    │   ├── ConfigTypeError (TypeError)  a config field of the wrong type
    │   └── ModelNotFoundError           a model name that is no packaged model, directory or GGUF
    ├── InputError (ValueError)          a request the model cannot answer as given
    │   ├── InputTypeError (TypeError)   passages or messages of the wrong type
    │   ├── SchemaError                  JSON or a JSON schema over the limits (``path``: where)
    │   └── GrammarError                 a grammar llguidance refuses, or cannot decode under
    ├── PlanError (ValueError)           a malformed prefill plan (client or vLLM plugin)
    ├── BackendError (RuntimeError)      the main model could not serve the request
    │   ├── ServerError                  the vLLM server answered with an error (``status``)
    │   ├── BackendTimeoutError (TimeoutError)  no answer within the deadline
    │   ├── PluginMissingError           a planned request reached a vLLM without the plugin
    │   └── ServerStartError             the vLLM server exited or was not ready in time
    ├── UnsupportedVLLMError (RuntimeError)  the installed vLLM is not one the plugin was written for
    └── MissingDependencyError (ImportError)  an optional part is not installed; the message
                                              names the one ``pip install`` that adds it

An error quotes what a client sent through ``excerpt``: at most ``QUOTE_CHARS`` characters of
it, however large the value (a schema may be megabytes).

Pure Python, no imports: the vLLM plugin's workers use ``PlanError`` too.
"""

from __future__ import annotations

__all__ = [
    "BackendError",
    "BackendTimeoutError",
    "ConfigError",
    "ConfigTypeError",
    "GrammarError",
    "InputError",
    "InputTypeError",
    "MissingDependencyError",
    "ModelNotFoundError",
    "PlanError",
    "PluginMissingError",
    "QUOTE_CHARS",
    "SchemaError",
    "ServerError",
    "ServerStartError",
    "SpecPrefillError",
    "ToolCallError",
    "UnsupportedVLLMError",
    "excerpt",
]

QUOTE_CHARS = 200  # the most of a client's text an error message (or a log line) quotes


def excerpt(text: str, limit: int = QUOTE_CHARS) -> str:
    """``text`` as an error quotes it: whole when it has at most ``limit`` characters, else its
    head and tail around an ellipsis, ``limit`` characters in all."""
    if len(text) <= limit:
        return text
    head = (limit - 1) * 2 // 3
    return text[:head] + "…" + text[len(text) - (limit - 1 - head):]


class SpecPrefillError(Exception):
    """Base of every error specprefill-rag raises on purpose."""


class ConfigError(SpecPrefillError, ValueError):
    """A configuration value is out of range (keep rate above 1, negative look-ahead, ...)."""


class ConfigTypeError(ConfigError, TypeError):
    """A configuration field has the wrong type (a bool for a rate, 2.5 for a count)."""


class ModelNotFoundError(ConfigError):
    """The name is neither a packaged model, an HF model directory nor a .gguf file."""


class InputError(SpecPrefillError, ValueError):
    """The request cannot be answered as given: empty question or context, prompt over the window."""


class InputTypeError(InputError, TypeError):
    """Passages or messages of a type the engine does not take."""


class SchemaError(InputError):
    """JSON nested deeper than the limit, or a JSON schema over the limits on what a grammar may
    hold (``schema_limits``). ``path`` names where, as a request field (``tools[2].function.
    parameters.properties.x``), at most ``QUOTE_CHARS`` characters."""

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.path = path


class GrammarError(InputError):
    """A grammar (a JSON schema's, the tool calls', your own Lark) that llguidance refuses: it does
    not compile, overruns the compile budget, allows no first token, or fails while the answer is
    decoded. ``param`` is the request field it came from (``"response_format"``, ``"tools"``) when
    known. The message quotes llguidance's reason through ``excerpt``."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ToolCallError(SpecPrefillError, ValueError):
    """The model's output holds a tool call that does not parse or does not fit the offered tools
    (unknown name, arguments not a JSON object, a required key missing, a wrong type), or breaks
    the request's ``tool_choice``. No call of such an answer is reported: never a half-parsed one."""


class MissingDependencyError(SpecPrefillError, ImportError):
    """An optional part (retrieval, the gateway, vLLM, benchmarks) is not installed. ``install``
    is the command that adds it; the message ends with it."""

    def __init__(self, what: str, install: str) -> None:
        super().__init__(f"{what}: {install}")
        self.install = install


class PlanError(SpecPrefillError, ValueError):
    """A prefill plan is malformed; the message says what to fix."""


class BackendError(SpecPrefillError, RuntimeError):
    """The main model could not serve a request (server down, bad response, unsupported plan)."""


class ServerError(BackendError):
    """The server answered with an error; ``status`` is the HTTP status (None: an error event
    in a stream)."""

    def __init__(self, message: str, status: int | None) -> None:
        super().__init__(message)
        self.status = status


class BackendTimeoutError(BackendError, TimeoutError):
    """The request's deadline passed before the backend answered (or finished streaming)."""


class PluginMissingError(BackendError):
    """A planned request reached a vLLM server (or replica) without the SpecPrefill plugin: the
    plugin check failed or an answer came without the plugin's proof. Nothing of it reached the
    caller; the gateway can answer in text mode instead (``--fallback-text-mode``)."""


class ServerStartError(BackendError):
    """The vLLM server exited or did not become ready in time (``specprefill-rag serve``)."""


class UnsupportedVLLMError(SpecPrefillError, RuntimeError):
    """The installed vLLM is not one the plugin was written for."""
