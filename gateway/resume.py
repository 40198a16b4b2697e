"""Resuming a stream: every SSE event carries `id: <request id>:<sequence>` (the sequence number of
the reply it renders; 0 for chat's opening role chunk), so a client whose connection broke sends
the same request again to any gateway with `Last-Event-ID` (or GETs /v1/streams/<request id>) and
gets every event after that id, once. Its events are rebuilt from the request's reply log: the
replies up to the id are fed through a fresh response shape without being sent (so a tool-call
parser stands where the original's stood), the rest are sent as they come.

What a resume needs besides the log travels in the stream's lease (gateway/stream_leases.py): the
response's shape (kind, model, choices, created, tool-call reading) and its deadline.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import TypeAdapter

from gateway import tool_calls
from gateway.agent_schemas import Tool, ToolChoice
from shared import tool_parsers
from shared.errors import InvalidRequest

HEADER = "last-event-id"
# another API's way of sending a resumed stream: name -> async (state, lease, answer, its render's
# spec, after) -> response; registered by the API's module (gateway/messages_api.py, responses_api.py)
RENDERS: dict[str, Callable[..., Awaitable[Any]]] = {}
_tools = TypeAdapter(list[Tool])
_choice = TypeAdapter(ToolChoice)


def event_id(request_id: str, seq: int) -> bytes:
    return f"id: {request_id}:{seq}\n".encode()


def point(value: str | None) -> tuple[str, int] | None:
    """(request id, last sequence received) from a Last-Event-ID; None when there is none."""
    if value is None:
        return None
    request_id, _, seq = value.strip().rpartition(":")
    if not request_id or not seq.isdigit():
        raise InvalidRequest(f"Last-Event-ID '{value[:100]}' is not an event id of kvgate's "
                             "(<request id>:<sequence>)", param="Last-Event-ID",
                             code="invalid_last_event_id")
    return request_id, int(seq)


def past_the_end(after: int, last: int) -> InvalidRequest | None:
    """A Last-Event-ID after the stream's last event (`last`) names events it never sent: said as
    the stream's end, not answered with an end that looks like a clean one."""
    if after <= last:
        return None
    return InvalidRequest(f"Last-Event-ID names event {min(after, 10**18)}, past this stream's last event ({last})",
                          param="Last-Event-ID", code="invalid_last_event_id")


def shape_spec(kind: str, model: str, n: int, created: int, include_usage: bool,
               tools: list[Tool] | None = None, choice: Any = None, parallel: bool = True,
               parser: str | None = None, echo: dict | None = None) -> dict:
    """What rebuilds a stream's response shape at another gateway (JSON). `echo`: a completion's
    echo of its prompt (text, logprobs, vLLM's field), so a stream resumed before a choice's first
    chunk still starts with the prompt."""
    return {"kind": kind, "model": model, "n": n, "created": created, "include_usage": include_usage,
            "echo": echo,
            "tools": [t.model_dump(exclude_none=True) for t in tools] if tools else None,
            "choice": choice.model_dump() if hasattr(choice, "model_dump") else choice,
            "parallel": parallel, "parser": parser if parser in tool_parsers.PARSERS else None}


def outputs_of(spec: dict):
    """() -> how one choice's text becomes content and tool calls, as the original had it."""
    if spec["kind"] != "chat":
        return lambda: tool_calls.ChoiceOutput(tool_calls.reader(None, None, None))
    tools = _tools.validate_python(spec["tools"]) if spec["tools"] else None
    choice = _choice.validate_python(spec["choice"]) if spec["choice"] is not None else None
    return lambda: tool_calls.ChoiceOutput(tool_calls.reader(tools, choice, spec["parser"]),
                                           spec["parallel"])
