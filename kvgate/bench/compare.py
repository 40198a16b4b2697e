"""`make bench`: the four serving comparisons of issue 10, side by side in one run on this machine.

1. paged engine vs the naive `hf` worker behind the same gateway, concurrency 1 → 64;
2. gateway overhead with the synthetic engine: bare server, LiteLLM proxy → bare server, kvgate
   (gateway + Redis + worker): added latency, and the highest sustained requests/s per process;
3. shared-prefix workload with prefix caching on vs off;
4. short requests' TTFT with long prompts arriving vs alone;
plus the TTFT that gateway + Redis add over the same engine called in-process.
Results go to docs/performance.md (its serve section), docs/perf/*.png and docs/perf/bench.json.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from kvgate.bench.datasets import DatasetOptions, Vocabulary, load_tokenizer, make_requests, send_times
from kvgate.bench.metrics import distribution
from kvgate.bench.procs import Processes, Server, ensure_litellm
from kvgate.bench.serve import RunConfig, run_once

SERVED = "demo"


@dataclass
class Sizes:
    levels: tuple[int, ...] = (1, 4, 16, 64)
    engine_input: int = 32
    engine_output: int = 32
    overhead_requests: int = 50  # per path, mode and round
    overhead_rounds: int = 4  # paths take turns, so a noisy moment hits all of them
    overhead_input: int = 32
    overhead_output: int = 16
    ramp_start: float = 20.0
    ramp_factor: float = 1.5
    ramp_seconds: float = 4.0
    ramp_max: float = 3000.0
    prefix_len: int = 512
    prefix_suffix: int = 32
    prefix_output: int = 8
    prefix_requests: int = 64
    prefix_concurrency: int = 4
    mix_short_input: int = 32
    mix_short_output: int = 32
    mix_long_input: int = 1024
    mix_long_output: int = 8
    mix_short_requests: int = 90
    mix_short_rate: float = 9.0
    # long prompts arrive at a rate that keeps them this busy (their measured TTFT alone × rate), so
    # the mix stays feasible however fast or loaded the machine is: it measures scheduling, not overload
    mix_long_busy: float = 0.2
    added_requests: int = 40
    added_output: int = 4
    # torch threads per engine process. The machine has 2 cores for client, gateway, Redis and
    # worker together; a worker with 2 OpenMP threads there ran ~40x slower (TTFT 390 ms vs 9.5 ms
    # for the same request), so every engine, in-process included, gets 1.
    torch_threads: int = 1

    @classmethod
    def quick(cls) -> Sizes:
        return cls(levels=(1, 4), engine_output=8, overhead_requests=10, overhead_rounds=2, ramp_seconds=1.0,
                   ramp_max=100.0, prefix_len=128, prefix_requests=8, mix_long_input=256, mix_short_requests=12,
                   added_requests=8)


class Bench:
    def __init__(self, model_dir: Path, procs: Processes, sizes: Sizes):
        self.model_dir, self.procs, self.sizes = model_dir, procs, sizes

    @functools.cached_property
    def vocab(self) -> Vocabulary:
        return Vocabulary(load_tokenizer(self.model_dir))

    def workload(self, dataset: str, n: int, opts: DatasetOptions, seed: int, rate: float = float("inf"),
                 burstiness: float = 1.0):
        return (make_requests(dataset, n, opts, self.vocab, seed),
                send_times(dataset, n, rate, opts, burstiness, seed))

    def serve(self, server: Server, workload, concurrency: int | None = None, stream: bool = True,
              dataset: str = "random", rate: float = float("inf")) -> dict:
        cfg = RunConfig(url=server.url, model=SERVED, api_key=server.key, dataset=dataset,
                        num_prompts=len(workload[0]), request_rate=rate, max_concurrency=concurrency,
                        stream=stream, progress=sys.stdout.isatty())
        return asyncio.run(run_once(cfg, *workload))

    # -- 1. paged vs naive ------------------------------------------------------------------
    def engines(self) -> dict:
        s = self.sizes
        opts = DatasetOptions(input_len=s.engine_input, output_len=s.engine_output)
        out = {"levels": list(s.levels), "input_len": s.engine_input, "output_len": s.engine_output}
        for engine in ("paged", "hf"):
            server = self.procs.kvgate(f"cmp1-{engine}", self.model_dir, engine)
            out[engine] = [self.serve(server, self.workload("random", max(8, 2 * c), opts, seed=c), c)
                           for c in s.levels]
            self.procs.stop(server.proc)
        top = s.levels[-1]  # for context: the same top level on the paged engine alone, in this process
        out["paged_inprocess_top"] = inprocess_throughput(
            self.model_dir, self.workload("random", max(8, 2 * top), opts, seed=top)[0], s.torch_threads)
        return out

    # -- 2. gateway overhead ----------------------------------------------------------------
    def gateways(self, litellm_venv: Path | None) -> dict:
        servers = {"baseline": self.procs.baseline(self.model_dir)}
        if litellm_venv is not None:
            servers["litellm"] = self.procs.litellm(litellm_venv, servers["baseline"], SERVED)
        servers["kvgate"] = self.procs.kvgate("cmp2-kvgate", self.model_dir, "synthetic")
        out = {"latency": {mode: self._latency(servers, stream=mode == "stream") for mode in ("nostream", "stream")},
               "ramp": {name: self._ramp(server) for name, server in servers.items()}}
        for server in servers.values():
            self.procs.stop(server.proc)
        return out

    def _latency(self, servers: dict[str, Server], stream: bool) -> dict:
        """One request at a time; the paths take turns in rounds; TTFT and E2EL distributions."""
        s = self.sizes
        opts = DatasetOptions(input_len=s.overhead_input, output_len=s.overhead_output)
        seen = {name: {"ttft": [], "e2el": [], "failed": 0} for name in servers}
        for round_ in range(s.overhead_rounds):
            for name, server in servers.items():
                run = self.serve(server, self.workload("random", s.overhead_requests, opts, seed=100 + round_), 1, stream)
                seen[name]["ttft"] += run["ttfts_ms"]
                seen[name]["e2el"] += run["e2els_ms"]
                seen[name]["failed"] += run["failed"]
        return {name: {"ttft": distribution([v / 1000 for v in d["ttft"]]),
                       "e2el": distribution([v / 1000 for v in d["e2el"]]), "failed": d["failed"],
                       "requests": len(d["ttft"])} for name, d in seen.items()}

    def _ramp(self, server: Server) -> dict:
        """Evenly spaced non-streamed requests at a rate rising level by level. A level is kept up
        when nothing failed, completions kept pace (≥ 90% of the offered rate) and E2EL p99 stayed
        under 1 s; a missed level gets one more try (the machine is shared), a second miss ends the
        ramp. The figure is the last level kept up."""
        s = self.sizes
        opts = DatasetOptions(input_len=s.overhead_input, output_len=s.overhead_output)
        levels, rate, best = [], s.ramp_start, 0.0
        while rate <= s.ramp_max:
            for attempt in range(2):
                n = max(20, int(rate * s.ramp_seconds))
                run = self.serve(server, self.workload("random", n, opts, seed=7 + attempt, rate=rate,
                                                       burstiness=1000.0), stream=False, rate=rate)
                kept = run["failed"] == 0 and run["request_throughput"] >= 0.9 * rate and run["p99_e2el_ms"] <= 1000
                levels.append({"offered": rate, "achieved": run["request_throughput"], "failed": run["failed"],
                               "p50_e2el_ms": run["p50_e2el_ms"], "p99_e2el_ms": run["p99_e2el_ms"], "kept_up": kept})
                if kept:
                    break
            if not kept:
                break
            best, rate = rate, round(rate * s.ramp_factor, 1)
        return {"levels": levels, "max_sustained_rps": best}

    # -- 3. prefix caching ------------------------------------------------------------------
    def prefix(self) -> dict:
        s = self.sizes
        opts = DatasetOptions(input_len=s.prefix_suffix, output_len=s.prefix_output, prefix_len=s.prefix_len,
                              num_prefixes=4)
        out = {"prefix_len": s.prefix_len, "suffix_len": s.prefix_suffix, "output_len": s.prefix_output,
               "concurrency": s.prefix_concurrency}
        for caching in ("on", "off"):
            env = {"KVGATE_ENABLE_PREFIX_CACHING": "true" if caching == "on" else "false"}
            server = self.procs.kvgate(f"cmp3-prefix-{caching}", self.model_dir, "paged", env)
            out[caching] = self.serve(server, self.workload("shared-prefix", s.prefix_requests, opts, seed=3),
                                      s.prefix_concurrency, dataset="shared-prefix")
            self.procs.stop(server.proc)
        return out

    # -- 4. long/short mix, and the TTFT gateway + Redis add ---------------------------------
    def mix_and_added(self) -> tuple[dict, dict]:
        server = self.procs.kvgate("cmp4-paged", self.model_dir, "paged")
        added = self._ttft_added(server)
        s = self.sizes
        opts = DatasetOptions(input_len=s.mix_short_input, output_len=s.mix_short_output,
                              long_input_len=s.mix_long_input, long_output_len=s.mix_long_output)
        probe = self.serve(server, self.workload("long-short", 3, replace(opts, long_fraction=1.0), 40), 1,
                           dataset="long-short")
        long_rate = min(s.mix_short_rate, s.mix_long_busy / max(probe["p50_ttft_ms"] / 1000, 1e-3))
        n_long = max(3, round(long_rate * s.mix_short_requests / s.mix_short_rate))
        rate, n = s.mix_short_rate + long_rate, s.mix_short_requests + n_long
        alone = self.serve(server, self.workload("long-short", s.mix_short_requests, replace(opts, long_fraction=0.0),
                                                 4, s.mix_short_rate), dataset="long-short", rate=s.mix_short_rate)
        mixed = self.serve(server, self.workload("long-short", n, replace(opts, long_fraction=n_long / n), 4, rate),
                           dataset="long-short", rate=rate)
        self.procs.stop(server.proc)
        return {"alone": alone, "mixed": mixed, "short_rate": s.mix_short_rate, "long_rate": long_rate,
                "long_ttft_alone_ms": probe["p50_ttft_ms"], "long_busy": s.mix_long_busy,
                **{k: getattr(s, k) for k in ("mix_short_input", "mix_short_output", "mix_long_input",
                                              "mix_long_output")}}, added

    def _ttft_added(self, server: Server) -> dict:
        """Streamed TTFT through the stack vs the same prompts on the same engine in this process."""
        s = self.sizes
        opts = DatasetOptions(input_len=s.engine_input, output_len=s.added_output)
        self.serve(server, self.workload("random", 5, opts, seed=50), 1)  # warm-up
        requests, times = self.workload("random", s.added_requests, opts, seed=51)
        through = self.serve(server, (requests, times), 1)
        local = inprocess_ttfts(self.model_dir, [r.prompt for r in requests], s.added_output, s.torch_threads)
        gateway = distribution([v / 1000 for v in through["ttfts_ms"]])
        engine = distribution(local)
        return {"gateway": gateway, "inprocess": engine, "requests": len(requests),
                "added_p50_ms": gateway["p50"] - engine["p50"], "added_p99_ms": gateway["p99"] - engine["p99"]}


def _engine(model_dir: Path, threads: int):
    """The paged engine exactly as `kvgate worker` builds it."""
    import torch

    from shared.settings import WorkerSettings
    from worker.main import build_engine

    torch.set_num_threads(threads)
    return build_engine(WorkerSettings(model=str(model_dir), engine="paged"))


def inprocess_throughput(model_dir: Path, requests, threads: int) -> dict:
    """Output tokens/s of the paged engine with every request submitted at once (no HTTP, no Redis)."""
    from worker.engine.tokenizer import encode_prompt
    from worker.engine.types import SamplingParams

    engine = _engine(model_dir, threads)
    engine.add_request("warm-up", encode_prompt(engine.tokenizer, requests[0].prompt), SamplingParams(max_tokens=4))
    while engine.has_unfinished():
        engine.step()
    start = time.perf_counter()
    for i, r in enumerate(requests):
        engine.add_request(f"r{i}", encode_prompt(engine.tokenizer, r.prompt),
                           SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True))
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    elapsed = time.perf_counter() - start
    return {"requests": len(requests), "output_tokens": tokens, "output_throughput": tokens / elapsed}


def inprocess_ttfts(model_dir: Path, prompts: list[str], max_tokens: int, threads: int) -> list[float]:
    """TTFT (s) of each prompt alone on the engine the worker builds: tokenize, add, step until its
    first token."""
    from worker.engine.tokenizer import encode_prompt
    from worker.engine.types import SamplingParams

    engine = _engine(model_dir, threads)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ttfts = []
    for i, prompt in enumerate(["warm up the engine"] * 3 + prompts):
        start, first = time.perf_counter(), None
        engine.add_request(f"r{i}", encode_prompt(engine.tokenizer, prompt), params)
        while engine.has_unfinished():
            outputs = engine.step()
            if first is None and any(o.new_token_ids for o in outputs):
                first = time.perf_counter() - start
        if i >= 3:
            ttfts.append(first)
    return ttfts


def main(argv: list[str] | None = None) -> int:
    from kvgate.bench.report import write_report
    from kvgate.up import default_model_dir

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke check, not figures)")
    ap.add_argument("--out-dir", default="bench-out/serve", help="logs and stack state")
    ap.add_argument("--docs", default="docs", help="where performance.md and perf/ are written")
    ap.add_argument("--litellm-venv", default="bench-out/litellm-venv")
    ap.add_argument("--skip-litellm", action="store_true")
    ap.add_argument("--from-results", help="only rewrite the report from a run's results.json")
    args = ap.parse_args(argv)
    if args.from_results:
        results = json.loads(Path(args.from_results).read_text())
        write_report(results, Path(args.docs), quick=results.get("quick", False))
        return 0
    started = time.monotonic()
    sizes = Sizes.quick() if args.quick else Sizes()
    os.environ["OMP_NUM_THREADS"] = str(sizes.torch_threads)  # before torch loads here or in a child
    procs = Processes(Path(args.out_dir).resolve())
    bench = Bench(default_model_dir(), procs, sizes)
    venv = None if args.skip_litellm else ensure_litellm(Path(args.litellm_venv).resolve())
    results = {"loadavg_start": os.getloadavg()[0]}  # the machine is shared: say how busy it was
    try:
        for name, step in (("engines", bench.engines), ("gateways", lambda: bench.gateways(venv)),
                           ("prefix", bench.prefix), ("mix_added", bench.mix_and_added)):
            print(f"== {name} ({time.monotonic() - started:.0f}s)", flush=True)
            results[name] = step()
    finally:
        procs.stop_all()
    results["mix"], results["ttft_added"] = results.pop("mix_added")
    results["sizes"] = sizes.__dict__
    results["elapsed_s"] = time.monotonic() - started
    results["loadavg_end"] = os.getloadavg()[0]
    results["quick"] = args.quick
    (procs.log_dir / "results.json").write_text(json.dumps(results) + "\n")  # raw, for --from-results
    write_report(results, Path(args.docs), quick=args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
