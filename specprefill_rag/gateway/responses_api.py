"""OpenAI's Responses API on the gateway: ``POST /v1/responses`` (docs/gateway.md, "Responses API").

A Responses request is read as the chat request it is (``ResponsesCall.read``): ``instructions``
become the system message, ``input`` items the messages (a ``function_call`` an assistant's tool
call, a ``function_call_output`` a ``tool`` message), flat function tools chat tools,
``text.format`` the ``response_format`` and ``max_output_tokens`` the ``max_tokens``. The chat
parser then checks it as every chat request is checked — the same refusals, limits and prompt
shapes — and an error names the Responses field (``input[2].content``, ``text.format``).

The answer is a ``response`` object whose ``output`` holds the assistant's message and its
``function_call`` items, or the stream of typed events OpenAI sends for one, both with the
``specprefill`` object. ``previous_response_id`` continues a conversation this process stored
(``store``, true unless the request says false): ``ResponseStore`` keeps the messages per cache
namespace, so a tenant never continues another's, least recently used out. No web framework here.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncGenerator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ..caches import Bounded
from ..types import GenerationResult
from .fields import bad, shown, unsupported
from .responses import APIError, arguments_text, extension, message, to_api_error
from .runs import Run

__all__ = ["ResponseEvents", "ResponseStore", "ResponsesCall", "stream_response", "whole_response"]

# The chat fields a Responses request carries under the same name (the vLLM and SpecPrefill ones too);
# others that change nothing here (metadata, include, truncation, service_tier, ...) are ignored.
_PASSED = ("temperature", "top_p", "parallel_tool_calls", "stream", "seed", "stop", "top_k", "cache_salt",
           "specprefill")
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_MESSAGE_PARAM = re.compile(r"^messages\[(\d+)\]")
# A chat field as an error message quotes it (``messages[3].tool_calls[0].function.arguments``).
_CHAT_FIELD = re.compile(r"messages\[\d+\](?:\.[A-Za-z_]+|\[\d+\])*|response_format(?:\.[A-Za-z_$]+|\[\d+\])*"
                         r"|\bmax_tokens\b|tools\[\d+\]\.function")


class ResponseStore(Bounded[tuple[str, str], tuple[dict[str, Any], ...]]):
    """The conversations ``previous_response_id`` continues, keyed by (cache namespace, response
    id): each stored response's messages (its input and its output, without ``instructions``), at
    most ``entries`` and ``max_bytes`` of them (their JSON), least recently used out."""

    def __init__(self, entries: int = 1024, max_bytes: int = 256 << 20) -> None:
        super().__init__(entries, max_bytes, lambda messages: len(json.dumps(messages)))

    def get(self, namespace: str, rid: str) -> tuple[dict[str, Any], ...] | None:
        return self._get((namespace, rid))


def _text_of(content: object, param: str) -> str | list[dict[str, Any]]:
    """A message's content as chat content: a string, or its text parts (``input_text`` and
    ``output_text``) as chat text parts; anything else (images, files, audio) is refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{param} must be a string or a list of content parts, got {shown(content)}", param=param)
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else part
            raise unsupported(f"{param}[{j}]", f"content of type {shown(kind)} (only input_text and output_text)")
        parts.append({"type": "text", "text": part.get("text")})
    return parts


def _function_call(item: Mapping[str, Any], param: str) -> dict[str, Any]:
    call_id = item.get("call_id")
    if not isinstance(call_id, str):
        raise bad(f"{param}.call_id must be a string, got {shown(call_id)}", param=f"{param}.call_id")
    function = {"name": item.get("name"), "arguments": item.get("arguments")}
    return {"id": call_id, "type": "function", "function": function}


def _messages(items: object) -> tuple[list[dict[str, Any]], list[list[str]]]:
    """``input`` as chat messages, with the ``input`` items each came from (for error params): one
    for a message, one per call for an assistant turn's calls (consecutive ``function_call`` items,
    after the turn's text if it has some, are one assistant message)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}], [["input"]]
    if not isinstance(items, list) or not items:
        raise bad("input must be a non-empty string or a non-empty list of items", param="input")
    messages: list[dict[str, Any]] = []
    origins: list[list[str]] = []
    for n, item in enumerate(items):
        param = f"input[{n}]"
        if not isinstance(item, dict):
            raise bad(f"{param} must be an object, got {shown(item)}", param=param)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in _ROLES:
                raise bad(f"{param}.role must be one of {sorted(_ROLES)}, got {shown(role)}", param=f"{param}.role")
            messages.append({"role": _ROLES[role], "content": _text_of(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            call = _function_call(item, param)
            if messages and messages[-1]["role"] == "assistant":  # the calls of one turn are one message
                messages[-1].setdefault("tool_calls", []).append(call)
                origins[-1].append(param)
                continue
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            origins.append([param, param])  # the message, and its first call
            continue
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _text_of(output, f"{param}.output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
        elif kind == "reasoning":
            continue  # a reasoning model's summary of its thoughts: nothing this model reads
        else:
            raise unsupported(f"{param}.type", f"input items of type {shown(kind)}")
        origins.append([param])
    return messages, origins


def _tools(raw: object) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise bad(f"tools must be a list of tools, got {shown(raw)}", param="tools")
    out = []
    for n, tool in enumerate(raw):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise unsupported(f"tools[{n}].type", f"tools of type {shown(kind)} (only function tools)")
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(raw: object) -> object:
    if isinstance(raw, dict) and raw.get("type") == "function":
        return {"type": "function", "function": {"name": raw.get("name")}}
    if isinstance(raw, dict):
        raise unsupported("tool_choice", f"tool_choice of type {shown(raw.get('type'))} (only function)")
    return raw


def _response_format(text: object) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad(f"text must be an object, got {shown(text)}", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad(f"text.format must be an object, got {shown(fmt)}", param="text.format")
    if fmt.get("type") == "json_schema":
        schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": fmt.get("type")}


def _refuse(body: Mapping[str, Any]) -> None:
    if body.get("background"):
        raise unsupported("background", "background responses")
    if body.get("top_logprobs"):
        raise unsupported("top_logprobs", "logprobs")
    reasoning = body.get("reasoning")
    if reasoning not in (None, {}) and not (isinstance(reasoning, dict) and reasoning.get("effort") is None):
        raise unsupported("reasoning", "reasoning effort (the model does not reason apart from its answer)")
    for name, what in (("conversation", "conversations (send previous_response_id or the whole input)"),
                       ("prompt", "prompt templates"), ("max_tool_calls", "max_tool_calls")):
        if body.get(name) is not None:
            raise unsupported(name, what)


@dataclass
class ResponsesCall:
    """One Responses request, read (``read``): the chat body it is, what its response echoes, and
    the messages its conversation holds so far (stored with the answer for a later request)."""

    rid: str
    created: int
    chat: dict[str, Any]
    echo: dict[str, Any]
    history: list[dict[str, Any]]  # earlier turns and this request's input, without instructions
    origins: list[list[str]]  # per chat message: the Responses field it came from (then one per call)
    store: bool
    namespace: str

    @classmethod
    def read(cls, body: Mapping[str, Any], store: ResponseStore, namespace: str) -> ResponsesCall:
        """``body`` as a chat completions body. ``namespace`` is the request's cache namespace
        (tenant and salt): a ``previous_response_id`` is looked up there only."""
        _refuse(body)
        previous = body.get("previous_response_id")
        earlier: tuple[dict[str, Any], ...] = ()
        if previous is not None:
            if not isinstance(previous, str):
                raise bad(f"previous_response_id must be a string, got {shown(previous)}",
                          param="previous_response_id")
            found = store.get(namespace, previous)
            if found is None:
                raise bad(f"no stored response {shown(previous)} to continue (responses are kept in this gateway "
                          "process, per tenant, until evicted)", param="previous_response_id",
                          code="previous_response_not_found")
            earlier = found
        messages, origins = _messages(body.get("input"))
        instructions = body.get("instructions")
        head: list[dict[str, Any]] = []
        if instructions is not None:
            if not isinstance(instructions, str):
                raise bad(f"instructions must be a string, got {shown(instructions)}", param="instructions")
            head = [{"role": "system", "content": instructions}]
        chat: dict[str, Any] = {"messages": [*head, *earlier, *messages]}
        chat.update({name: body[name] for name in _PASSED if name in body})
        if body.get("max_output_tokens") is not None:
            chat["max_tokens"] = body["max_output_tokens"]
        if (tools := _tools(body.get("tools"))):
            chat["tools"] = tools
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _tool_choice(body["tool_choice"])
        if (response_format := _response_format(body.get("text"))) is not None:
            chat["response_format"] = response_format
        keep = body.get("store", True)
        if not isinstance(keep, bool):
            raise bad(f"store must be true or false, got {shown(keep)}", param="store")
        echo = {name: body.get(name) for name in ("instructions", "max_output_tokens", "previous_response_id")}
        echo.update(tools=body.get("tools") or [], tool_choice=body.get("tool_choice", "auto"),
                    parallel_tool_calls=body.get("parallel_tool_calls", True), temperature=body.get("temperature"),
                    top_p=body.get("top_p"), metadata=body.get("metadata") or {},
                    text=body.get("text") or {"format": {"type": "text"}}, store=keep, user=body.get("user"))
        origins = [["instructions"]] * len(head) + [["previous_response_id"]] * len(earlier) + origins
        return cls(f"resp_{uuid.uuid4().hex}", int(time.time()), chat, echo, [*earlier, *messages], origins, keep,
                   namespace)

    @property
    def kinds(self) -> list[str]:
        """Each chat message's role, in order."""
        return [message["role"] for message in self.chat["messages"]]

    def param(self, param: str | None) -> str | None:
        """A chat parser's error param as the Responses field it came from."""
        if param is None:
            return None
        match = _MESSAGE_PARAM.match(param)
        if match and int(match.group(1)) < len(self.origins):
            origin, rest = self.origins[int(match.group(1))], param[match.end():]
            if not origin[0].startswith("input"):  # the instructions, or a stored turn
                return origin[0]
            call = re.match(r"^\.tool_calls\[(\d+)\](?:\.function)?", rest)
            if call:  # a call's name, arguments or id: its own function_call item
                at = int(call.group(1)) + 1
                item = origin[at] if at < len(origin) else origin[0]
                tail = rest[call.end():]
                return item + (".call_id" if tail == ".id" else tail)
            if self.kinds[int(match.group(1))] == "tool":
                rest = ".call_id" if rest == ".tool_call_id" else rest.replace(".content", ".output")
            return origin[0] + rest
        for chat_name, name in (("max_tokens", "max_output_tokens"), ("response_format.json_schema", "text.format"),
                                ("response_format", "text.format")):
            if param.startswith(chat_name):
                return name + param[len(chat_name):]
        return re.sub(r"^tools\[(\d+)\]\.function", r"tools[\1]", param)

    def renamed(self, error: APIError) -> APIError:
        """``error`` naming the Responses fields: its ``param``, and every chat field its message
        quotes."""
        message = _CHAT_FIELD.sub(lambda match: self.param(match.group(0)) or match.group(0), error.message)
        return APIError(error.status, message, type=error.type, param=self.param(error.param), code=error.code,
                        headers=error.headers)

    def remember(self, store: ResponseStore, result: GenerationResult) -> None:
        """Keep this conversation, the answer included, for a later ``previous_response_id``."""
        if self.store:
            store.put((self.namespace, self.rid), (*self.history, message(result)))  # the chat answer's message


def _content(result: GenerationResult) -> str:
    return result.text if result.content is None else result.content


def _usage(result: GenerationResult) -> dict[str, Any]:
    return {"input_tokens": result.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": result.generated_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": result.prompt_tokens + result.generated_tokens}


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    done = status == "completed"
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if done else []
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def _call_items(result: GenerationResult) -> list[dict[str, Any]]:
    return [{"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call.id, "name": call.name,
             "arguments": arguments_text(call), "status": "completed"} for call in result.tool_calls]


def _response(call: ResponsesCall, model: str, status: str, output: list[dict[str, Any]],
              result: GenerationResult | None, shape: str) -> dict[str, Any]:
    out: dict[str, Any] = {"id": call.rid, "object": "response", "created_at": call.created, "status": status,
                           "error": None, "incomplete_details": None, "model": model, "output": output,
                           **call.echo, "usage": None}
    if result is not None:
        if result.finish_reason == "length" and not result.tool_calls:
            out.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
        out.update(usage=_usage(result), specprefill=extension(result, shape))
    return out


def whole_response(call: ResponsesCall, model: str, result: GenerationResult, shape: str) -> dict[str, Any]:
    """The ``response`` object of a finished answer: its message (when it has text, or no calls)
    and its ``function_call`` items, ``usage`` and the ``specprefill`` object."""
    content = _content(result)
    output = [] if (result.tool_calls and not content) else [_message_item(f"msg_{uuid.uuid4().hex}", content)]
    return _response(call, model, "completed", output + _call_items(result), result, shape)


class ResponseEvents:
    """The typed events of one streamed response, numbered: ``response.created``, the message's
    ``output_text`` deltas between its item and part events, then each ``function_call`` item
    with its arguments, then ``response.completed`` (or ``.incomplete``) with the whole response."""

    def __init__(self, call: ResponsesCall, model: str, shape: str) -> None:
        self.call, self.model, self.shape = call, model, shape
        self.sequence = 0
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.text: list[str] = []
        self.opened = False

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()

    def first(self) -> Iterator[bytes]:
        pending = _response(self.call, self.model, "in_progress", [], None, self.shape)
        yield self._event("response.created", response=pending)
        yield self._event("response.in_progress", response=pending)

    def _open(self) -> Iterator[bytes]:
        if not self.opened:
            self.opened = True
            yield self._event("response.output_item.added", output_index=0,
                              item=_message_item(self.message_id, "", "in_progress"))
            yield self._event("response.content_part.added", item_id=self.message_id, output_index=0,
                              content_index=0, part={"type": "output_text", "text": "", "annotations": []})

    def delta(self, text: str) -> Iterator[bytes]:
        if not text:
            return
        yield from self._open()
        self.text.append(text)
        yield self._event("response.output_text.delta", item_id=self.message_id, output_index=0, content_index=0,
                          delta=text, logprobs=[])

    def last(self, result: GenerationResult) -> Iterator[bytes]:
        """The message's closing events (opened when there is text, or no calls), each call's, and
        the whole response."""
        output: list[dict[str, Any]] = []
        if self.opened or not result.tool_calls:
            yield from self._open()
            text = "".join(self.text)
            yield self._event("response.output_text.done", item_id=self.message_id, output_index=0,
                              content_index=0, text=text, logprobs=[])
            yield self._event("response.content_part.done", item_id=self.message_id, output_index=0,
                              content_index=0, part={"type": "output_text", "text": text, "annotations": []})
            output.append(_message_item(self.message_id, text))
            yield self._event("response.output_item.done", output_index=0, item=output[-1])
        for item in _call_items(result):
            index = len(output)
            yield self._event("response.output_item.added", output_index=index,
                              item={**item, "arguments": "", "status": "in_progress"})
            yield self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                              delta=item["arguments"])
            yield self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                              arguments=item["arguments"])
            output.append(item)
            yield self._event("response.output_item.done", output_index=index, item=item)
        done = _response(self.call, self.model, "completed", output, result, self.shape)
        kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
        yield self._event(kind, response=done)

    def error(self, error: APIError) -> bytes:
        """What ends a stream that fails after its first event (OpenAI's ``error`` event)."""
        return self._event("error", code=error.code, message=error.message, param=error.param)


async def stream_response(run: Run, first: str | None, call: ResponsesCall, model: str,
                          store: ResponseStore) -> AsyncGenerator[bytes, None]:
    """A streamed response's events (``ResponseEvents``) as the run yields its text; whatever fails
    after the first event (the engine, or encoding one) ends the stream with an ``error`` event,
    counted with the error's status. The run's slots are freed before the last event."""
    req = run.request
    assert req is not None
    events = ResponseEvents(call, model, req.prompt_shape)
    status = 499  # unless the stream ends or fails: the client went away (cancelled, closed)
    tail: list[bytes] = []
    try:
        for event in events.first():
            yield event
        delta = first
        while delta is not None:
            for event in events.delta(delta):
                yield event
            delta = await run.next()
        result = run.result
        assert result is not None
        rest = run.calls.finish(result) if run.calls is not None else ""  # content after the tool calls
        tail = [*events.delta(rest), *events.last(result)]
        call.remember(store, result)
        status = 200
    except Exception as exc:  # after the first event: an error event ends the stream
        error = call.renamed(to_api_error(exc))
        status = error.status
        tail = [events.error(error)]
    finally:
        await run.close(status)
    for event in tail:
        yield event
