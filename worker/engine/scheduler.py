"""Which sequences run this step, and how many of their tokens.

The v1 model: there is no prefill phase and no decode phase. Each sequence has num_computed_tokens
and a target (all its tokens); each step hands out a token budget, running sequences first (one
decode token each, then the next chunk of any unfinished prefill), then waiting ones by priority
and arrival (or, when the worker sets `waiting_order`, by priority, that order, then arrival),
their prompts cut into chunks that fit the budget, so prefill and decode share a step.
A prompt whose next uncached prefix block another prompt is prefilling waits until that one has
written it (fork branches sent together share their prefix's KV instead of each computing it).
Long prompts (more uncomputed tokens than half the budget) are prefilled one at a time within a
priority: while one is mid-prefill, a waiting long prompt is passed over and the short prompts
behind it are admitted (vLLM's `max_long_partial_prefills` of 1); and prompt chunks together take
at most half of every step's budget (`max_chunk_tokens`, as vLLM's `long_prefill_token_threshold`
caps a long prompt's chunk). So no step that prefills a long prompt is longer than about half a
full one: a short prompt arriving behind a burst of long ones waits for at most that step in
progress and starts in the next, and streams already running get their next token as often. The
price is a long prompt's prefill alone in more, shorter steps (a larger step budget makes the
chunks larger); the long prompts keep their order among themselves.
Prompts are prefilled strictly by priority: a step that prefills some prompt leaves out the chunks
of worse-priority prompts (batch lines), so they never lengthen the step that produces a better
prompt's first token; their decodes, one token each, still run. When blocks run out, the
lowest-priority, newest unscheduled running sequence is preempted by recompute: it frees its blocks
and waits again with everything it generated as its prompt-so-far. The worker's fair order may also
ask a tenant's sequence to yield its slot (`yield_slot`, the same preemption by recompute) to a
tenant below its share: until the next step is scheduled the yielded sequence is held back and does
not count against the engine's room, so the entry it yielded to is admitted and takes the slot
(rather than the yielded one taking it back, its tenant's counter being the lower after the
newcomer's prompt is charged); from then on it waits like any other.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable, Collection

from worker.engine.block_pool import BlockPool
from worker.engine.config import EngineConfig
from worker.engine.sequence import Sequence, SequenceStatus

ScheduledBatch = list[tuple[Sequence, int]]  # (sequence, number of its tokens computed this step)


class Scheduler:
    def __init__(self, config: EngineConfig, pool: BlockPool):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_chunk_tokens = max(1, config.max_num_batched_tokens // 2)  # prompt chunks, per step
        self.pool = pool
        self.waiting: list[Sequence] = []  # by priority_key (or priority, waiting_order, arrival)
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_fair_preemptions = 0  # of those, slots yielded to the fair order (yield_slot)
        self.yielded: set[int] = set()  # seq ids of sequences held back until the next schedule
        # request id -> a rank within a priority (the worker's per-tenant token counters, so the
        # waiting queue keeps the worker's fair order); None: arrival order, as an in-process LLM has
        self.waiting_order: Callable[[str], float] | None = None

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.priority_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        plan = _Plan(self.max_num_batched_tokens, self.max_chunk_tokens)
        self._order_waiting()
        preemptions = self.num_preemptions
        # Decodes first, so a long prompt never stalls the streams already running; then prompt
        # chunks by priority, waiting prompts that outrank a running chunk admitted before it.
        decodes = sorted((s for s in self.running if _remaining(s) == 1), key=lambda s: s.priority_key)
        chunks = sorted((s for s in self.running if _remaining(s) > 1), key=lambda s: s.priority_key)
        for seq in decodes + chunks:
            if plan.budget == 0:
                break
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            chunk = _remaining(seq) > 1
            if chunk:
                if self.num_preemptions == preemptions:
                    self._admit(plan, outranking=seq.params.priority)
                if plan.outranks(seq):
                    break  # chunks are sorted: the rest are outranked too
            num_new = min(_remaining(seq), plan.budget, plan.chunk_room if chunk else 1)
            if num_new and self._allocate_or_preempt(seq, num_new, plan.batch):
                plan.add(seq, num_new)
                plan.chunk_room -= num_new if chunk else 0
        if self.num_preemptions == preemptions:  # admitting while evicting would only thrash
            self._admit(plan)
        self.yielded.clear()  # the slots went to the entries they were yielded to
        return plan.batch

    def _order_waiting(self) -> None:
        """Re-rank the waiting queue by `waiting_order` (its ranks move between steps); priority
        stays first, so `add`'s insertion by priority still lands in the right band."""
        if self.waiting_order is not None and len(self.waiting) > 1:
            order = self.waiting_order
            self.waiting.sort(key=lambda s: (s.params.priority, order(s.request_id), s.seq_id))

    def _is_long(self, uncomputed: int) -> bool:
        """More than one chunk's worth: it would be prefilled over several steps."""
        return uncomputed > self.max_chunk_tokens

    def _long_in_prefill(self, priority: int, plan: _Plan) -> bool:
        """A long prompt of this priority or a better one is mid-prefill beyond this step's chunk
        (one that finishes its prefill in this step lets the next long prompt start in it)."""
        scheduled = {s.seq_id: n for s, n in plan.batch}
        return any(s.params.priority <= priority and self._is_long(_remaining(s) - scheduled.get(s.seq_id, 0))
                   for s in self.running)

    def _allocate_or_preempt(self, seq: Sequence, num_new: int, batch: ScheduledBatch) -> bool:
        scheduled = {s.seq_id for s, _ in batch}
        while not self.pool.allocate(seq, num_new):
            victim = max((s for s in self.running if s.seq_id not in scheduled), key=lambda s: s.priority_key)
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _admit(self, plan: _Plan, outranking: int | None = None) -> None:
        """Admit waiting prompts in order (only those of a better priority than `outranking`, when
        given) while budget, sequence slots and blocks last. A prompt whose next uncached block a
        running prompt is still prefilling waits for it (it would compute the same blocks again,
        chasing the other chunk by chunk) and the prompts behind it go on; one that yielded its
        slot this step waits too, and so does a long prompt while another long one is mid-prefill."""
        skipped, prefilling = set(self.yielded), None
        while self.waiting and plan.budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0] if not skipped else next(
                (s for s in self.waiting if s.seq_id not in skipped), None)
            if seq is None or (outranking is not None and seq.params.priority >= outranking) or plan.outranks(seq):
                break
            hits = self.pool.match_prefix(seq)[:seq.cacheable_tokens() // self.pool.block_size]
            if prefilling is None:
                prefilling = self._blocks_in_prefill()
            if prefilling and self._behind(seq, len(hits), prefilling):
                skipped.add(seq.seq_id)
                continue
            num_cached = len(hits) * self.pool.block_size
            long = self._is_long(seq.num_tokens - num_cached)
            # a long prompt's first chunk counts against the chunks' room, as its later ones will
            num_new = min(seq.num_tokens - num_cached, plan.budget, plan.chunk_room if long else plan.budget)
            if long and (num_new == 0 or self._long_in_prefill(seq.params.priority, plan)):
                skipped.add(seq.seq_id)
                continue
            if not self.pool.allocate(seq, num_new, hits):
                break
            self.pool.record_lookup(seq.num_tokens, num_cached)
            seq.num_computed_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self.waiting.remove(seq)
            self.running.append(seq)
            plan.add(seq, num_new)
            plan.chunk_room -= num_new if long else 0
            if self.pool.enable_caching:  # what it writes in later steps, the next prompts may wait for
                prefilling.update(seq.block_hashes[seq.num_registered_blocks:])

    def _blocks_in_prefill(self) -> set[bytes]:
        """Hashes of the full prompt blocks running prompts will write in later steps (those of
        this step are registered, and so already hit)."""
        if not self.pool.enable_caching:
            return set()
        return {h for s in self.running if _remaining(s) > 1
                for h in s.block_hashes[s.num_registered_blocks:]}

    def _behind(self, seq: Sequence, num_hits: int, prefilling: set[bytes]) -> bool:
        """Whether `seq`'s first uncached block (one it may take from the cache) is being prefilled."""
        if num_hits >= min((seq.num_tokens - 1) // self.pool.block_size,
                           seq.cacheable_tokens() // self.pool.block_size):
            return False
        return seq.block_hashes[num_hits] in prefilling

    def yield_slot(self, request_ids: Collection[str], priority: int) -> bool:
        """Preempt (by recompute) one running sequence of `request_ids` whose priority is no better
        than `priority`: the one with the least computed (the cheapest to recompute), the newest on
        a tie. False: none of them runs."""
        candidates = [s for s in self.running if s.request_id in request_ids and s.params.priority >= priority]
        if not candidates:
            return False
        victim = min(candidates, key=lambda s: (s.num_computed_tokens, -s.seq_id))
        self._preempt(victim)
        self.num_fair_preemptions += 1
        self.yielded.add(victim.seq_id)
        return True

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
        self.yielded.discard(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason


class _Plan:
    """One step's batch as it is built, its budget left, and the priority whose prompts it prefills.

    Prompts are visited best priority first, so the first one scheduled sets that priority; a
    worse one is then left out before any block is allocated for it (a block is offered to the
    prefix cache only when its KV is written in the same step)."""

    def __init__(self, budget: int, chunk_room: int):
        self.budget = budget
        self.chunk_room = chunk_room  # what running prompts' chunks and long prompts' first ones may take
        self.batch: ScheduledBatch = []
        self.prefill_priority: int | None = None

    def outranks(self, seq: Sequence) -> bool:
        return self.prefill_priority is not None and seq.params.priority > self.prefill_priority

    def add(self, seq: Sequence, num_new: int) -> None:
        if seq.num_tokens - seq.num_computed_tokens > 1 and self.prefill_priority is None:
            self.prefill_priority = seq.params.priority
        self.batch.append((seq, num_new))
        self.budget -= num_new


def _remaining(seq: Sequence) -> int:
    return seq.num_tokens - seq.num_computed_tokens
