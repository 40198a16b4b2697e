"""A request's replies that its client has not read yet, counted, so a client that stops reading
costs the gateway a bounded amount of memory.

Replies arrive as fast as the worker makes them, whether or not the client reads its stream: the
response waits on the socket, and the replies wait here. Unbounded, four never-read streams of 16
choices × 2,000 tokens with logprobs held 200 MB of one gateway; at a 32k context one such stream
holds ~800 MB. So a request may leave `per_request` replies unread, and all of a gateway's requests
together `in_all`; beyond either, the request with the most unread (the one just over, or the
worst of all) has its replies dropped and ends with `client_not_reading`, and its worker is told
to stop. A client that reads at all keeps its queue near empty: the socket's buffers take bursts.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from shared.errors import ClientNotReading


@dataclass
class Unread:
    """Replies waiting in every queue of one dispatcher, and the bounds on them."""

    per_request: int
    in_all: int
    count: int = 0

    def over(self, queue: ReplyQueue) -> bool:
        return queue.qsize() > self.per_request or self.count > self.in_all


class ReplyQueue(asyncio.Queue):
    """asyncio's queue, counting what it holds into the dispatcher's `Unread` (its `_put`/`_get`
    are the hooks asyncio's own Lifo- and PriorityQueue override)."""

    def __init__(self, unread: Unread | None = None):
        super().__init__()
        self._unread = unread

    def _put(self, item) -> None:
        super()._put(item)
        if self._unread is not None:
            self._unread.count += 1

    def _get(self):
        if self._unread is not None:
            self._unread.count -= 1
        return super()._get()

    def detach(self) -> None:
        """The request is let go: what it left unread is no longer counted (nor what comes)."""
        if self._unread is not None:
            self._unread.count -= self.qsize()
            self._unread = None

    def overrun(self, per_request: int, in_all: int) -> None:
        """Drops the unread replies; the request ends with the error, whenever its client reads."""
        self.detach()
        dropped = self.qsize()
        while not self.empty():
            self.get_nowait()
        self.put_nowait(ClientNotReading(
            f"The stream was ended: its client left {dropped} replies unread, beyond what the "
            f"gateway keeps for a client that is not reading ({per_request} a request, "
            f"KVGATE_MAX_UNREAD_REPLIES; {in_all} in all, KVGATE_MAX_UNREAD_REPLIES_TOTAL); read "
            "the stream as it comes, or ask for fewer choices or logprobs"))
