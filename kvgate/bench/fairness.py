"""`kvgate bench fairness`: the noisy neighbour, fair order against FIFO, one fresh `kvgate up` stack each.

Tenant A (a key of weight `--weight-a`) floods at `--flood-x` times the worker's measured capacity with
long outputs; tenant B (weight `--weight-b`) sends short requests at a low rate. Per order, three
phases: B alone (its TTFT p50/p99), B beside A's flood (the same), then both flooding, where each
tenant's share of the tokens served while both were backlogged is set against its weight's share.
Figures: `light_ttft_p99_ratio` (B's p99 beside A over alone; target <= 2) and `share_error` (the
largest |share - weight share| / weight share; target <= 0.1), in docs/perf/fairness.json: each the
median of `--rounds` rounds (the arms taking turns, a fresh stack each), with the rounds' min and max,
and the ratio of B's TTFT samples of all rounds pooled (a p99 of one round's ~10 samples is its worst).
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import click
import httpx
import numpy as np

from kvgate.bench.burst import arrivals, start_stack
from kvgate.bench.procs import LIMIT_RPM, LIMIT_TPM
from kvgate.bench.report import spread

SERVED = "demo"


@dataclass
class Shape:
    input_words: int
    max_tokens: int


@dataclass
class Result:
    tenant: str
    phase: str
    start: float
    ttft: float | None = None
    token_times: list[float] = field(default_factory=list)  # seconds from the run's start
    status: int = 0


async def _request(client: httpx.AsyncClient, url: str, key: str, shape: Shape, r: Result, t0: float) -> None:
    import orjson

    body = {"model": SERVED, "prompt": f"{r.start:.4f} " + "word " * shape.input_words,
            "max_tokens": shape.max_tokens, "ignore_eos": True, "temperature": 0.0, "stream": True}
    sent = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer {key}"}) as resp:
            r.status = resp.status_code
            if resp.status_code != 200:
                await resp.aread()
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or (payload := line[5:].strip()) == "[DONE]":
                    continue
                data = orjson.loads(payload)
                if data.get("choices") and data["choices"][0].get("text") is not None:
                    now = time.perf_counter()
                    r.ttft = now - sent if r.ttft is None else r.ttft
                    r.token_times.append(now - t0)
    except (httpx.HTTPError, asyncio.CancelledError):
        pass  # left unfinished when the phase ended: what it got counts


async def _offer(url: str, plan: list[tuple[float, str, str, str, Shape]], until: float) -> list[Result]:
    """Each planned (offset, tenant, phase, key, shape) sent at its time, open loop; at `until`
    seconds whatever is still running is dropped (the stack is thrown away after the run)."""
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30), limits=limits) as client:
        t0, results = time.perf_counter(), []

        async def at(offset, tenant, phase, key, shape) -> None:
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            results.append(r := Result(tenant, phase, time.perf_counter() - t0))
            await _request(client, url, key, shape, r, t0)

        tasks = [asyncio.create_task(at(*p)) for p in plan]
        await asyncio.wait(tasks, timeout=until)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return results


def _key(url: str, admin_key: str, name: str, weight: float) -> str:
    resp = httpx.post(f"{url}/admin/keys", headers={"Authorization": f"Bearer {admin_key}"}, timeout=30,
                      json={"name": name, "weight": weight, "rpm": LIMIT_RPM, "tpm": LIMIT_TPM})
    resp.raise_for_status()
    return resp.json()["secret"]


def _capacity(url: str, key: str, shape: Shape, seqs: int) -> float:
    """Requests per second the worker finishes of `shape`, closed loop at 2x its sequence cap."""
    n = 2 * seqs
    t = time.perf_counter()
    results = asyncio.run(_offer(url, [(0.0, "a", "capacity", key, shape)] * n, until=600))
    done = sum(r.status == 200 and bool(r.token_times) for r in results)
    return done / (time.perf_counter() - t)


def _ttft(results: list[Result], phase: str) -> dict:
    values = [r.ttft for r in results if r.tenant == "b" and r.phase == phase and r.ttft is not None]
    sent = sum(r.tenant == "b" and r.phase == phase for r in results)
    return {**_percentiles(values), "sent": sent, "values_s": values}


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50_s": float(np.percentile(values, 50)), "p99_s": float(np.percentile(values, 99))}


def _ratio(beside: dict, alone: dict) -> float | None:
    return beside["p99_s"] / alone["p99_s"] if alone.get("p99_s") and beside.get("p99_s") else None


def summarize(rounds: list[dict]) -> dict:
    """An arm's rounds in one: each figure's median with the rounds' min and max (None where a round
    could not measure it; of an even count the upper median, as `make bench` takes), and B's TTFT
    over every round's samples pooled."""
    summary: dict = {"rounds": rounds}
    for name in ("light_ttft_p99_ratio", "share_error"):
        summary[name + "_spread"] = figure = spread([r[name] for r in rounds])  # make bench's rule
        summary[name] = figure["median"] if figure else None
    pooled = {phase: _percentiles([v for r in rounds for v in r[f"light_ttft_{phase}"]["values_s"]])
              for phase in ("alone", "beside")}
    summary["light_ttft_pooled"] = pooled
    summary["light_ttft_p99_ratio_pooled"] = _ratio(pooled["beside"], pooled["alone"])
    return summary


def _shares(results: list[Result], window: tuple[float, float], weights: dict[str, float]) -> dict:
    """Each tenant's share of the tokens delivered inside `window`, and the error against weights."""
    tokens = {t: sum(window[0] <= x < window[1] for r in results if r.tenant == t for x in r.token_times)
              for t in weights}
    total = sum(tokens.values()) or 1
    want = {t: w / sum(weights.values()) for t, w in weights.items()}
    share = {t: tokens[t] / total for t in weights}
    return {"tokens": tokens, "share": share, "weight_share": want,
            "share_error": max(abs(share[t] - want[t]) / want[t] for t in weights)}


# each arm a fresh stack: the fair order making room in a full batch, the fair order waiting for a
# slot to free, first in first out
ARMS = {"fair": {"KVGATE_FAIR_ORDER": "true", "KVGATE_FAIR_YIELD": "true"},
        "fair_wait": {"KVGATE_FAIR_ORDER": "true", "KVGATE_FAIR_YIELD": "false"},
        "fifo": {"KVGATE_FAIR_ORDER": "false"}}


def run_order(arm: str, out_dir: Path, model: str | None, a: dict, seed: int = 0) -> dict:
    """One arm on a fresh stack; `seed` draws the arrivals (each tenant's and phase's from its own
    generator, so every arm of a round gets B's same arrival times whatever its capacity)."""
    env = {**ARMS[arm], "KVGATE_TORCH_THREADS": "1",
           "KVGATE_MAX_NUM_SEQS": str(a["seqs"]), "KVGATE_MAX_STREAM_DEPTH": "100000"}
    procs, stack = start_stack(out_dir / arm, model, "paged", env)
    try:
        admin = (out_dir / arm / "stack" / "admin.key").read_text().strip()
        keys = {"a": _key(stack.url, admin, "tenant-a", a["weight_a"]),
                "b": _key(stack.url, admin, "tenant-b", a["weight_b"])}
        long, short = Shape(16, a["long_tokens"]), Shape(16, a["short_tokens"])
        capacity = _capacity(stack.url, keys["a"], long, a["seqs"])
        phase_s, flood = a["phase_s"], a["flood_x"] * capacity

        def drawn(rate: float, what: str) -> list[float]:
            return arrivals(rate, phase_s, random.Random(f"{seed}:{what}"))

        plan = [(t, "b", "alone", keys["b"], short) for t in drawn(a["light_rate"], "b-alone")]
        plan += [(phase_s + t, "a", "beside", keys["a"], long) for t in drawn(flood, "a-beside")]
        plan += [(phase_s + t, "b", "beside", keys["b"], short) for t in drawn(a["light_rate"], "b-beside")]
        # both backlogged: each floods; shares are counted from when B's queue has formed
        both = 2 * phase_s
        for tenant in ("a", "b"):
            plan += [(both + t, tenant, "both", keys[tenant], long) for t in drawn(flood, f"{tenant}-both")]
        results = asyncio.run(_offer(stack.url, plan, until=3 * phase_s + 2))
        alone, beside = _ttft(results, "alone"), _ttft(results, "beside")
        ratio = _ratio(beside, alone)
        shares = _shares(results, (both + phase_s / 3, 3 * phase_s),
                         {"a": a["weight_a"], "b": a["weight_b"]})
        return {"capacity_rps": capacity, "flood_rps": flood, "light_ttft_alone": alone,
                "light_ttft_beside": beside, "light_ttft_p99_ratio": ratio, **shares}
    finally:
        procs.stop_all()


@click.command("fairness")
@click.option("--model", default=None, help="Model folder (default: the demo model)")
@click.option("--seqs", default=4, show_default=True, help="The worker's KVGATE_MAX_NUM_SEQS")
@click.option("--phase-s", default=20.0, show_default=True, help="Seconds of each phase")
@click.option("--flood-x", default=4.0, show_default=True, help="A's rate, times the measured capacity")
@click.option("--light-rate", default=0.5, show_default=True, help="B's requests per second")
@click.option("--long-tokens", default=64, show_default=True, help="A's max_tokens (long outputs)")
@click.option("--short-tokens", default=8, show_default=True, help="B's max_tokens")
@click.option("--weight-a", default=1.0, show_default=True)
@click.option("--weight-b", default=1.0, show_default=True)
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(1, 20),
              help="Rounds of every arm, taking turns; each figure is the median of its rounds")
@click.option("--arms", default=",".join(ARMS), show_default=True,
              help="Which orders to run, comma-separated (the first one's figures are the headline)")
@click.option("--out", default="docs/perf/fairness.json", show_default=True)
def fairness_command(model, out, rounds, arms, **a) -> None:
    """Noisy neighbour: a light tenant's TTFT beside a flooding one, and token shares against
    weights, under the fair order (making room in a full batch, and waiting for a slot) and under
    FIFO, one fresh stack each."""
    chosen = [arm.strip() for arm in arms.split(",") if arm.strip()]
    if not chosen or set(chosen) - set(ARMS):
        raise click.BadParameter(f"choose among {', '.join(ARMS)}", param_hint="--arms")
    out_path = Path(out)
    runs: dict[str, list[dict]] = {arm: [] for arm in chosen}
    for n in range(rounds):  # the arms take turns, so a slower hour of the host falls on each alike
        for arm in chosen:
            runs[arm].append(r := run_order(arm, Path(f"bench-out/fairness/round-{n}"), model, a, seed=n))
            click.echo(f"round {n + 1} {arm}: ratio {r['light_ttft_p99_ratio']}, share error {r['share_error']}")
    arms_doc = {arm: summarize(rs) for arm, rs in runs.items()}
    head = arms_doc[chosen[0]]
    doc = {"fairness": {"light_ttft_p99_ratio": head["light_ttft_p99_ratio"], "share_error": head["share_error"],
                        "headline_arm": chosen[0], "settings": {**a, "rounds": rounds}, **arms_doc}}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=1) + "\n")
    click.echo(json.dumps({k: doc["fairness"][k] for k in ("light_ttft_p99_ratio", "share_error")}))
    for name, r in arms_doc.items():
        click.echo(f"{name}: ratio {r['light_ttft_p99_ratio']} {r['light_ttft_p99_ratio_spread']}, pooled "
                   f"{r['light_ttft_p99_ratio_pooled']}; share error {r['share_error']} {r['share_error_spread']}")
