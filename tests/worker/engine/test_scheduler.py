"""Scheduler policy without a model: budgets, chunking, admission order and preemption victims."""
import itertools
import random

from worker.engine.block_pool import BlockPool
from worker.engine.config import EngineConfig
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import Sequence, SequenceStatus
from worker.engine.types import SamplingParams


def make(num_blocks=32, block_size=4, budget=16, max_seqs=8) -> Scheduler:
    cfg = EngineConfig(model_dir="", block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=max_seqs)
    return Scheduler(cfg, BlockPool(num_blocks, block_size))


_fresh = itertools.count(10)  # distinct prompts: no accidental prefix hits


def add(sched: Scheduler, prompt_len: int, priority: int = 0, max_tokens: int = 100) -> Sequence:
    prompt = [next(_fresh) for _ in range(prompt_len)]
    seq = Sequence("r", 0, prompt, SamplingParams(priority=priority, max_tokens=max_tokens))
    sched.add(seq)
    return seq


def step(sched: Scheduler) -> dict[int, int]:
    """Schedule, then do what the engine does after the forward pass; {seq_id: tokens computed}."""
    batch = sched.schedule()
    for seq, n in batch:
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(1)
            if len(seq.output_ids) >= seq.params.max_tokens:
                sched.finish(seq, "length")
    return {seq.seq_id: n for seq, n in batch}


def test_prefill_chunks_and_decodes_share_a_step():
    sched = make(budget=16)
    a = add(sched, 3)
    assert step(sched) == {a.seq_id: 3}
    b = add(sched, 40)
    for _ in range(5):  # a prompt's chunk takes at most half the budget
        assert step(sched) == {a.seq_id: 1, b.seq_id: 8}
    assert step(sched) == {a.seq_id: 1, b.seq_id: 1}


def test_a_long_prefill_leaves_half_the_budget_to_waiting_prompts():
    sched = make(budget=16, num_blocks=64)
    long = add(sched, 100)
    step(sched)
    short = add(sched, 5)
    assert step(sched) == {long.seq_id: 8, short.seq_id: 5}


def test_waiting_is_served_by_priority_then_arrival():
    sched = make(max_seqs=1)
    seqs = [add(sched, 2, priority=p) for p in (1, 0, 1, 0)]
    order = []
    for _ in range(4):
        step(sched)
        order.append(sched.running[0].seq_id)
        sched.finish(sched.running[0], "stop")
    assert order == [seqs[1].seq_id, seqs[3].seq_id, seqs[0].seq_id, seqs[2].seq_id]


def test_preemption_takes_the_lowest_priority_then_newest_and_keeps_its_outputs():
    sched = make(num_blocks=6, block_size=4, budget=64)
    high = add(sched, 7, priority=0)
    low_old = add(sched, 3, priority=1)
    low_new = add(sched, 3, priority=1)
    step(sched)  # blocks: high 2, low_old 1, low_new 1
    for _ in range(2):
        step(sched)  # low_* fill their first block, high its second
    outputs_before = list(low_new.output_ids)
    while sched.num_preemptions == 0:
        step(sched)
    assert low_new.status == SequenceStatus.WAITING and low_new.num_computed_tokens == 0
    assert low_new.output_ids[:len(outputs_before)] == outputs_before
    assert high.status == low_old.status == SequenceStatus.RUNNING
    assert sched.waiting[0] is low_new


def test_budget_seq_cap_and_completion_under_random_load():
    rng = random.Random(7)
    sched = make(num_blocks=20, block_size=4, budget=12, max_seqs=5)
    seqs = [add(sched, rng.randint(1, 30), rng.randint(0, 2), rng.randint(1, 20)) for _ in range(30)]
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        before = {s.seq_id: (s.status, s.num_tokens - s.num_computed_tokens) for s in seqs}
        scheduled = step(sched)
        assert sum(scheduled.values()) <= 12 and len(sched.running) <= 5
        chunks = sum(n for sid, n in scheduled.items() if before[sid][1] > 1 and (  # a prompt going on,
            before[sid][0] == SequenceStatus.RUNNING or before[sid][1] > 6))  # or a long one starting
        assert chunks <= 6  # half the budget
        assert scheduled or sched.has_unfinished() is False
        assert sched.pool.num_free_blocks + sum(len(s.block_table) for s in sched.running) == 20
        for priority in range(3):  # long prompts (over half the budget) prefill one at a time
            assert sum(1 for s in sched.running if s.params.priority == priority
                       and s.num_tokens - s.num_computed_tokens > 6) <= 1
    assert all(s.is_finished and len(s.output_ids) == s.params.max_tokens for s in seqs)
    assert sched.pool.num_free_blocks == 20


def test_a_better_priority_prompt_is_prefilled_without_worse_priority_chunks():
    sched = make(budget=16, num_blocks=64)
    talk = add(sched, 3)  # an interactive stream, decoding
    step(sched)
    batch_line = add(sched, 40, priority=1000)
    assert step(sched) == {talk.seq_id: 1, batch_line.seq_id: 8}  # the batch line's prompt is under way
    prompt = add(sched, 6)  # a person's prompt arrives
    assert step(sched) == {talk.seq_id: 1, prompt.seq_id: 6}  # no batch chunk beside it
    assert step(sched) == {talk.seq_id: 1, prompt.seq_id: 1, batch_line.seq_id: 8}  # it goes on
    waiting_line = add(sched, 5, priority=1000)
    late = add(sched, 4)
    assert step(sched) == {talk.seq_id: 1, prompt.seq_id: 1, late.seq_id: 4}
    assert waiting_line.status == SequenceStatus.WAITING and batch_line.num_computed_tokens == 16


def test_a_worse_priority_prompt_goes_on_when_the_better_one_cannot_be_admitted():
    sched = make(budget=16, num_blocks=64, max_seqs=1)
    batch_line = add(sched, 40, priority=1000)
    step(sched)
    prompt = add(sched, 6)  # no sequence slot until the batch line is done: it must not stall
    assert step(sched) == {batch_line.seq_id: 8}  # the batch line goes on (a chunk: half the budget)
    while batch_line.status != SequenceStatus.FINISHED:
        step(sched)
    assert step(sched) == {prompt.seq_id: 6}


def test_priorities_never_leave_blocks_cached_before_their_kv_is_written():
    """Prompts left out of a step allocate nothing, so nothing they would write is offered to the
    prefix cache early; under random priorities every cached block belongs to a computed prefix."""
    rng = random.Random(7)
    sched = make(budget=24, num_blocks=80, block_size=4, max_seqs=6)
    for _ in range(200):
        if rng.random() < 0.3:
            add(sched, rng.randint(2, 30), priority=rng.choice([0, 1000]), max_tokens=rng.randint(1, 6))
        batch = sched.schedule()
        for seq, n in batch:
            seq.num_computed_tokens += n
        for seq in sched.running:
            registered = seq.num_registered_blocks * sched.pool.block_size
            assert registered <= seq.num_computed_tokens, "a cached block the step did not write"
        for seq, n in batch:
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(1)
                if len(seq.output_ids) >= seq.params.max_tokens:
                    sched.finish(seq, "length")


def test_a_waiting_order_hook_reorders_within_a_priority_but_never_across():
    """The worker's fair order reaches the waiting queue: within a priority the hook's rank wins
    over arrival; a better priority still goes first; unset, arrival order stays (in-process LLM)."""
    sched = make(budget=4, max_seqs=1)
    old = add(sched, 4)
    old.request_id = "heavy"
    new = add(sched, 4)
    new.request_id = "light"
    urgent = add(sched, 4, priority=-1)
    urgent.request_id = "heavy"
    sched.waiting_order = {"heavy": 100.0, "light": 1.0}.get
    assert list(step(sched)) == [urgent.seq_id]
    sched.finish(urgent, "length")
    assert list(step(sched)) == [new.seq_id]  # the less-served tenant before the older entry


def test_a_yielded_slot_goes_to_the_least_computed_sequence_of_the_tenant_and_runs_again():
    """`yield_slot`: the running sequence of the given requests with the least computed (the
    cheapest to recompute) yields; priority better than asked is never taken; the yielded one is
    held back for one schedule, so the newcomer takes the slot even when the yielded one ranks
    first, and then waits like any other."""
    sched = make(budget=64, max_seqs=3)
    long_a, short_a, urgent_a = add(sched, 12), add(sched, 4), add(sched, 2, priority=-1)
    for seq, rid in ((long_a, "a1"), (short_a, "a2"), (urgent_a, "a3")):
        seq.request_id = rid
    step(sched)  # the better priority's prompt alone (worse prompts wait out its prefill)
    step(sched)
    assert {s.seq_id for s in sched.running} == {long_a.seq_id, short_a.seq_id, urgent_a.seq_id}
    assert not sched.yield_slot({"a3"}, priority=0)  # only a better priority than asked: kept
    assert not sched.yield_slot({"zz"}, priority=0)  # none of these runs
    assert sched.yield_slot({"a1", "a2", "a3"}, priority=0)
    assert short_a.status == SequenceStatus.WAITING and short_a.num_computed_tokens == 0
    assert sched.yielded == {short_a.seq_id} and sched.num_fair_preemptions == sched.num_preemptions == 1
    newcomer = add(sched, 3)
    newcomer.request_id = "b1"
    sched.waiting_order = {"a1": 1.0, "a2": 1.0, "b1": 50.0}.get  # a2 ranks first...
    assert newcomer.seq_id in step(sched)  # ...yet the slot went to the newcomer
    assert short_a.status == SequenceStatus.WAITING and not sched.yielded
    assert short_a.seq_id not in step(sched)  # no free slot: it waits
    sched.finish(long_a, "length")
    step(sched)
    assert short_a.status == SequenceStatus.RUNNING


def test_a_prompt_waits_for_the_blocks_another_is_prefilling_and_those_behind_it_go_on():
    """Two prompts with the same 60 tokens (block 4, budget 24): the second arrives while the first
    is mid-prefill. It waits until the first has written every block it can reuse, then computes
    only its last block; a short prompt behind it is admitted meanwhile."""
    sched = make(num_blocks=64, block_size=4, budget=24)
    shared = [next(_fresh) for _ in range(60)]
    first = Sequence("r1", 0, shared, SamplingParams(max_tokens=4))
    sched.add(first)
    assert step(sched) == {first.seq_id: 12}
    second = Sequence("r2", 0, list(shared), SamplingParams(max_tokens=4))
    sched.add(second)
    short = add(sched, 6)
    assert step(sched) == {first.seq_id: 12, short.seq_id: 6}  # the second waits, the short goes on
    while second.status == SequenceStatus.WAITING:
        assert first.num_computed_tokens < 60  # it waits only while the first is prefilling
        computed = step(sched)
    assert computed[second.seq_id] == 4  # admitted as the first writes its last blocks: 56 from the cache
    assert second.num_computed_tokens == 60


def test_a_prompt_that_shares_nothing_in_prefill_is_not_held():
    sched = make(num_blocks=64, block_size=4, budget=24)
    first = add(sched, 60)
    step(sched)
    other = add(sched, 10)
    assert step(sched) == {first.seq_id: 12, other.seq_id: 10}  # admitted at once, beside the first's chunk


def test_a_short_prompt_behind_a_burst_of_long_ones_starts_at_once():
    """Three long prompts (over half the budget each) then a short one: the longs are prefilled one
    at a time, so the short starts in the next step instead of after their prefills (with all three
    admitted in turn, their chunks took the whole budget until the first had finished)."""
    sched = make(num_blocks=256, budget=16)
    longs = [add(sched, 40) for _ in range(3)]
    assert step(sched) == {longs[0].seq_id: 8}  # the first alone, half the budget
    short = add(sched, 5)
    assert step(sched) == {longs[0].seq_id: 8, short.seq_id: 5}
    assert all(s.status == SequenceStatus.WAITING for s in longs[1:])


def test_long_prompts_keep_their_order_and_half_the_budget():
    sched = make(num_blocks=256, budget=16)
    longs = [add(sched, 40) for _ in range(3)]
    started = []
    while any(not s.output_ids for s in longs):
        scheduled = step(sched)
        prefilling = [s for s in longs if s.seq_id in scheduled and scheduled[s.seq_id] > 1]
        assert len(prefilling) <= 2  # one mid-prefill, and the next only where the first ends
        chunks = sum(scheduled[s.seq_id] for s in prefilling)
        assert chunks == 8 or (chunks < 8 and not any(s.status == SequenceStatus.WAITING for s in longs))
        started += [s.seq_id for s in longs if s.output_ids and s.seq_id not in started]
    assert started == [s.seq_id for s in longs]


def test_the_next_long_prompt_starts_in_the_step_where_the_one_before_finishes_its_prefill():
    sched = make(num_blocks=256, budget=16)
    first, second = add(sched, 20), add(sched, 40)
    assert step(sched) == {first.seq_id: 8}
    assert step(sched) == {first.seq_id: 8}
    assert step(sched) == {first.seq_id: 4, second.seq_id: 4}  # none of the chunks' half left idle


def test_a_long_prompt_starting_beside_a_finishing_one_leaves_the_short_prompt_its_half():
    sched = make(num_blocks=256, budget=16)
    first, second = add(sched, 16), add(sched, 40)
    assert step(sched) == {first.seq_id: 8}
    short = add(sched, 5)  # behind the second in arrival order
    assert step(sched) == {first.seq_id: 8, short.seq_id: 5}  # the chunks' half went to the first


def test_a_better_priority_long_prompt_is_not_held_by_a_worse_one_in_prefill():
    sched = make(num_blocks=256, budget=16)
    batch_line = add(sched, 60, priority=1000)
    step(sched)
    urgent = add(sched, 40, priority=0)
    assert step(sched) == {urgent.seq_id: 8}  # and the batch line's chunk is left out

