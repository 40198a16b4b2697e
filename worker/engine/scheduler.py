"""Which sequences run this step, and how many of their tokens.

The v1 model: there is no prefill phase and no decode phase. Each sequence has num_computed_tokens
and a target (all its tokens); each step hands out a token budget, running sequences first (one
decode token each, then the next chunk of any unfinished prefill), then waiting ones by priority
and arrival, their prompts cut into chunks that fit the budget, so prefill and decode share a step.
When blocks run out, the lowest-priority, newest unscheduled running sequence is preempted by
recompute: it frees its blocks and waits again with everything it generated as its prompt-so-far.
"""
from __future__ import annotations

import bisect

from worker.engine.block_pool import BlockPool
from worker.engine.config import EngineConfig
from worker.engine.sequence import Sequence, SequenceStatus

ScheduledBatch = list[tuple[Sequence, int]]  # (sequence, number of its tokens computed this step)


class Scheduler:
    def __init__(self, config: EngineConfig, pool: BlockPool):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.pool = pool
        self.waiting: list[Sequence] = []  # kept sorted by priority_key
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.priority_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        batch: ScheduledBatch = []
        preemptions = self.num_preemptions
        # Decodes before prefill chunks, so a long prompt never stalls the streams already running.
        for seq in sorted(self.running, key=lambda s: (_remaining(s) > 1, s.priority_key)):
            if budget == 0:
                break
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(_remaining(seq), budget, self._chunk_cap())
            if self._allocate_or_preempt(seq, num_new, batch):
                batch.append((seq, num_new))
                budget -= num_new
        if self.num_preemptions == preemptions:  # admitting while evicting would only thrash
            self._admit(batch, budget)
        return batch

    def _chunk_cap(self) -> int:
        """A long prefill leaves half the budget to waiting prompts, so it never starves short ones."""
        return self.max_num_batched_tokens // 2 if self.waiting else self.max_num_batched_tokens

    def _allocate_or_preempt(self, seq: Sequence, num_new: int, batch: ScheduledBatch) -> bool:
        scheduled = {s.seq_id for s, _ in batch}
        while not self.pool.allocate(seq, num_new):
            victim = max((s for s in self.running if s.seq_id not in scheduled), key=lambda s: s.priority_key)
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = self.pool.match_prefix(seq)
            num_cached = len(hits) * self.pool.block_size
            num_new = min(seq.num_tokens - num_cached, budget)
            if not self.pool.allocate(seq, num_new, hits):
                break
            self.pool.record_lookup(seq.num_tokens, num_cached)
            seq.num_computed_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(self.waiting.pop(0))
            batch.append((seq, num_new))
            budget -= num_new

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: the outputs so far stay and are re-prefilled as part of the prompt."""
        self.running.remove(seq)
        self.pool.free(seq)
        seq.num_computed_tokens = 0
        self.num_preemptions += 1
        self.add(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Done (or aborted): leave whichever queue it is in and give its blocks back."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.pool.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason


def _remaining(seq: Sequence) -> int:
    return seq.num_tokens - seq.num_computed_tokens
