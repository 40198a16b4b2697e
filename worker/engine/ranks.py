"""A tensor-parallel worker is N processes on one host: rank 0 (the worker itself: Redis, scheduler,
sampler, detokenizer) and ranks 1..N-1, which it starts and which only run the model on their shard.

Two process groups. The model's (gloo on CPU, NCCL on CUDA, one GPU per rank) carries the layers'
all-reduces and the logits gather, with `tensor_parallel_timeout_s` so a rank that hangs fails a
collective instead of blocking it forever. A gloo group on the CPU carries each step's plan from
rank 0 (broadcast_object_list of the pickled BatchInputs: a few KB of ids, positions, slots and
block tables); the other ranks wait on it for as long as the worker is idle, so it has no timeout
worth the name.
A rank that dies is seen at once, not at the next collective: rank 0 watches the others' process
sentinels and then stops them all and exits with RANK_DIED (a supervisor restarts the worker; other
workers take over its requests); the others die with rank 0 (PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time
from dataclasses import replace
from datetime import timedelta
from multiprocessing.connection import wait

import torch

from worker.engine.config import EngineConfig
from worker.models.parallel import Shard

log = logging.getLogger("kvgate.worker")
RANK_DIED = 70  # exit status of a worker whose rank died (EX_SOFTWARE)
IDLE = timedelta(days=3650)  # the plan group's timeout: a worker may idle for any time
STOP_WAIT_S = 10.0


class TPGroup:
    """One rank's membership: its shard, and the plan broadcast and agreements between ranks."""

    def __init__(self, config: EngineConfig, rank: int, store):
        import torch.distributed as dist

        backend = "nccl" if config.torch_device().type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=rank, world_size=config.tensor_parallel_size,
                                timeout=timedelta(seconds=config.tensor_parallel_timeout_s))
        self.plans = dist.new_group(backend="gloo", timeout=IDLE)
        self.shard = Shard(rank, config.tensor_parallel_size)

    def send(self, plan) -> None:
        """Rank 0: this step's plan (None: stop) to every other rank."""
        import torch.distributed as dist

        start = time.perf_counter()
        dist.broadcast_object_list([plan], src=0, group=self.plans)
        self.shard.comm_seconds += time.perf_counter() - start

    def receive(self):
        import torch.distributed as dist

        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.plans)
        return box[0]

    def min_over_ranks(self, n: int) -> int:
        """What every rank can afford (KV blocks): each measured its own memory."""
        import torch.distributed as dist

        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.plans)
        return int(t.item())

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        import torch.distributed as dist

        out = [None] * self.shard.size
        dist.all_gather_object(out, obj, group=self.plans)
        return out

    @staticmethod
    def leave() -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class RankProcesses:
    """Rank 0's handle on ranks 1..N-1: started with the engine, watched, stopped with it."""

    def __init__(self, config: EngineConfig):
        import torch.distributed as dist
        import torch.multiprocessing as mp

        if dist.is_initialized():
            raise RuntimeError("a tensor-parallel engine is already running in this process; close() it "
                               "first (torch.distributed has one default group per process)")
        size = config.tensor_parallel_size
        threads = self._share_cores(config, size)
        store = dist.TCPStore("127.0.0.1", 0, size, True, wait_for_workers=False,
                              timeout=timedelta(seconds=config.tensor_parallel_timeout_s))
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=rank_main, args=(config, rank, store.port, threads, os.getpid()), daemon=True,
                                  name=f"kvgate-tp-rank{rank}") for rank in range(1, size)]
        for proc in self.procs:
            proc.start()
        self.closing = False
        threading.Thread(target=self._watch, daemon=True, name="tp-ranks").start()
        self.group = TPGroup(config, 0, store)
        log.info("tensor parallel: %d ranks (pids %s), %s", size,
                 [os.getpid()] + [p.pid for p in self.procs], "nccl" if config.torch_device().type == "cuda"
                 else f"gloo, {threads} torch threads per rank")

    @staticmethod
    def _share_cores(config: EngineConfig, size: int) -> int:
        """On CPU the ranks share the host's cores: each takes its share of rank 0's threads."""
        threads = torch.get_num_threads()
        if config.torch_device().type == "cpu":
            threads = max(1, threads // size)
            torch.set_num_threads(threads)
        return threads

    def _watch(self) -> None:
        ready = wait([p.sentinel for p in self.procs])
        if self.closing:
            return
        dead = next(p for p in self.procs if p.sentinel in ready)
        dead.join(1.0)  # reaped, so its exit code is known
        self.abort(f"tensor-parallel rank {dead.name} (pid {dead.pid}) exited with {dead.exitcode}")

    def abort(self, why: str) -> None:
        """The group is broken (a rank died, or a collective failed or timed out): no step can run
        again, so every rank stops and the worker exits non-zero for its supervisor to restart."""
        log.error("%s; stopping all %d ranks and the worker (exit %d)", why, len(self.procs) + 1, RANK_DIED)
        self.closing = True
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        logging.shutdown()
        os._exit(RANK_DIED)

    def close(self) -> None:
        """Orderly stop: the ranks get a None plan and leave; any that does not is killed."""
        if self.closing:
            return
        self.closing = True
        try:
            self.group.send(None)
        except RuntimeError as exc:
            log.warning("tensor-parallel ranks did not take the stop (%s); killing them", exc)
        for proc in self.procs:
            proc.join(STOP_WAIT_S)
            if proc.is_alive():
                proc.kill()
        self.group.leave()


def rank_main(config: EngineConfig, rank: int, port: int, threads: int, parent: int) -> None:
    """Ranks 1..N-1: join the group, load this rank's shard, run every plan rank 0 sends."""
    import torch.distributed as dist

    from worker.engine.model_runner import ModelRunner
    from worker.models.config import read_model_config

    _die_with_parent(parent)
    for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 decides when the ranks stop (Ctrl-C hits them all)
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{rank} %(levelname)s %(message)s")
    torch.set_num_threads(threads)
    if config.torch_device().type == "cuda":
        config = replace(config, device=f"cuda:{(config.torch_device().index or 0) + rank}")
        torch.cuda.set_device(config.torch_device())
    store = dist.TCPStore("127.0.0.1", port, config.tensor_parallel_size, False,
                          timeout=timedelta(seconds=config.tensor_parallel_timeout_s))
    group = TPGroup(config, rank, store)
    runner = ModelRunner(config, read_model_config(config.model_dir), (), group=group)
    runner.serve()
    group.leave()


def _die_with_parent(parent: int) -> None:
    """SIGKILL this rank when rank 0 dies, however it dies (Linux; elsewhere the broken group's
    next collective ends it)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # rank 0 died before the prctl
        os._exit(RANK_DIED)
