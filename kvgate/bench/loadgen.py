"""Load from several client processes, so the benchmark's own Python client is not what saturates.

One asyncio client tops out at a few hundred requests/s of CPU; at a higher offered rate the
figure would be the client's, not the server's. The requests are dealt round-robin to N processes
that start together at one moment on the shared monotonic clock (perf_counter is CLOCK_MONOTONIC
on Linux: the same in every process), each sending its share at the original times; their results
are merged and summarized as one run. Each process also reports the CPU it used, so a run says how
busy its client was (a process near 1.0 CPU-s per second is the bottleneck, not the server).
"""
from __future__ import annotations

import asyncio
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

from kvgate.bench.serve import RunConfig, open_client, probe, send_all, summarize_run

START_MARGIN_S = 0.5  # time for every process to receive its share before the common start


def _share(cfg: RunConfig, requests, send_at: list[float], t0: float) -> tuple[list, float, float]:
    """One process's part: its requests at their times from t0; returns its results, the CPU
    seconds it used and when its last request ended (seconds after t0)."""
    async def go():
        async with open_client(cfg) as client:
            return await send_all(client, cfg, requests, send_at, t0)

    cpu = time.process_time()
    results = asyncio.run(go())
    return results, time.process_time() - cpu, time.perf_counter() - t0


def _ready(_: int = 0) -> int:
    """Occupies a pool process for a moment, so N of these start all N processes and their imports."""
    import aiohttp  # noqa: F401

    time.sleep(0.3)
    return 1


def _probe(cfg: RunConfig, prompt: str) -> None:
    async def go():
        async with open_client(cfg) as client:
            await probe(client, cfg, prompt)

    asyncio.run(go())


class LoadGenerator:
    """A pool of N client processes, kept for the whole benchmark (spawning costs a second each)."""

    def __init__(self, processes: int):
        self.processes = max(1, processes)
        self.pool = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"))
        list(self.pool.map(_ready, range(self.processes)))

    def close(self) -> None:
        self.pool.shutdown(cancel_futures=True)

    def run(self, cfg: RunConfig, requests, send_at: list[float]) -> dict:
        """Like serve.run_once, from N processes; max_concurrency is split between them."""
        _probe(cfg, requests[0].prompt)
        n = min(self.processes, len(requests))
        t0 = time.perf_counter() + START_MARGIN_S
        futures = [self.pool.submit(_share, replace(cfg, max_concurrency=_split(cfg.max_concurrency, n, i)),
                                    requests[i::n], send_at[i::n], t0) for i in range(n)]
        shares = [f.result() for f in futures]
        duration = max(end for _, _, end in shares)
        results = sorted((r for rs, _, _ in shares for r in rs), key=lambda r: r.start)
        out = summarize_run(cfg, results, duration)
        out["client_processes"] = n
        out["client_cpu_s_per_s"] = [round(cpu / max(duration, 1e-9), 3) for _, cpu, _ in shares]
        return out


def _split(concurrency: int | None, n: int, i: int) -> int | None:
    """Process i's cap so the caps add up to `concurrency` (None: no cap)."""
    if concurrency is None:
        return None
    return max(1, concurrency // n + (1 if i < concurrency % n else 0))
