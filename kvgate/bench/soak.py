"""`kvgate bench soak`: a fresh `kvgate up` stack under 70% of its sustainable rate for `--duration`
(a long/short mix, some clients leaving mid-stream, the worker SIGKILLed halfway and restarted by
`kvgate up`), sampled every few seconds; it passes when nothing grows by more than 5% after the
warm-up, no KV block is held once idle, and no key lives without a TTL beyond the permanent ones.

Growth is judged across the whole run, the induced restart included (the issue's letter); beside it
the run reports each process's growth within each of its two lives and the step at the restart,
which tell a climb (a leak) from a plateau that a restart's backlog raised once.
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import click
import numpy as np

from kvgate.bench.burst import (SERVED, SHORT, Ramp, Shape, Target, arrivals, find_sustainable, offer,
                                stack_env, start_stack, write_section)

WARMUP_SHARE = 0.2  # the first 20% of the run: caches, pools and Redis's TTL'd keys fill up
BASE_SHARE = 0.1  # growth compares the median of the 10% after the warm-up with that of the last 10%
MAX_GROWTH = 0.05
LONG = Shape("long", 200, 48)
CANCEL = Shape("cancel", 16, 200, cancel=True)


def mix(rng: random.Random, long_share: float, cancel_share: float) -> Shape:
    draw = rng.random()
    return CANCEL if draw < cancel_share else LONG if draw < cancel_share + long_share else SHORT


# -- pass criteria -----------------------------------------------------------------------------
def growth(values: list[float], warmup: float = WARMUP_SHARE) -> float:
    """Relative growth of a series sampled under steady load: the median of its last 10% over the
    median of the 10% right after the warm-up (medians: one noisy sample does not fail a run)."""
    n = len(values)
    if n < 3:
        return 0.0
    lo = min(n - 1, int(n * warmup))
    base = float(np.median(values[lo:max(lo + 1, int(n * (warmup + BASE_SHARE)))]))
    end = float(np.median(values[-max(1, int(n * BASE_SHARE)):]))
    return (end - base) / base if base else 0.0


def leaked_blocks(stats: dict | None) -> int | None:
    """Blocks not free once every request has ended (None: the engine has no paged pool)."""
    if not stats or "num_blocks" not in stats:
        return None
    return int(stats["num_blocks"] - stats["num_free_blocks"])


def untimed_keys(client, allowed: set[str]) -> list[str]:
    """Keys without a TTL that are neither permanent nor the stack's own bounded ones (key store,
    Celery's broker and beat)."""
    from shared import names

    own = (names.key_record(""), names.key_digest(""), names.KEY_NAMES, names.CELERY_PREFIX, "_kombu")
    out = []
    for raw in client.scan_iter("*", count=1000):
        key = raw.decode()
        if key not in allowed and not key.startswith(own) and client.ttl(key) == -1:
            out.append(key)
    return sorted(out)


def lives(samples: list[dict], restart_at: float | None) -> list[list[dict]]:
    """The samples before and after the restart (one life when there was none, or when either side
    is too short to have a warm-up of its own)."""
    if restart_at is None:
        return [samples]
    split = [[s for s in samples if s["t"] < restart_at], [s for s in samples if s["t"] >= restart_at]]
    return split if all(len(life) >= 10 for life in split) else [samples]


def restart_step(series: list[list[float]]) -> float:
    """The jump across the restart: the second life's level after its warm-up over the first's end."""
    if len(series) < 2:
        return 0.0
    before, after = series
    end = float(np.median(before[-max(1, int(len(before) * BASE_SHARE)):]))
    lo = min(len(after) - 1, int(len(after) * WARMUP_SHARE))
    level = float(np.median(after[lo:max(lo + 1, int(len(after) * (WARMUP_SHARE + BASE_SHARE)))]))
    return (level - end) / end if end else 0.0


def verdict(samples: list[dict], leaked: int | None, extra_keys: list[str],
            restart_at: float | None = None) -> dict:
    """The soak's figures and its pass/fail, from the samples taken under load."""
    parts = lives(samples, restart_at)
    roles = sorted({r for s in samples for r in s["rss"]})
    rss = {r: growth([s["rss"].get(r, 0) for s in samples]) for r in roles}
    by_life = {r: [[s["rss"].get(r, 0) for s in life] for life in parts] for r in roles}
    out = {"rss_growth": max(rss.values(), default=0.0), "rss_growth_by_process": rss,
           "redis_growth": growth([s["redis_used_memory"] for s in samples]),
           "keys_growth": growth([s["redis_keys"] for s in samples]),
           "fds_growth": growth([s["fds"] for s in samples]),
           "connections_growth": growth([s["connections"] for s in samples]),
           "rss_growth_by_life": {r: [growth(values) for values in series] for r, series in by_life.items()},
           "rss_restart_step": {r: restart_step(series) for r, series in by_life.items()},
           "leaked_blocks": leaked, "untimed_keys": extra_keys}
    out["passed"] = (out["rss_growth"] <= MAX_GROWTH and out["redis_growth"] <= MAX_GROWTH
                     and not leaked and not extra_keys)
    return out


# -- sampling ----------------------------------------------------------------------------------
def role(cmdline: list[str]) -> str:
    """gateway, worker, redis, celery-worker, celery-beat: from a stack process's command line."""
    if any("redis-server" in a for a in cmdline[:1]):
        return "redis"
    args = cmdline[cmdline.index("kvgate") + 1:] if "kvgate" in cmdline else cmdline
    if args[:1] == ["celery"]:
        return "celery-beat" if "beat" in args else "celery-worker"
    return args[0] if args else "other"


def process_sample(up_pid: int) -> tuple[dict[str, int], int, int]:
    """RSS per role (a role's children summed in), open fds and connections of the whole stack."""
    import psutil

    rss, fds, conns = {}, 0, 0
    for top in psutil.Process(up_pid).children():
        try:
            name = role(top.cmdline())
            for p in [top, *top.children(recursive=True)]:
                rss[name] = rss.get(name, 0) + p.memory_info().rss
                fds += p.num_fds()
                conns += len(p.net_connections(kind="inet"))
        except psutil.Error:  # a process that died between the listing and the read (the kill)
            continue
    return rss, fds, conns


def worker_stats(client) -> tuple[int, dict | None]:
    """Requests active on the live workers and the stats of one (the drill runs one worker)."""
    import orjson

    from shared import names

    active, stats = 0, None
    for worker_id in client.zrange(names.WORKERS_ZSET, 0, -1):
        raw = client.get(names.worker_key(worker_id.decode()))
        if raw and (info := orjson.loads(raw)).get("served_name") == SERVED:
            active, stats = active + info.get("active", 0), info.get("stats")
    return active, stats


def take_sample(up_pid: int, client, t0: float) -> dict:
    rss, fds, conns = process_sample(up_pid)
    info = client.info("memory")
    active, stats = worker_stats(client)
    return {"t": time.monotonic() - t0, "rss": rss, "fds": fds, "connections": conns,
            "redis_used_memory": info["used_memory"], "redis_keys": client.dbsize(), "active": active,
            "blocks_in_use": leaked_blocks(stats)}


@dataclass
class Sampler:
    up_pid: int
    client: object
    every_s: float
    samples: list[dict] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self, t0: float) -> threading.Thread:
        def loop():
            while not self.stop.wait(self.every_s):
                try:
                    self.samples.append(take_sample(self.up_pid, self.client, t0))
                except Exception as exc:  # Redis busy or a process gone mid-read: skip this sample
                    print(f"sample skipped: {exc}", flush=True)

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        return thread


def pick_redis_server(choice: str) -> str | None:
    """The binary the soak's stack runs (None: whatever `kvgate up` finds)."""
    if choice != "auto":
        return choice
    from shared.redis_server import find_tls_redis_server

    return find_tls_redis_server()  # Debian's build: TLS and jemalloc


def kill_worker(up_pid: int) -> int:
    """SIGKILL the stack's engine worker (`kvgate up` restarts it a second later)."""
    import psutil

    for p in psutil.Process(up_pid).children():
        if role(p.cmdline()) == "worker":
            os.kill(p.pid, signal.SIGKILL)
            return p.pid
    raise click.ClickException("no worker process under kvgate up")


def settle(client, timeout_s: float = 60.0) -> dict | None:
    """Wait until no request is active on the worker and no stream is held open (an abandoned one
    is settled after the resume grace), then the worker's stats (the idle pool)."""
    from shared import names

    deadline, stats = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        active, stats = worker_stats(client)
        idle = active == 0 and client.zcard(names.OPEN_STREAMS) == 0
        if stats is not None and idle and stats.get("num_running", 0) == 0:
            return stats
        time.sleep(0.5)
    return stats


def plot_soak(samples: list[dict], killed_at: float, folder: Path) -> list[Path]:
    from kvgate.bench.plots import _pyplot, _save

    plt = _pyplot()
    ts = [s["t"] for s in samples]
    end = ts[-1] if ts else 0.0
    spans = [(0.0, killed_at), (killed_at, end)] if 0 < killed_at < end else [(0.0, end)]
    roles = sorted({r for s in samples for r in s["rss"]})
    paths = []
    for name, title, series in (
            ("soak_rss.png", "RSS per process (MiB)",
             {r: [s["rss"].get(r, 0) / 2**20 for s in samples] for r in roles}),
            ("soak_redis.png", "Redis: used memory (MiB) and keys",
             {"used_memory MiB": [s["redis_used_memory"] / 2**20 for s in samples],
              "keys": [s["redis_keys"] for s in samples]}),
            ("soak_fds.png", "open fds and inet connections (whole stack)",
             {"fds": [s["fds"] for s in samples], "connections": [s["connections"] for s in samples]})):
        fig, ax = plt.subplots(figsize=(7, 3.8))
        for label, ys in series.items():
            ax.plot(ts, ys, label=label)
        ax.axvline(killed_at, color="red", ls="--", lw=1, label="worker SIGKILL")
        ends = [start + (stop - start) * WARMUP_SHARE for start, stop in spans]
        for i, end in enumerate(ends):
            ax.axvline(end, color="grey", ls=":", lw=1, label="end of a warm-up" if i == 0 else None)
        ax.set(xlabel="time (s)", title=f"soak: {title}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        paths.append(_save(fig, folder / name))
    return paths


@click.command("soak")
@click.option("--model", type=click.Path(exists=True, file_okay=False), default=None,
              help="Model folder [default: the demo model]")
@click.option("--engine", type=click.Choice(["paged", "hf", "synthetic"]), default="paged", show_default=True)
@click.option("--duration", type=float, default=1800.0, show_default=True, help="Seconds under load")
@click.option("--rate", type=float, default=None, help="Req/s [default: 70% of the rate a ramp finds]")
@click.option("--sample-s", type=float, default=5.0, show_default=True)
@click.option("--long-share", type=float, default=0.2, show_default=True)
@click.option("--cancel-share", type=float, default=0.05, show_default=True, help="Clients that leave")
@click.option("--ramp-s", type=float, default=4.0, show_default=True)
@click.option("--ramp-max", type=float, default=200.0, show_default=True)
@click.option("--stream-depth", type=int, default=1000, show_default=True, help="KVGATE_MAX_STREAM_DEPTH")
@click.option("--redis-server", default="auto", show_default=True,
              help="A redis-server binary; auto: Debian's build (jemalloc, as the compose and Kubernetes "
                   "images) when `make redis-tls` unpacked it, else what `kvgate up` finds")
@click.option("--out", default="docs/perf/resilience.json", show_default=True)
@click.option("--plots", default="docs/perf", show_default=True)
@click.option("--out-dir", default="bench-out/soak", show_default=True, help="Stack logs and state")
def soak_command(model, engine, duration, rate, sample_s, long_share, cancel_share, ramp_s, ramp_max,
                 stream_depth, redis_server, out, plots, out_dir) -> None:
    """Hours of steady load compressed: growth of RSS, Redis and fds, leaked blocks, untimed keys."""
    import redis

    from shared import names

    env = stack_env(stream_depth)
    if binary := pick_redis_server(redis_server):
        env["KVGATE_REDIS_SERVER"] = binary
    procs, server = start_stack(Path(out_dir), model, engine, env)
    client = redis.Redis.from_url((Path(out_dir) / "stack" / "redis.url").read_text().strip())
    try:
        info = client.info("server") | client.info("memory")
        allocator = {"redis_version": info["redis_version"], "redis_allocator": info["mem_allocator"]}
        target = Target(server.url, server.key)
        sustainable = None if rate else find_sustainable(target, Ramp(seconds=ramp_s, max_rate=ramp_max))
        rate = rate or 0.7 * sustainable["sustainable_rps"]
        rng = random.Random(3)
        plan = [(t, "soak", mix(rng, long_share, cancel_share)) for t in arrivals(rate, duration, rng)]
        click.echo(f"soak: {len(plan)} requests at {rate:.2f} req/s for {duration:.0f} s, redis "
                   f"{allocator['redis_version']} on {allocator['redis_allocator']}")
        sampler, t0 = Sampler(server.proc.pid, client, sample_s), time.monotonic()
        sampler.run(t0)
        killer = threading.Timer(duration / 2, lambda: killed.append((time.monotonic() - t0,
                                                                    kill_worker(server.proc.pid))))
        killed: list = []
        killer.start()
        outcomes = asyncio.run(offer(target, plan))
        sampler.stop.set()
        idle = settle(client)
        extra = untimed_keys(client, names.permanent_keys(SERVED, "v1"))
        open_streams = client.zcard(names.OPEN_STREAMS)
        samples = [s for s in sampler.samples if s["t"] <= duration]  # under load only
    finally:
        procs.stop_all()
    killed_at = killed[0][0] if killed else None
    section = {**verdict(samples, leaked_blocks(idle), extra, killed_at), "duration_s": duration, "engine": engine,
               "rate_rps": rate, "sustainable": sustainable, "requests": len(outcomes),
               "served": sum(o.served for o in outcomes), "cancelled": sum(o.cancelled for o in outcomes),
               "shed": sum(o.shed for o in outcomes), "unclean": sum(not o.clean for o in outcomes),
               "statuses": {str(c): sum(o.status == c for o in outcomes) for c in {o.status for o in outcomes}},
               "errors": sorted({o.error or str(o.status) for o in outcomes if not o.clean})[:5],
               "worker_killed_at_s": killed_at, "warmup_share": WARMUP_SHARE,
               "open_streams_idle": open_streams, **allocator, "idle_stats": idle, "samples": samples}
    section["passed"] = section["passed"] and open_streams == 0
    write_section(Path(out), "soak", section)
    for path in plot_soak(samples, section["worker_killed_at_s"] or 0.0, Path(plots)):
        click.echo(f"plot: {path}")
    steps = {r: f"{v:+.1%}" for r, v in section["rss_restart_step"].items()}
    click.echo(f"rss growth {section['rss_growth']:+.1%} {section['rss_growth_by_process']} (the step "
               f"at the restart {steps}), redis growth "
               f"{section['redis_growth']:+.1%}, leaked blocks {section['leaked_blocks']}, untimed keys "
               f"{extra or 'none'}; served {section['served']}/{section['requests']}, shed {section['shed']}, "
               f"unclean {section['unclean']}, "
               f"statuses {section['statuses']}, open streams idle {open_streams}")
    if not section["passed"]:
        raise click.ClickException("soak drill failed its pass criteria (see above)")
