"""How big the paged KV cache is: the byte budget, the blocks it buys, and the context they hold.

On CPU the default budget is measured, not fixed (vLLM's CPU backend asks for a fixed space): once
the weights are loaded, CPU_RULE takes a fraction of the memory still available, between a floor
and a cap (its docstring says why each number). `--kv-cache-memory` overrides it; on CUDA the
runner takes `--gpu-memory-utilization` of the card instead.

Then the context must fit the pool: a pool that cannot hold one sequence of the model's
`max_model_len` lowers `max_model_len` to what it holds (one warning line), and an explicit
`--max-model-len` that does not fit stops the worker with the numbers to change.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("kvgate.worker")
MiB, GiB = 1 << 20, 1 << 30

# what to raise for more KV, by how the pool was sized; `bytes`/`blocks`: what one full sequence needs
GROW = {
    "kv_cache_memory": "raise --kv-cache-memory (KVGATE_KV_CACHE_MEMORY) to at least {bytes} bytes",
    "gpu_memory_utilization": "raise --gpu-memory-utilization (KVGATE_GPU_MEMORY_UTILIZATION) until "
                              "the KV cache gets at least {bytes} bytes",
    "num_blocks": "raise num_blocks to at least {blocks}",
}


class KVCacheTooSmall(ValueError):
    """An explicit --max-model-len the KV cache cannot hold: a start-up error, not a request's."""


@dataclass(frozen=True)
class CpuBudgetRule:
    """KV bytes on CPU from the memory available once the weights are loaded.

    - fraction 0.5: the other half stays for what the pool does not account for: a step's
      activations and the sampler's logits (max_num_seqs x vocab floats, a few copies), the
      gateway, Redis and Celery that `kvgate up` runs beside the worker, the page cache the next
      start reads weights from, and a second worker started on the same host after this one.
    - floor 256 MiB: a low reading (a burst elsewhere at start-up) still leaves a pool of ~1,000
      tokens of a 0.6B model in fp32 rather than a few blocks; a warning says so.
    - cap 32 GiB: a CPU decode step reads every live KV byte; at ~100 GB/s of memory bandwidth
      32 GiB is ~0.3 s per output token, past any interactive pace, so more would only hold
      sequences too slow to serve.
    - and never more than `useful` bytes: max_num_seqs sequences of max_model_len tokens, all the
      engine could ever fill (a small model on a big host takes MiBs, not half the machine).
    """

    fraction: float = 0.5
    floor: int = 256 * MiB
    cap: int = 32 * GiB

    def budget(self, available: int, useful: int) -> int:
        return min(self.cap, useful, max(self.floor, int(available * self.fraction)))

    def explain(self, available: int, useful: int) -> str:
        return (f"auto: {self.fraction:g} x {_size(available)} available after the weights, "
                f"floor {_size(self.floor)}, cap {_size(min(self.cap, useful))}")


CPU_RULE = CpuBudgetRule()


def available_memory() -> int:
    """Bytes this process could still take: psutil's `available` (free + reclaimable cache), or
    what the cgroup's limit leaves when that is tighter (a container sees the host's meminfo)."""
    import psutil

    available = psutil.virtual_memory().available
    room = _cgroup_room()
    return available if room is None else min(available, room)


def _cgroup_room() -> int | None:
    """limit - usage of the memory cgroup (v2, then v1), or None when there is no limit."""
    root = Path("/sys/fs/cgroup")
    for limit, usage in (("memory.max", "memory.current"),
                         ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            raw = (root / limit).read_text().strip()
            if raw == "max" or int(raw) >= 1 << 60:  # v1 says "unlimited" with a huge number
                return None
            return max(0, int(raw) - int((root / usage).read_text()))
        except (OSError, ValueError):
            continue
    return None


def cpu_budget(block_bytes: int, block_size: int, max_num_seqs: int, max_model_len: int,
               rule: CpuBudgetRule = CPU_RULE) -> tuple[int, str]:
    """(KV bytes, how they were chosen in words), measured now: call it after the weights load."""
    available = available_memory()
    useful = max_num_seqs * cdiv(max_model_len, block_size) * block_bytes
    budget = rule.budget(available, useful)
    if available * rule.fraction < rule.floor <= budget:
        log.warning("only %s of memory is available after the weights; the KV cache takes its "
                    "floor of %s anyway (set --kv-cache-memory to choose)", _size(available),
                    _size(rule.floor))
    return budget, rule.explain(available, useful)


def fit_max_model_len(requested: int | None, model_max: int, num_blocks: int, block_size: int,
                      block_bytes: int, knob: str) -> int:
    """The max_model_len the pool can hold one sequence of: `requested` (or the model's) when it
    fits; else the model's is lowered to the pool (a warning), and a requested one is an error."""
    pool = num_blocks * block_size
    wanted = requested or model_max
    if wanted <= pool:
        return wanted
    blocks = cdiv(wanted, block_size)
    grow = GROW[knob].format(bytes=blocks * block_bytes, blocks=blocks)
    have = f"{num_blocks} blocks of {block_size} tokens = {pool} tokens, {_size(num_blocks * block_bytes)}"
    if requested is not None:
        raise KVCacheTooSmall(
            f"--max-model-len {requested} does not fit the KV cache: one sequence of {requested} "
            f"tokens needs {blocks} blocks ({blocks * block_bytes} bytes), the cache has {have}. "
            f"Either {grow}, or lower --max-model-len to at most {pool}")
    log.warning("max_model_len lowered from %d to %d tokens: the KV cache holds no more (%s); for "
                "the model's full context %s", model_max, pool, have, grow)
    return pool


@dataclass(frozen=True)
class KVCacheFacts:
    """What the worker logs at start-up, exports as gauges and puts in its registry entry."""

    num_blocks: int
    block_size: int
    block_bytes: int
    max_model_len: int  # the effective one, after fit_max_model_len
    dtype: str
    source: str  # how the budget was chosen, in words
    tp_size: int = 1  # ranks the model and the cache are split across; the figures above are rank 0's
    ranks: tuple[dict, ...] = ()  # per rank: rank, pid, weight_bytes, kv_bytes
    linear_kernel: str = ""  # the GEMM path the linears took (gemm_probe.py), for the metrics

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def max_concurrency(self) -> float:
        """Sequences of max_model_len tokens the cache holds at once (vLLM's 'maximum concurrency')."""
        return round(self.tokens / self.max_model_len, 2)

    def registry_fields(self) -> dict:
        return {"kv_blocks": self.num_blocks, "kv_block_size": self.block_size,
                "kv_tokens": self.tokens, "kv_bytes": self.bytes, "kv_dtype": self.dtype,
                "kv_max_concurrency": self.max_concurrency, "tp_size": self.tp_size,
                "tp_ranks": list(self.ranks)}

    def line(self) -> str:
        return (f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.tokens} "
                f"tokens, {self.bytes} bytes ({_size(self.bytes)}, {self.dtype}; {self.source}); "
                f"max_model_len {self.max_model_len}: {self.max_concurrency:g} sequences of full "
                f"length fit" + (f"; per rank of {self.tp_size}" if self.tp_size > 1 else ""))


NO_KV_FIELDS = dict.fromkeys(("kv_blocks", "kv_block_size", "kv_tokens", "kv_bytes", "kv_dtype",
                              "kv_max_concurrency", "tp_size", "tp_ranks"))  # engines without a paged pool (hf, synthetic)


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ in integers: blocks for tokens, programs for rows (the one copy; vLLM's cdiv)."""
    return -(-a // b)


def _size(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"
