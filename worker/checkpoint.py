"""The checkpoint of a request is the log of the replies its worker published (a Redis list with a
TTL, appended in the same pipeline as each PUBLISH). A worker that takes an orphaned request over
folds it to learn where to resume; a gateway that saw a sequence gap replays the missing replies.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import redis

from shared import names, protocol

TTL_S = 600  # while the request runs; refreshed every step
DONE_TTL_S = 60  # after the request ended: long enough for a gateway to fill a last gap


@dataclass
class Checkpoint:
    last_seq: int = 0
    tokens: dict[int, list[int]] = field(default_factory=dict)  # choice index → emitted token ids
    text: dict[int, str] = field(default_factory=dict)  # choice index → released text
    finished: dict[int, str] = field(default_factory=dict)  # choice index → finish reason
    done: bool = False

    @property
    def empty(self) -> bool:
        return self.last_seq == 0

    def fold(self, reply: protocol.Delta | protocol.Done | protocol.ErrorReply) -> None:
        if reply.seq <= self.last_seq:  # a pipeline retried after a dropped connection
            return
        self.last_seq = reply.seq
        if isinstance(reply, protocol.Delta):
            self.tokens.setdefault(reply.index, []).extend(reply.token_ids)
            self.text[reply.index] = self.text.get(reply.index, "") + reply.text
            if reply.finish_reason:
                self.finished[reply.index] = reply.finish_reason
        else:
            self.done = True


def load(client: redis.Redis, request_id: str) -> Checkpoint:
    ckpt = Checkpoint()
    for raw in client.lrange(names.checkpoint_key(request_id), 0, -1):
        ckpt.fold(protocol.decode_reply(raw))
    return ckpt
