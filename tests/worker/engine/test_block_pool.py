"""Block pool invariants under random allocate / prefix-hit / decode / free / abort sequences."""
import tracemalloc

from hypothesis import given, settings
from hypothesis import strategies as st

from worker.engine.block_pool import BlockPool
from worker.engine.sequence import Sequence
from worker.engine.types import SamplingParams

BS = 2


class Sim:
    """Drives a pool the way the scheduler does, with a fake KV cache holding each slot's prefix, so a
    prefix hit that served the wrong content would show up as a mismatch."""

    def __init__(self, num_blocks: int, caching: bool = True):
        self.pool = BlockPool(num_blocks, BS, caching)
        self.kv = [None] * (num_blocks * BS)
        self.live: list[Sequence] = []

    def admit(self, tokens: list[int], salt: str | None) -> None:
        seq = Sequence("r", 0, tokens, SamplingParams(cache_salt=salt))
        hits = self.pool.match_prefix(seq)
        assert len(hits) * BS < seq.num_tokens  # never the last token
        num_new = seq.num_tokens - len(hits) * BS
        if self.pool.allocate(seq, num_new, hits):
            seq.num_computed_tokens = len(hits) * BS
            self.check_content(seq, seq.num_computed_tokens)
            self.compute(seq, num_new)
            self.live.append(seq)

    def decode(self, i: int, token: int) -> None:
        seq = self.live[i % len(self.live)]
        seq.append_token(token)
        if self.pool.allocate(seq, 1):
            self.compute(seq, 1)
        else:
            self.end(i)  # preempted: recompute later means freeing now

    def compute(self, seq: Sequence, n: int) -> None:
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            self.kv[seq.block_table[pos // BS] * BS + pos % BS] = self.content(seq, pos)
        seq.num_computed_tokens += n

    def check_content(self, seq: Sequence, upto: int) -> None:
        for pos in range(upto):
            slot = seq.block_table[pos // BS] * BS + pos % BS
            assert self.kv[slot] == self.content(seq, pos)

    @staticmethod
    def content(seq: Sequence, pos: int) -> tuple:
        """A real K/V entry depends on the token, everything before it, and (by design) the salt."""
        return seq.params.cache_salt, tuple(seq.tokens(0, pos + 1))

    def end(self, i: int) -> None:
        seq = self.live.pop(i % len(self.live))
        self.pool.free(seq)

    def check(self) -> None:
        pool = self.pool
        refs = [0] * pool.num_blocks
        for seq in self.live:
            for b in seq.block_table:
                refs[b] += 1
            self.check_content(seq, seq.num_computed_tokens)
        assert list(pool.ref_cnts) == refs  # never negative, exactly the users
        free = list(pool.free_queue)
        assert len(free) == len(set(free)) == pool.num_free_blocks  # each free block once
        assert set(free) == {b for b, r in enumerate(refs) if r == 0}  # free xor in use
        assert {b: h for h, b in pool.cached.items()} == pool.block_hash  # a hash iff cached


ops = st.lists(st.one_of(
    st.tuples(st.just("admit"), st.lists(st.integers(0, 1), min_size=1, max_size=9), st.sampled_from([None, "t1"])),
    st.tuples(st.just("decode"), st.integers(0, 50), st.integers(0, 1)),
    st.tuples(st.just("end"), st.integers(0, 50), st.none()),
    st.tuples(st.just("forget"), st.none(), st.none()),  # after a failed engine step
), min_size=10, max_size=80)


@settings(max_examples=300, deadline=None)
@given(ops=ops, num_blocks=st.integers(5, 10), caching=st.booleans())
def test_invariants_hold_and_everything_returns(ops, num_blocks, caching):
    sim = Sim(num_blocks, caching)
    for kind, a, b in ops:
        if kind == "admit":
            sim.admit(a, b)
        elif kind == "forget":
            sim.pool.forget_cached()
        elif sim.live:
            sim.decode(a, b) if kind == "decode" else sim.end(a)
        sim.check()
    while sim.live:
        sim.end(0)
    sim.check()
    assert sim.pool.num_free_blocks == num_blocks  # every block free, or cached and evictable


def test_hits_share_blocks_and_cached_blocks_survive_until_evicted():
    sim = Sim(8)
    sim.admit([1, 2, 3, 4, 5], None)
    sim.admit([1, 2, 3, 4, 6], None)
    first, second = (list(s.block_table) for s in sim.live)
    assert second[:2] == first[:2]
    assert sim.pool.ref_cnts[first[0]] == 2
    sim.end(0), sim.end(0)
    sim.admit([1, 2, 3, 4, 7], None)  # freed but still cached
    assert sim.live[0].block_table[:2] == first[:2]
    sim.admit([1, 2, 3, 4, 7], "other-tenant")  # a salt never sees another tenant's blocks
    assert set(sim.live[1].block_table).isdisjoint(sim.live[0].block_table)


def test_hit_never_covers_the_last_token():
    sim = Sim(8)
    sim.admit([1, 2, 3, 4], None)
    sim.admit([1, 2, 3, 4], None)
    assert sim.live[1].num_computed_tokens == 4  # 2 computed here, the second block recomputed
    assert sim.live[1].block_table[0] == sim.live[0].block_table[0]
    assert sim.live[1].block_table[1] != sim.live[0].block_table[1]


def test_tail_blocks_are_evicted_first():
    pool = BlockPool(4, BS)
    seq = Sequence("r", 0, [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams())
    assert pool.allocate(seq, 8)
    table = list(seq.block_table)
    pool.free(seq)
    assert list(pool.free_queue) == table[::-1]


def test_forgetting_the_cache_keeps_users_and_serves_no_more_hits():
    """After a failed step the cache may hold a half-written block: every hash goes, users keep
    their blocks, and unhashed free blocks are the first to be reused."""
    sim = Sim(8)
    sim.admit([1, 2, 3, 4, 5], None)
    sim.admit([6, 7, 8], None)
    sim.end(1)
    in_use = list(sim.live[0].block_table)
    sim.pool.forget_cached()
    sim.check()
    assert not sim.pool.cached and sim.pool.ref_cnts[in_use[0]] == 1
    assert set(list(sim.pool.free_queue)[:2]) == {3, 4}  # the freed sequence's, hashed or not
    sim.admit([1, 2, 3, 4, 9], None)
    assert set(sim.live[1].block_table).isdisjoint(in_use), "no hit after the cache was forgotten"


def test_a_pool_of_millions_of_blocks_is_one_small_array():
    """A GPU-sized pool of a small model has millions of blocks: no Python object per block."""
    tracemalloc.start()
    try:
        pool = BlockPool(10_000_000, 16)
        built, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert built < 48 << 20  # 4 bytes of ref count per block (a Block object each was ~250)
    seq = Sequence("r", 0, list(range(40)), SamplingParams())
    assert pool.allocate(seq, 40) and seq.block_table == [0, 1, 2]  # never-used blocks, in order
    pool.free(seq)
    assert pool.num_free_blocks == 10_000_000 and next(iter(pool.free_queue)) == 2  # unhashed first
    again = Sequence("r", 0, list(range(33)), SamplingParams())
    assert pool.match_prefix(again) == [0, 1]  # the full blocks stay cached
