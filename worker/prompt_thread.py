"""Long prompts made off the serving loop. Rendering a chat and tokenizing it is work in proportion
to what the client sent: a 900k-character prompt takes the demo tokenizer ~0.45 s, and on the loop
that is 0.45 s in which no running request gets a token (one key sending such prompts back to back
took a running stream from 2 ms a token to 440). Here it runs in a thread of its own, where
transformers' fast tokenizer releases the GIL while it encodes, and the loop admits the entry once
its prompt is made. Short prompts are still made on the loop (a thread's hop would cost them more
than the tokenizing). At most AHEAD wait here, so one tenant's long prompts hold back another
tenant's by at most that many (the consumer hands entries out in the fair order)."""
from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from worker.admission import Waiting

AHEAD = 2


class PromptThread:
    def __init__(self):
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="kvgate-prompt")
        self.waiting: list[tuple[Waiting, Future]] = []

    def __len__(self) -> int:
        return len(self.waiting)

    def full(self) -> bool:
        return len(self.waiting) >= AHEAD

    def submit(self, waiting: Waiting) -> None:
        self.waiting.append((waiting, self.pool.submit(waiting.work)))

    def made(self) -> tuple[Waiting, Future] | None:
        """The oldest one, once made (or failed: `future.result` raises what making it raised)."""
        if self.waiting and self.waiting[0][1].done():
            return self.waiting.pop(0)
        return None

    def wait(self, timeout_s: float) -> None:
        """Until the first one is made, or `timeout_s` (the loop has nothing else to do)."""
        if self.waiting:
            wait([self.waiting[0][1]], timeout_s, return_when=FIRST_COMPLETED)

    def entry_ids(self) -> set[bytes]:
        return {w.pending.entry_id for w, _ in self.waiting}

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
