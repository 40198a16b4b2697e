"""A request's replies written as Anthropic's Messages API writes them: the message (content blocks:
thinking, text, tool_use) and while streaming its event sequence: message_start, ping, per block
content_block_start / _delta (text_delta, thinking_delta, input_json_delta) / _stop, message_delta
(stop_reason, usage), message_stop."""
from __future__ import annotations

from typing import Any

import orjson

from gateway import anthropic_shape
from gateway.answer_io import sse
from gateway.answer_items import Append, Close, Event, Item, Items, Open
from shared import protocol
from shared.errors import KvgateError

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def tool_use_id(call_id: str) -> str:
    """Anthropic's spelling of a call id (`toolu_…`); the client hands it back as it got it."""
    return "toolu_" + call_id.removeprefix("call_")


class MessageRender:
    def __init__(self, message_id: str, model: str, items: Items):
        self.id, self.model, self.items = message_id, model, items
        self.usage = {"input_tokens": 0, "output_tokens": 0}  # the prompt is counted by the worker

    def spec(self) -> dict[str, Any]:
        """What rebuilds it at another gateway for a resumed stream (gateway/messages_api.py)."""
        return {"id": self.id, "model": self.model, "stops": self.items.stops}

    def _stop_reason(self) -> str | None:
        if self.items.stop_sequence is not None:
            return "stop_sequence"
        return STOP_REASONS.get(self.items.finish_reason or "", self.items.finish_reason)

    def result(self, content: bool = True) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [self._block(i) for i in self.items.items] if content else [],
                "stop_reason": self._stop_reason() if content else None,
                "stop_sequence": self.items.stop_sequence if content else None,
                "usage": dict(self.usage)}

    def _block(self, item: Item, done: bool = True) -> dict[str, Any]:
        if item.kind == "reasoning":
            return {"type": "thinking", "thinking": item.text if done else "", "signature": ""}
        if item.kind == "text":
            return {"type": "text", "text": item.text if done else ""}
        return {"type": "tool_use", "id": tool_use_id(item.call_id), "name": item.name,
                "input": _input(item.text) if done else {}}

    # -- the stream -----------------------------------------------------------------------------
    @staticmethod
    def _event(kind: str, **fields) -> bytes:
        return sse(kind, {"type": kind, **fields})

    def start(self) -> list[bytes]:
        return [self._event("message_start", message=self.result(content=False)), self.keepalive()]

    def keepalive(self) -> bytes:
        return self._event("ping")

    def delta(self, reply: protocol.Delta) -> list[bytes]:
        return [self._write(event) for event in self.items.feed(reply)]

    async def done(self, usage: dict) -> list[bytes]:
        self.usage = {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}
        delta = {"stop_reason": self._stop_reason(), "stop_sequence": self.items.stop_sequence}
        return [self._event("message_delta", delta=delta, usage=self.usage), self._event("message_stop")]

    def error(self, exc: KvgateError) -> list[bytes]:
        closing = [self._write(event) for event in self.items.close()]
        body = anthropic_shape.error_body(exc.status, exc.message)
        return [*closing, sse("error", body)]

    def _write(self, event: Event) -> bytes:
        item = event.item
        if isinstance(event, Open):
            return self._event("content_block_start", index=item.index,
                               content_block=self._block(item, done=False))
        if isinstance(event, Append):
            delta = ({"type": "thinking_delta", "thinking": event.piece} if item.kind == "reasoning"
                     else {"type": "text_delta", "text": event.piece} if item.kind == "text"
                     else {"type": "input_json_delta", "partial_json": event.piece})
            return self._event("content_block_delta", index=item.index, delta=delta)
        assert isinstance(event, Close)
        return self._event("content_block_stop", index=item.index)


def _input(arguments: str) -> dict:
    """A call's arguments as the object Anthropic's `input` is; arguments cut short by max_tokens
    (stop_reason max_tokens says so) are not an object: {} then."""
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
