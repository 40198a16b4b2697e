"""`kvgate bench serve`: load any OpenAI-compatible /v1/completions endpoint the way users do and
measure TTFT, TPOT, ITL and E2EL on the client (definitions in kvgate/bench/metrics.py).

Requests are text prompts with `ignore_eos` and `max_tokens`, so every answer is exactly as long as
asked; they are sent at Poisson arrival times (`--request-rate`), or as fast as a cap on requests in
flight allows (`--max-concurrency`), or once per level of a concurrency sweep (`--sweep`).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import click

STATE_DIR = Path(".kvgate")


@dataclass
class RunConfig:
    url: str
    model: str
    api_key: str | None
    dataset: str = "random"
    num_prompts: int = 100
    request_rate: float = float("inf")
    max_concurrency: int | None = None
    burstiness: float = 1.0
    stream: bool = True
    slo_ms: dict = field(default_factory=dict)  # {"ttft": ms, "tpot": ms, "e2el": ms}
    seed: int = 0
    endpoint: str = "/v1/completions"
    timeout_s: float = 600.0
    progress: bool = True
    extra_body: dict = field(default_factory=dict)
    headers: dict = field(default_factory=dict)  # sent with every request (a peer's per-request config)


def request_body(cfg: RunConfig, prompt: str, max_tokens: int) -> dict:
    body = {"model": cfg.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": cfg.stream, **cfg.extra_body}
    if cfg.stream:
        body["stream_options"] = {"include_usage": True}
    return body


def open_client(cfg: RunConfig):
    """The benchmark's HTTP client: aiohttp, as vLLM's serving benchmark uses. Its C parser costs
    ~0.5 ms a request on a 2-core VM where httpx's pure-Python stack costs ~2 ms, time that would
    be counted as the server's (docs/performance.md, "The benchmark's client")."""
    import aiohttp

    limit = cfg.max_concurrency or 4096
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit, limit_per_host=limit),
        timeout=aiohttp.ClientTimeout(total=cfg.timeout_s, connect=30.0),
        auto_decompress=False, read_bufsize=1 << 20)


async def send_request(client, cfg: RunConfig, prompt: str, max_tokens: int):
    """One request, timed as vLLM's openai-completions client times it."""
    import orjson

    from kvgate.bench.metrics import RequestResult

    result = RequestResult()
    headers = {"Authorization": f"Bearer {cfg.api_key}", **cfg.headers} if cfg.api_key else dict(cfg.headers)
    headers["Content-Type"] = "application/json"
    start = time.perf_counter()
    try:
        async with client.post(cfg.url.rstrip("/") + cfg.endpoint, headers=headers,
                               data=orjson.dumps(request_body(cfg, prompt, max_tokens))) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.read())[:300].decode(errors='replace')}"
                return result
            if not cfg.stream:
                data = orjson.loads(await resp.read())
                result.ttft = result.latency = time.perf_counter() - start
                _take_usage(result, data.get("usage"))
                result.success = True
                return result
            last = start
            async for raw in resp.content:  # one line at a time
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                data = orjson.loads(payload)
                if _carries_text(data):
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                _take_usage(result, data.get("usage"))
            result.latency = last - start
            result.success = result.ttft > 0.0
            if not result.success:
                result.error = "the stream ended before any token"
    except Exception as exc:  # a failed request is a data point, not the end of the run
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def _carries_text(chunk: dict) -> bool:
    """vLLM times every chunk with choices; proxies that send the finish reason or the usage in a
    choice of their own (LiteLLM does) would get extra near-zero ITLs, so a chunk counts when its
    choice has a `text` field (even empty, as vLLM's special tokens)."""
    choices = chunk.get("choices")
    return bool(choices) and "text" in choices[0]


def _take_usage(result, usage: dict | None) -> None:
    if usage:
        result.output_len = usage.get("completion_tokens") or 0
        result.prompt_len = usage.get("prompt_tokens") or result.prompt_len


async def run_once(cfg: RunConfig, requests, send_at: list[float]) -> dict:
    """Send every request at its time (bounded by max_concurrency) and summarize what came back."""
    async with open_client(cfg) as client:
        await probe(client, cfg, requests[0].prompt)
        with _progress(cfg, len(requests)) as advance:
            t0 = time.perf_counter()
            results = await send_all(client, cfg, requests, send_at, t0, advance)
            duration = time.perf_counter() - t0
    return summarize_run(cfg, results, duration)


async def probe(client, cfg: RunConfig, prompt: str) -> None:
    """One small request first, so a wrong URL or key fails the run at once with its reason."""
    result = await send_request(client, cfg, prompt, 2)
    if not result.success:
        raise click.ClickException(f"the test request to {cfg.url}{cfg.endpoint} failed: {result.error}")


async def send_all(client, cfg: RunConfig, requests, send_at: list[float], t0: float, advance=lambda: None) -> list:
    """Each request at t0 + its send time (perf_counter clock: the same in every process here)."""
    semaphore = asyncio.Semaphore(cfg.max_concurrency or 4096)

    async def one(req, at: float):
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        async with semaphore:
            sent = time.perf_counter() - t0
            res = await send_request(client, cfg, req.prompt, req.output_len)
        res.start, res.label = sent, req.label
        res.prompt_len = res.prompt_len or req.prompt_len
        advance()
        return res

    return list(await asyncio.gather(*(one(r, at) for r, at in zip(requests, send_at))))


def summarize_run(cfg: RunConfig, results: list, duration: float) -> dict:
    from kvgate.bench.metrics import summarize, summarize_by_label

    out = {**_describe(cfg), **summarize(results, duration, cfg.slo_ms)}
    if len(by_label := summarize_by_label(results, duration, cfg.slo_ms)) > 1:
        out["by_label"] = by_label
    out["errors"] = sorted({r.error for r in results if not r.success})[:5]
    out["ttfts_ms"] = [round(r.ttft * 1000, 3) for r in results if r.success]  # for CDF plots
    out["labels"] = [r.label for r in results if r.success]
    out["e2els_ms"] = [round(r.latency * 1000, 3) for r in results if r.success]
    return out


def _describe(cfg: RunConfig) -> dict:
    rate = cfg.request_rate
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "url": cfg.url,
            "model": cfg.model, "dataset": cfg.dataset, "stream": cfg.stream,
            "request_rate": "inf" if rate == float("inf") else rate, "max_concurrency": cfg.max_concurrency,
            "burstiness": cfg.burstiness}


class _progress:
    """A rich progress bar over completed requests (silent when progress is off)."""

    def __init__(self, cfg: RunConfig, total: int):
        self.cfg, self.total, self.bar = cfg, total, None

    def __enter__(self):
        from rich.console import Console

        if not self.cfg.progress or not Console().is_terminal:
            return lambda: None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(TextColumn(f"[bold]{self.cfg.dataset}[/] c={self.cfg.max_concurrency or '∞'} "
                                       f"rate={self.cfg.request_rate}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), transient=True)
        self.bar.start()
        task = self.bar.add_task("requests", total=self.total)
        return lambda: self.bar.advance(task)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()


def build_workload(cfg: RunConfig, opts, tokenizer_dir: str | None):
    from kvgate.bench.datasets import Vocabulary, load_tokenizer, make_requests, send_times

    vocab = Vocabulary(load_tokenizer(tokenizer_dir))
    requests = make_requests(cfg.dataset, cfg.num_prompts, opts, vocab, cfg.seed)
    times = send_times(cfg.dataset, cfg.num_prompts, cfg.request_rate, opts, cfg.burstiness, cfg.seed)
    return requests, times


def run_benchmark(cfg: RunConfig, opts, tokenizer_dir: str | None = None,
                  sweep: list[int] | None = None) -> dict:
    """One run, or one run per concurrency level of `sweep`; returns {"config", "runs"}."""
    from dataclasses import replace

    requests, times = build_workload(cfg, opts, tokenizer_dir)
    levels = sweep or [cfg.max_concurrency]
    runs = [asyncio.run(run_once(replace(cfg, max_concurrency=c), requests, times)) for c in levels]
    config = {**asdict(cfg), "api_key": None, "dataset_options": asdict(opts), "sweep": sweep}
    config["request_rate"] = "inf" if cfg.request_rate == float("inf") else cfg.request_rate
    return {"config": config, "runs": runs}


def print_report(report: dict) -> None:
    import sys

    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160)  # piped: no squeezed columns

    table = Table(title=f"kvgate bench serve · {report['config']['dataset']} · {report['config']['url']}")
    for col in ("conc.", "rate", "ok/fail", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50",
                "ITL p99", "E2EL p50", "goodput"):
        table.add_column(col, justify="right")
    for r in report["runs"]:
        table.add_row(str(r["max_concurrency"] or "∞"), str(r["request_rate"]), f"{r['completed']}/{r['failed']}",
                      f"{r['request_throughput']:.2f}", f"{r['output_throughput']:.1f}",
                      f"{r['p50_ttft_ms']:.1f}", f"{r['p99_ttft_ms']:.1f}", f"{r['p50_tpot_ms']:.2f}",
                      f"{r['p99_itl_ms']:.2f}", f"{r['p50_e2el_ms']:.1f}",
                      f"{r['request_goodput']:.2f}" if "request_goodput" in r else "-")
    console.print(table)
    for r in report["runs"]:
        for err in r["errors"]:
            console.print(f"[red]error[/]: {err}")


def _from_state(name: str) -> str | None:
    path = STATE_DIR / name
    return path.read_text().strip() if path.exists() else None


@click.command("serve")
@click.option("--url", default=None, help="Server base URL [default: .kvgate/gateway.url]")
@click.option("--model", default="demo", show_default=True, help="Served model name")
@click.option("--api-key", envvar="KVGATE_BENCH_API_KEY", default=None, help="[default: .kvgate/dev.key]")
@click.option("--tokenizer", default=None, help="Model folder whose tokenizer sizes the prompts "
              "[default: .kvgate/model.dir]")
@click.option("--dataset", type=click.Choice(["random", "shared-prefix", "long-short", "burst"]),
              default="random", show_default=True)
@click.option("--num-prompts", type=int, default=100, show_default=True)
@click.option("--request-rate", type=float, default=float("inf"), help="Requests/s, Poisson [default: inf]")
@click.option("--burstiness", type=float, default=1.0, show_default=True, help="Gamma shape of arrivals")
@click.option("--max-concurrency", type=int, default=None, help="Cap on requests in flight")
@click.option("--sweep", default=None, help="Concurrency levels, e.g. 1,4,16,64: one run each")
@click.option("--input-len", type=int, default=128, show_default=True)
@click.option("--output-len", type=int, default=64, show_default=True)
@click.option("--range-ratio", type=float, default=0.0, show_default=True)
@click.option("--prefix-len", type=int, default=256, show_default=True, help="shared-prefix")
@click.option("--num-prefixes", type=int, default=4, show_default=True, help="shared-prefix")
@click.option("--long-input-len", type=int, default=1024, show_default=True, help="long-short")
@click.option("--long-output-len", type=int, default=16, show_default=True, help="long-short")
@click.option("--long-fraction", type=float, default=0.25, show_default=True, help="long-short")
@click.option("--burst-size", type=int, default=16, show_default=True, help="burst")
@click.option("--burst-interval", type=float, default=1.0, show_default=True, help="burst (s)")
@click.option("--slo-ttft-ms", type=float, default=None, help="Goodput: TTFT at most this")
@click.option("--slo-tpot-ms", type=float, default=None, help="Goodput: TPOT at most this")
@click.option("--slo-e2el-ms", type=float, default=None, help="Goodput: E2EL at most this")
@click.option("--no-stream", is_flag=True, help="Non-streamed requests (TTFT = E2EL)")
@click.option("--out", default=None, help="Write the results as JSON here")
@click.option("--plots", default=None, help="Write PNG plots into this folder")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--no-progress", is_flag=True)
def serve_command(url, model, api_key, tokenizer, dataset, num_prompts, request_rate, burstiness,
                  max_concurrency, sweep, slo_ttft_ms, slo_tpot_ms, slo_e2el_ms, no_stream, out, plots,
                  seed, no_progress, **dataset_opts) -> None:
    """Measure TTFT, TPOT, ITL, E2EL, throughput and goodput through a running server."""
    from kvgate.bench.datasets import DatasetOptions

    url = url or _from_state("gateway.url")
    if not url:
        raise click.UsageError("no --url, and no .kvgate/gateway.url (is `kvgate up` running here?)")
    slo = {k: v for k, v in (("ttft", slo_ttft_ms), ("tpot", slo_tpot_ms), ("e2el", slo_e2el_ms)) if v}
    levels = [int(x) for x in sweep.split(",")] if sweep else None
    cfg = RunConfig(url=url, model=model, api_key=api_key or _from_state("dev.key"), dataset=dataset,
                    num_prompts=num_prompts, request_rate=request_rate, max_concurrency=max_concurrency,
                    burstiness=burstiness, stream=not no_stream, slo_ms=slo, seed=seed,
                    progress=not no_progress)
    dataset_opts["burst_interval_s"] = dataset_opts.pop("burst_interval")
    report = run_benchmark(cfg, DatasetOptions(**dataset_opts), tokenizer or _from_state("model.dir"), levels)
    print_report(report)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1) + "\n")
        click.echo(f"results: {out}")
    if plots:
        from kvgate.bench.plots import plot_report

        for path in plot_report(report, Path(plots)):
            click.echo(f"plot: {path}")
