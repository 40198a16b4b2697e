"""`kvgate bench burst`: find the sustainable request rate of a fresh `kvgate up` stack, offer 2× and
3× of it for `--burst-s`, then 1× again, and check that overload is shed cleanly: every request ends
with tokens or a 429/503 carrying Retry-After, no process of the stack exits, and TTFT comes back to
normal. The open-loop load (Poisson arrivals, each request's outcome) is shared with the soak drill.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import click
import numpy as np

SERVED = "demo"
WINDOW_S = 2.0  # recovery is judged on the p99 TTFT of requests started in windows this long


@dataclass
class Shape:
    """What one request asks for; `cancel`: the client leaves after its first token."""
    label: str
    input_words: int
    max_tokens: int
    cancel: bool = False


SHORT = Shape("short", 16, 16)


@dataclass
class Outcome:
    """What the client saw of one request; times in seconds from the drill's start."""
    start: float
    phase: str
    label: str
    status: int = 0  # HTTP status; 0: no answer at all
    retry_after: str | None = None
    ttft: float | None = None
    end: float = 0.0
    tokens: int = 0
    cancelled: bool = False
    error: str = ""

    @property
    def served(self) -> bool:
        return self.status == 200 and self.tokens > 0 and not self.error

    @property
    def shed(self) -> bool:
        return self.status in (429, 503) and bool(self.retry_after)

    @property
    def clean(self) -> bool:
        """Tokens, or a refusal the client can act on; anything else breaks the promise."""
        return self.served or self.shed


@dataclass
class Target:
    url: str
    key: str
    timeout_s: float = 300.0


def arrivals(rate: float, seconds: float, rng: random.Random) -> list[float]:
    """Poisson arrival offsets within [0, seconds)."""
    out, t = [], rng.expovariate(rate)
    while t < seconds:
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def one_request(client, target: Target, shape: Shape, result: Outcome, t0: float) -> None:
    import orjson

    body = {"model": SERVED, "prompt": f"{result.start:.4f} " + "word " * shape.input_words,
            "max_tokens": shape.max_tokens, "ignore_eos": True, "temperature": 0.0, "stream": True}
    sent = time.perf_counter()
    try:
        async with client.stream("POST", target.url + "/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer {target.key}"}) as resp:
            result.status, result.retry_after = resp.status_code, resp.headers.get("retry-after")
            if resp.status_code != 200:
                await resp.aread()
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or (payload := line[5:].strip()) == "[DONE]":
                    continue
                data = orjson.loads(payload)
                if "error" in data:
                    result.error = str(data["error"].get("code") or data["error"])
                    return
                if data.get("choices") and data["choices"][0].get("text") is not None:
                    result.tokens += 1
                    if result.ttft is None:
                        result.ttft = time.perf_counter() - sent
                        if shape.cancel:  # leave: the gateway must cancel and the worker free the KV
                            result.cancelled = True
                            return
    except Exception as exc:  # a broken request is a data point (and fails the drill), not a crash
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.end = time.perf_counter() - t0


async def offer(target: Target, plan: list[tuple[float, str, Shape]]) -> list[Outcome]:
    """Send each planned (offset s, phase, shape) at its time, open loop: a slow server does not
    slow the arrivals down."""
    import httpx

    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(target.timeout_s, connect=30.0), limits=limits) as client:
        t0 = time.perf_counter()

        async def at(offset: float, phase: str, shape: Shape) -> Outcome:
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            result = Outcome(start=time.perf_counter() - t0, phase=phase, label=shape.label)
            await one_request(client, target, shape, result, t0)
            return result

        return list(await asyncio.gather(*(at(*p) for p in plan)))


def p99(values: list[float]) -> float | None:
    return float(np.percentile(values, 99)) if values else None


# -- finding the sustainable rate ------------------------------------------------------------
@dataclass
class Ramp:
    start: float = 2.0
    factor: float = 1.5
    seconds: float = 4.0
    max_rate: float = 200.0
    ttft_slo_s: float = 1.0


def find_sustainable(target: Target, ramp: Ramp) -> dict:
    """compare.py's ramp rule on streamed requests: a level is kept up when every request got its
    tokens, completions kept pace (≥ 90% of the offered rate) and TTFT p99 stayed under the SLO; a
    missed level gets one more try (the machine is shared), a second miss ends the ramp."""
    rate, best, levels = ramp.start, 0.0, []
    while rate <= ramp.max_rate:
        for _ in range(2):
            # evenly spaced, as compare.py's ramp: Poisson gaps over a few seconds offer too few or many
            plan = [(i / rate, "ramp", SHORT) for i in range(max(2, int(rate * ramp.seconds)))]
            got = asyncio.run(offer(target, plan))
            span = max(o.end for o in got) - min(o.start for o in got)
            achieved = sum(o.served for o in got) / max(span, len(plan) / rate)
            tail = p99([o.ttft for o in got if o.served])
            kept = all(o.served for o in got) and achieved >= 0.9 * rate and (tail or 0) <= ramp.ttft_slo_s
            levels.append({"offered": rate, "achieved": achieved, "failed": sum(not o.served for o in got),
                           "p99_ttft_s": tail, "kept_up": kept})
            if kept:
                break
        if not kept:
            break
        best, rate = rate, round(rate * ramp.factor, 2)
    if best == 0.0:
        raise click.ClickException(f"the stack did not keep up with {ramp.start} req/s: {levels}")
    return {"levels": levels, "sustainable_rps": best}


# -- the burst -------------------------------------------------------------------------------
def burst_plan(rate: float, burst_s: float, calm_s: float | None = None,
               seed: int = 1) -> tuple[list, dict[str, tuple[float, float]]]:
    """1× for calm_s (default half a burst, at least 10 s), 2× and 3× for burst_s each, then 1× for
    2 calm_s (default 1.5 burst_s, at least 20 s) to watch the recovery; returns the plan and each
    phase's [start, end)."""
    before, after = (calm_s, 2 * calm_s) if calm_s else (max(10.0, burst_s / 2), max(20.0, 1.5 * burst_s))
    rng, plan, spans, t = random.Random(seed), [], {}, 0.0
    for phase, mult, seconds in (("1x", 1, before), ("2x", 2, burst_s), ("3x", 3, burst_s),
                                 ("after", 1, after)):
        plan += [(t + dt, phase, SHORT) for dt in arrivals(rate * mult, seconds, rng)]
        spans[phase], t = (t, t + seconds), t + seconds
    return plan, spans


def recovery_s(outcomes: list[Outcome], after: tuple[float, float], normal_p99: float) -> float | None:
    """Seconds from the end of the burst to the first WINDOW_S window of the 1× phase from which
    every later window's p99 TTFT is back under max(1.5× normal, normal + 50 ms); None: never."""
    limit = max(1.5 * normal_p99, normal_p99 + 0.05)
    edges = np.arange(after[0], after[1], WINDOW_S)
    tails = [p99([o.ttft for o in outcomes if o.served and lo <= o.start < lo + WINDOW_S]) for lo in edges]
    for i, lo in enumerate(edges):
        if all(t is None or t <= limit for t in tails[i:]):
            return float(lo - after[0])
    return None


def phase_figures(outcomes: list[Outcome], phase: str) -> dict:
    mine = [o for o in outcomes if o.phase == phase]
    served = [o.ttft for o in mine if o.served]
    return {"offered": len(mine), "served": len(served), "shed": sum(o.shed for o in mine),
            "shed_share": sum(o.shed for o in mine) / max(1, len(mine)),
            "unclean": sum(not o.clean for o in mine), "p99_ttft_s": p99(served),
            "statuses": sorted({o.status for o in mine})}


def summarize_burst(outcomes: list[Outcome], spans: dict, sustainable: dict, exited: list[str]) -> dict:
    phases = {name: phase_figures(outcomes, name) for name in spans}
    normal = phases["1x"]["p99_ttft_s"] or 0.0
    unclean = [asdict(o) for o in outcomes if not o.clean][:5]
    out = {"sustainable_rps": sustainable["sustainable_rps"], "ramp": sustainable["levels"], "phases": phases,
           "shed_share_2x": phases["2x"]["shed_share"], "shed_share_3x": phases["3x"]["shed_share"],
           "p99_ttft_s_3x": phases["3x"]["p99_ttft_s"], "normal_p99_ttft_s": normal,
           "recovery_s": recovery_s(outcomes, spans["after"], normal), "unclean": unclean,
           "processes_exited": exited, "spans": spans}
    out["passed"] = not unclean and not exited and out["recovery_s"] is not None
    return out


# -- the stack, its processes and the report --------------------------------------------------
def stack_pids(up_pid: int) -> dict[int, str]:
    """Every process under `kvgate up`, pid -> its command line."""
    import psutil

    return {p.pid: " ".join(p.cmdline()) for p in psutil.Process(up_pid).children(recursive=True)}


def start_stack(out_dir: Path, model: str | None, engine: str, env: dict):
    from kvgate.bench.procs import Processes
    from kvgate.up import default_model_dir

    procs = Processes(out_dir)
    try:
        return procs, procs.kvgate("stack", Path(model) if model else default_model_dir(), engine, env)
    except BaseException:  # a stack that came up too late is still running: stop it
        procs.stop_all()
        raise


def stack_env(stream_depth: int) -> dict:
    # 1 torch thread: client, gateway, Redis and worker share the cores (see compare.Sizes)
    return {"KVGATE_MAX_STREAM_DEPTH": str(stream_depth), "KVGATE_TORCH_THREADS": "1"}


def write_section(path: Path, name: str, section: dict) -> None:
    """resilience.json holds one section per drill; a run rewrites only its own."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = json.loads(path.read_text()) if path.exists() else {}
    doc[name] = section
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")


def plot_burst(outcomes: list[Outcome], spans: dict, folder: Path) -> list[Path]:
    from kvgate.bench.plots import _pyplot, _save

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    ok = [o for o in outcomes if o.served]
    ax.scatter([o.start for o in ok], [o.ttft * 1000 for o in ok], s=4, label="TTFT of served requests")
    shed = [o.start for o in outcomes if o.shed]
    if shed:
        ax.scatter(shed, [1.0] * len(shed), s=6, marker="x", color="red", label="shed (429/503)")
    for i, (name, (lo, hi)) in enumerate(spans.items()):
        ax.axvspan(lo, hi, alpha=0.08 * (i % 2 + 1), color="grey")
        ax.text((lo + hi) / 2, 0.97, name, transform=ax.get_xaxis_transform(), ha="center", va="top",
                fontsize=8)
    ax.set_yscale("log")
    ax.set(xlabel="request start (s)", ylabel="TTFT (ms, log)", title="burst: TTFT over time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    paths = [_save(fig, folder / "burst_ttft.png")]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    figures = {name: phase_figures(outcomes, name) for name in spans}
    bars = ax.bar(list(figures), [f["shed_share"] for f in figures.values()])
    ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set(ylabel="shed share", title="burst: share of requests shed per phase", ylim=(0, 1))
    paths.append(_save(fig, folder / "burst_shed.png"))
    return paths


@click.command("burst")
@click.option("--model", type=click.Path(exists=True, file_okay=False), default=None,
              help="Model folder [default: the demo model]")
@click.option("--engine", type=click.Choice(["paged", "hf", "synthetic"]), default="paged", show_default=True)
@click.option("--burst-s", type=float, default=60.0, show_default=True, help="Seconds of 2× and of 3×")
@click.option("--rate", type=float, default=None, help="Sustainable req/s to use [default: found by a ramp]")
@click.option("--calm-s", type=float, default=None,
              help="Seconds at 1× before the burst (twice that after) [default: max(10, burst/2)]")
@click.option("--ramp-s", type=float, default=4.0, show_default=True, help="Seconds per ramp level")
@click.option("--ramp-start", type=float, default=2.0, show_default=True)
@click.option("--ramp-max", type=float, default=200.0, show_default=True)
@click.option("--stream-depth", type=int, default=16, show_default=True,
              help="KVGATE_MAX_STREAM_DEPTH of the stack: the scaling knee per worker (docs/scaling.md)")
@click.option("--out", default="docs/perf/resilience.json", show_default=True)
@click.option("--plots", default="docs/perf", show_default=True)
@click.option("--out-dir", default="bench-out/burst", show_default=True, help="Stack logs and state")
def burst_command(model, engine, burst_s, calm_s, rate, ramp_s, ramp_start, ramp_max, stream_depth, out, plots,
                  out_dir) -> None:
    """Sustainable rate, then 2× and 3× of it, then back: shed share, TTFT p99, recovery time."""
    procs, server = start_stack(Path(out_dir), model, engine, stack_env(stream_depth))
    try:
        target = Target(server.url, server.key)
        before = stack_pids(server.proc.pid)
        found = ({"levels": [], "sustainable_rps": rate} if rate else
                 find_sustainable(target, Ramp(ramp_start, seconds=ramp_s, max_rate=ramp_max)))
        click.echo(f"sustainable: {found['sustainable_rps']} req/s")
        plan, spans = burst_plan(found["sustainable_rps"], burst_s, calm_s)
        outcomes = asyncio.run(offer(target, plan))
        exited = [cmd for pid, cmd in before.items() if pid not in stack_pids(server.proc.pid)]
    finally:
        procs.stop_all()
    section = {**summarize_burst(outcomes, spans, found, exited), "engine": engine, "burst_s": burst_s,
               "calm_s": calm_s, "stream_depth": stream_depth}
    write_section(Path(out), "burst", section)
    for path in plot_burst(outcomes, spans, Path(plots)):
        click.echo(f"plot: {path}")
    for name, f in section["phases"].items():
        click.echo(f"{name:>5}: offered {f['offered']}, served {f['served']}, shed {f['shed_share']:.1%}, "
                   f"unclean {f['unclean']}, p99 TTFT {f['p99_ttft_s']}")
    click.echo(f"recovery: {section['recovery_s']} s; exited: {exited or 'none'}; results: {out}")
    if not section["passed"]:
        raise click.ClickException(f"burst drill failed: unclean {section['unclean']}, exited {exited}, "
                                   f"recovery {section['recovery_s']}")
