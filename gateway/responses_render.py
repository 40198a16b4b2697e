"""A request's replies written as OpenAI's Responses API writes them: the response object (its output
items: reasoning, message, function_call), and while streaming the typed events the official
client parses, each with its `sequence_number`."""
from __future__ import annotations

import hashlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.answer_io import sse
from gateway.answer_items import Append, Close, Event, Item, Items, Open
from gateway.responses_schemas import ResponsesRequest
from shared import protocol
from shared.errors import KvgateError

Store = Callable[[dict], Awaitable[None]]  # keeps the finished response (store: true)


class ResponseRender:
    def __init__(self, body: ResponsesRequest, response_id: str, items: Items, store: Store | None):
        self.body, self.id, self.items, self.store = body, response_id, items, store
        self.created = int(time.time())
        self.stored = body.store  # False once keeping it failed: the client is told so
        self.status, self.usage, self.error_body = "in_progress", None, None
        self.seq = 0
        self.conversation: list[dict] | None = None  # what `store` keeps with it, when it does

    # -- the response object ------------------------------------------------------------------
    def result(self) -> dict[str, Any]:
        body = self.body
        incomplete = {"reason": "max_output_tokens"} if self.status == "incomplete" else None
        fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format else {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": self.status,
            "background": False, "error": self.error_body, "incomplete_details": incomplete,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {}, "model": body.model,
            "output": [self._item(i) for i in self.items.items],
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": body.reasoning.model_dump() if body.reasoning else {"effort": None, "summary": None},
            "store": self.stored, "temperature": body.temperature if body.temperature is not None else 1.0,
            "text": {"format": fmt}, "tool_choice": _choice(body.tool_choice),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
            "top_p": body.top_p if body.top_p is not None else 1.0, "truncation": "disabled",
            "usage": self.usage, "user": body.user}

    def spec(self) -> dict[str, Any]:
        """What rebuilds it at another gateway for a resumed stream (gateway/responses_api.py)."""
        return {"id": self.id, "created": self.created, "conversation": self.conversation,
                "body": self.body.model_dump(mode="json", by_alias=True, exclude_unset=True)}

    def _item_id(self, item: Item) -> str:
        """The same at every gateway that renders this response (a resumed stream names the items
        the client already saw as it saw them)."""
        prefix = {"reasoning": "rs", "text": "msg", "call": "fc"}[item.kind]
        digest = hashlib.blake2b(f"{self.id}:{item.index}".encode(), digest_size=12).hexdigest()
        return f"{prefix}_{digest}"

    def _item(self, item: Item, done: bool = True) -> dict[str, Any]:
        status = "in_progress" if not done else "incomplete" if item.cut else "completed"
        if item.kind == "reasoning":
            content = [{"type": "reasoning_text", "text": item.text}] if done else []
            return {"id": self._item_id(item), "type": "reasoning", "summary": [], "content": content,
                    "status": status}
        if item.kind == "text":
            content = [_text_part(item.text)] if done else []
            return {"id": self._item_id(item), "type": "message", "role": "assistant",
                    "status": status, "content": content}
        return {"id": self._item_id(item), "type": "function_call", "call_id": item.call_id,
                "name": item.name, "arguments": item.text if done else "", "status": status}

    def assistant_message(self) -> dict | None:
        """The output as the conversation's next chat message (what a follow-up continues from)."""
        text = "".join(i.text for i in self.items.items if i.kind == "text")
        calls = [{"id": i.call_id, "type": "function", "function": {"name": i.name, "arguments": i.text}}
                 for i in self.items.items if i.kind == "call"]
        if not (text or calls):
            return None
        return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}

    # -- the stream -----------------------------------------------------------------------------
    def _event(self, kind: str, **fields) -> bytes:
        self.seq += 1
        return sse(kind, {"type": kind, "sequence_number": self.seq - 1, **fields})

    def start(self) -> list[bytes]:
        return [self._event("response.created", response=self.result()),
                self._event("response.in_progress", response=self.result())]

    def keepalive(self) -> bytes:
        return b": keep-alive\n"  # no blank line: after an `id:` the openai client reads one as an event

    def delta(self, reply: protocol.Delta) -> list[bytes]:
        return [out for event in self.items.feed(reply) for out in self._write(event)]

    async def done(self, usage: dict) -> list[bytes]:
        self.status = "incomplete" if self.items.finish_reason == "length" else "completed"
        self.usage = {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": usage["completion_tokens"],
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": usage["total_tokens"]}
        if self.store is not None:
            await self.store(self.result())
        kind = "response.incomplete" if self.status == "incomplete" else "response.completed"
        return [self._event(kind, response=self.result())]

    def error(self, exc: KvgateError) -> list[bytes]:
        self.status = "failed"
        self.error_body = {"code": exc.code or exc.type, "message": exc.message}
        closing = [out for event in self.items.close() for out in self._write(event)]
        return [*closing, self._event("error", code=exc.code, message=exc.message, param=exc.param),
                self._event("response.failed", response=self.result())]

    def _write(self, event: Event) -> list[bytes]:
        item = event.item
        where = {"output_index": item.index, "item_id": self._item_id(item)}
        if isinstance(event, Open):
            out = [self._event("response.output_item.added", output_index=item.index,
                               item=self._item(item, done=False))]
            if item.kind != "call":
                out.append(self._event("response.content_part.added", **where, content_index=0,
                                       part=_part(item, "")))
            return out
        if isinstance(event, Append):
            if item.kind == "call":
                return [self._event("response.function_call_arguments.delta", **where, delta=event.piece)]
            if item.kind == "reasoning":
                return [self._event("response.reasoning_text.delta", **where, content_index=0,
                                    delta=event.piece)]
            return [self._event("response.output_text.delta", **where, content_index=0,
                                delta=event.piece, logprobs=[])]
        assert isinstance(event, Close)
        if item.kind == "call":
            out = [self._event("response.function_call_arguments.done", **where, arguments=item.text)]
        else:
            kind = "response.reasoning_text.done" if item.kind == "reasoning" else "response.output_text.done"
            extra = {} if item.kind == "reasoning" else {"logprobs": []}
            out = [self._event(kind, **where, content_index=0, text=item.text, **extra),
                   self._event("response.content_part.done", **where, content_index=0,
                               part=_part(item, item.text))]
        return [*out, self._event("response.output_item.done", output_index=item.index,
                                  item=self._item(item))]


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _part(item: Item, text: str) -> dict:
    return {"type": "reasoning_text", "text": text} if item.kind == "reasoning" else _text_part(text)


def _choice(choice) -> Any:
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.model_dump(exclude_none=True)
