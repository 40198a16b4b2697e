"""`kvgate bench cpu`: CPU time per request of each process of a fresh `kvgate up` stack (the
synthetic engine by default, so the figure is the serving path's own), a closed loop of
`--concurrency` clients, whole answers then streamed ones.

CPU time (user + system, from each process's counters) over the requests served holds up on a
shared machine where latency and requests per second do not: another job slows a request, it
does not add CPU to it. To compare a change, run it on both commits (a `git worktree` each, with
PYTHONPATH pointing at the tree) one after the other, and again in the other order.
"""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import click
import httpx

from kvgate.bench.burst import SERVED
from kvgate.bench.soak import role

ROLES = ("gateway", "worker", "redis")


def cpu_times(up_pid: int) -> dict[str, tuple[float, float]]:
    """(user, system) CPU seconds of each role's processes under a `kvgate up` (children summed in)."""
    import psutil

    out: dict[str, tuple[float, float]] = {}
    for top in psutil.Process(up_pid).children():
        name = role(top.cmdline())
        if name not in ROLES:
            continue
        user, system = out.get(name, (0.0, 0.0))
        for p in [top, *top.children(recursive=True)]:
            t = p.cpu_times()
            user, system = user + t.user, system + t.system
        out[name] = (user, system)
    return out


def per_request(before: dict, after: dict, requests: int) -> dict[str, dict[str, float]]:
    """Milliseconds of CPU per request of each role, user and system, between two readings."""
    out = {}
    for name in sorted(set(before) & set(after)):
        user, system = (1000 * (a - b) / max(1, requests) for a, b in zip(after[name], before[name]))
        out[name] = {"user_ms": round(user, 3), "system_ms": round(system, 3), "total_ms": round(user + system, 3)}
    return out


async def closed_loop(url: str, key: str, stream: bool, seconds: float, concurrency: int,
                      max_tokens: int) -> int:
    """Requests completed by `concurrency` clients each sending the next as soon as one ends."""
    body = {"model": SERVED, "prompt": "hello world " * 10, "max_tokens": max_tokens, "stream": stream}
    headers = {"Authorization": f"Bearer {key}"}
    done = 0
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=concurrency)) as client:
        end = time.monotonic() + seconds

        async def one() -> None:
            nonlocal done
            while time.monotonic() < end:
                async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
                    await r.aread()
                    if r.status_code != 200:
                        raise click.ClickException(f"HTTP {r.status_code}: {r.text[:200]}")
                done += 1
        await asyncio.gather(*(one() for _ in range(concurrency)))
    return done


def run(out_dir: Path, model: str | None, engine: str, seconds: float, concurrency: int,
        max_tokens: int) -> dict:
    from kvgate.bench.burst import start_stack, stack_env

    procs, server = start_stack(out_dir, model, engine, stack_env(1000))
    try:
        asyncio.run(closed_loop(server.url, server.key, False, min(2.0, seconds), concurrency, max_tokens))
        modes = {}
        for stream in (False, True):
            before, started = cpu_times(server.proc.pid), time.monotonic()
            n = asyncio.run(closed_loop(server.url, server.key, stream, seconds, concurrency, max_tokens))
            wall = time.monotonic() - started
            modes["stream" if stream else "whole"] = {
                "requests": n, "req_per_s": round(n / wall, 1),
                "cpu_ms_per_request": per_request(before, cpu_times(server.proc.pid), n)}
        return {"engine": engine, "seconds": seconds, "concurrency": concurrency, "max_tokens": max_tokens,
                "modes": modes}
    finally:
        procs.stop_all()


@click.command("cpu")
@click.option("--model", type=click.Path(exists=True, file_okay=False), default=None,
              help="Model folder [default: the demo model]")
@click.option("--engine", type=click.Choice(["synthetic", "paged"]), default="synthetic", show_default=True)
@click.option("--seconds", type=float, default=10.0, show_default=True, help="Per mode")
@click.option("--concurrency", type=int, default=4, show_default=True)
@click.option("--max-tokens", type=int, default=16, show_default=True)
@click.option("--out", default="bench-out/cpu.json", show_default=True)
@click.option("--out-dir", default="bench-out/cpu", show_default=True, help="Stack logs and state")
def cpu_command(model, engine, seconds, concurrency, max_tokens, out, out_dir) -> None:
    """CPU time per request of the gateway, the worker and Redis."""
    result = run(Path(out_dir).resolve(), model, engine, seconds, concurrency, max_tokens)
    for mode, d in result["modes"].items():
        cpu = ", ".join(f"{name} {v['total_ms']:.2f} ms" for name, v in d["cpu_ms_per_request"].items())
        click.echo(f"{mode}: {d['requests']} requests ({d['req_per_s']} req/s); CPU per request: {cpu}")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
