"""KV blocks: ref counts, an LRU free queue and a hash -> block map for prefix caching (vLLM v1 style).

Invariants (tests/worker/engine/test_block_pool.py checks them):
- a block is in the free queue exactly when its ref count is 0; ref counts never go negative;
- only full blocks are hashed, each hash chained on its parent's, so one hit implies the whole prefix;
- a prefix hit never covers a sequence's last token, so every scheduled sequence computes >= 1 token;
- a freed block keeps its hash and stays reusable until evicted (popped from the free queue's head
  for reuse); a sequence frees tail-first, so its tail is evicted before its head; blocks with no
  hash go to the head, since nothing can ever hit them;
- a block has a hash exactly when the cache maps that hash to it, and only blocks in use gain one.

A GPU-sized pool of a small model holds millions of blocks, so nothing here is per-block Python
objects: ref counts are one C array, hashes live only for cached blocks, and blocks never used are a
range in the free queue. Building a pool of 10 million blocks costs one 40 MB array.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterator

from worker.engine.kv_budget import cdiv
from worker.engine.sequence import Sequence


def hash_block(parent: bytes | None, token_ids: list[int], extra_key: str | None) -> bytes:
    """sha256 rather than hash(): a collision would silently serve another prompt's KV."""
    h = hashlib.sha256(parent or b"\0" * 32)
    h.update(array("q", token_ids).tobytes())
    if extra_key is not None:
        h.update(extra_key.encode())
    return h.digest()


class FreeQueue:
    """Free blocks in eviction order: freed blocks without a hash (last freed first: any will do),
    then blocks never used (a range), then hashed blocks in the order they were freed (LRU).

    A free block never gains a hash, so the first two parts stay unhashed and only the last one
    ever loses a member to a prefix hit.
    """

    def __init__(self, num_blocks: int):
        self._unhashed: list[int] = []  # a stack: its end is the queue's head
        self._next_fresh = 0  # blocks [next_fresh, num_blocks) were never used
        self._num_blocks = num_blocks
        self._hashed: OrderedDict[int, None] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._unhashed) + self._num_blocks - self._next_fresh + len(self._hashed)

    def __iter__(self) -> Iterator[int]:
        """Head to tail (tests and debugging: it walks every free block)."""
        yield from reversed(self._unhashed)
        yield from range(self._next_fresh, self._num_blocks)
        yield from self._hashed

    def push_unhashed(self, block_id: int) -> None:
        self._unhashed.append(block_id)

    def push_hashed(self, block_id: int) -> None:
        self._hashed[block_id] = None

    def remove_hashed(self, block_id: int) -> None:
        del self._hashed[block_id]

    def pop(self) -> int:
        if self._unhashed:
            return self._unhashed.pop()
        if self._next_fresh < self._num_blocks:
            self._next_fresh += 1
            return self._next_fresh - 1
        return self._hashed.popitem(last=False)[0]


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.ref_cnts = array("i", [0]) * num_blocks
        self.free_queue = FreeQueue(num_blocks)
        self.cached: dict[bytes, int] = {}  # hash -> block holding that prefix's KV
        self.block_hash: dict[int, bytes] = {}  # the reverse, for exactly the same blocks
        self.num_queries = 0  # tokens looked up in the prefix cache
        self.num_hits = 0  # of which found

    @property
    def num_free_blocks(self) -> int:
        """Free includes cached blocks nobody uses: they are evictable on demand."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def hash_blocks(self, seq: Sequence) -> None:
        """Extend seq.block_hashes over every full block of its tokens."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_tokens // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(hash_block(parent, seq.tokens(i * bs, (i + 1) * bs), seq.params.cache_salt))

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Blocks of the longest cached prefix of `seq`, never covering its last token."""
        if not self.enable_caching:
            return []
        self.hash_blocks(seq)
        hits = []
        for block_hash in seq.block_hashes[:(seq.num_tokens - 1) // self.block_size]:
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_caching:
            self.num_queries += num_tokens
            self.num_hits += num_hit_tokens

    def allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int] = ()) -> bool:
        """Attach `hits`, then blocks for num_new_tokens more tokens; all or nothing."""
        num_tokens = seq.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        need = max(self.blocks_for(num_tokens) - len(seq.block_table) - len(hits), 0)
        revived = sum(1 for b in hits if self.ref_cnts[b] == 0)  # hits that leave the free queue
        if need + revived > len(self.free_queue):
            return False
        for block_id in hits:
            self._ref(block_id)
        seq.block_table.extend(hits)
        seq.block_table.extend(self._pop_free() for _ in range(need))
        self._register(seq, num_tokens // self.block_size)
        return True

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks tail-first; cached ones stay findable until evicted."""
        for block_id in reversed(seq.block_table):
            self.ref_cnts[block_id] -= 1
            assert self.ref_cnts[block_id] >= 0, f"block {block_id} freed twice"
            if self.ref_cnts[block_id] == 0:
                if block_id in self.block_hash:
                    self.free_queue.push_hashed(block_id)
                else:
                    self.free_queue.push_unhashed(block_id)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def forget_cached(self) -> None:
        """Drop every prefix-cache entry (after a step that failed midway may have left a registered
        block's KV half-written). Blocks in use stay with their sequences, just no longer shared;
        free ones lose their hash and go to the free queue's head, like any block with none."""
        for block_id in self.cached.values():
            if self.ref_cnts[block_id] == 0:
                self.free_queue.remove_hashed(block_id)
                self.free_queue.push_unhashed(block_id)
        self.cached.clear()
        self.block_hash.clear()

    def _register(self, seq: Sequence, num_full_blocks: int) -> None:
        """Offer blocks that will be full after this step to the cache (their KV is written this step,
        before any attention reads it, so a sequence scheduled in the same step may already hit them)."""
        if not self.enable_caching or num_full_blocks <= seq.num_registered_blocks:
            return
        self.hash_blocks(seq)
        for i in range(seq.num_registered_blocks, num_full_blocks):
            block_id, block_hash = seq.block_table[i], seq.block_hashes[i]
            if block_id not in self.block_hash and block_hash not in self.cached:
                self.block_hash[block_id] = block_hash
                self.cached[block_hash] = block_id
        seq.num_registered_blocks = num_full_blocks

    def _ref(self, block_id: int) -> None:
        if self.ref_cnts[block_id] == 0:
            self.free_queue.remove_hashed(block_id)  # a hit is always a hashed block
        self.ref_cnts[block_id] += 1

    def _pop_free(self) -> int:
        """Take the least recently freed block, evicting whatever prefix it cached."""
        block_id = self.free_queue.pop()
        block_hash = self.block_hash.pop(block_id, None)
        if block_hash is not None:
            del self.cached[block_hash]
        self.ref_cnts[block_id] = 1
        return block_id
