"""`make bench`: the four serving comparisons of issue 10, side by side in one run on this machine.

1. paged engine vs the naive `hf` worker behind the same gateway, concurrency 1 → 64;
2. gateway overhead with the synthetic engine: bare server, LiteLLM proxy → bare server, Portkey's
   gateway → bare server, kvgate (gateway + Redis + worker): added latency, and the highest sustained
   requests/s per process, the load coming from several client processes (kvgate/bench/loadgen.py);
3. shared-prefix workload with prefix caching on vs off;
4. short requests' TTFT with long prompts arriving vs alone;
plus the TTFT that gateway + Redis add over the same engine called in-process.
The target figures are measured in `rounds` rounds within the one run, and reported with their spread.
`--only overhead` runs part 2 alone (minutes) and merges it into the last full run's results;
`--only added` the added TTFT alone, `--only engines` part 1 alone, likewise; with no earlier run in
`--out-dir` the report goes to OUT_DIR/docs, leaving the published one as it is.
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
from kvgate.bench.loadgen import LoadGenerator
from kvgate.bench.metrics import distribution
from kvgate.bench.portkey import ensure_portkey
from kvgate.bench.procs import Processes, Server, ensure_litellm
from kvgate.bench.serve import RunConfig, run_once

SERVED = "demo"


@dataclass
class Sizes:
    rounds: int = 3  # each target figure is measured this many times in one run: min/median/max
    # client processes for the ramp: one asyncio process tops out near the bare server's rate on
    # this 2-core machine; two keep the client's CPU per process well under 1 (reported per level)
    client_processes: int = 2
    levels: tuple[int, ...] = (1, 4, 16, 64)
    engine_input: int = 32
    engine_output: int = 32
    overhead_requests: int = 50  # per path, mode and round; the paths take turns within a round
    overhead_input: int = 32
    overhead_output: int = 16
    ramp_start: float = 20.0
    ramp_factor: float = 1.5
    ramp_seconds: float = 3.0
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
        return cls(levels=(1, 4), engine_output=8, overhead_requests=10, ramp_seconds=1.0,
                   ramp_max=100.0, prefix_len=128, prefix_requests=8, mix_long_input=256, mix_short_requests=12,
                   added_requests=8)


class Bench:
    def __init__(self, model_dir: Path, procs: Processes, sizes: Sizes):
        self.model_dir, self.procs, self.sizes = model_dir, procs, sizes
        self.loadgen: LoadGenerator | None = None

    def close(self) -> None:
        if self.loadgen is not None:
            self.loadgen.close()

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
                        stream=stream, progress=sys.stdout.isatty(), headers=server.headers)
        return asyncio.run(run_once(cfg, *workload))

    def serve_from_processes(self, server: Server, workload, rate: float) -> dict:
        """Non-streamed requests at `rate` from the client processes (the ramp's load)."""
        if self.loadgen is None:
            self.loadgen = LoadGenerator(self.sizes.client_processes)
        cfg = RunConfig(url=server.url, model=SERVED, api_key=server.key, num_prompts=len(workload[0]),
                        request_rate=rate, stream=False, progress=False, headers=server.headers)
        return self.loadgen.run(cfg, *workload)

    # -- 1. paged vs naive ------------------------------------------------------------------
    def engines(self) -> dict:
        s = self.sizes
        opts = DatasetOptions(input_len=s.engine_input, output_len=s.engine_output)
        out = {"levels": list(s.levels), "input_len": s.engine_input, "output_len": s.engine_output}
        for engine in ("paged", "hf"):
            server = self.procs.kvgate(f"cmp1-{engine}", self.model_dir, engine)
            out[engine] = [self.serve(server, self.workload("random", max(8, 2 * c), opts, seed=c), c)
                           for c in s.levels]
            top = s.levels[-1]  # the target's level, measured once per round (the sweep was round 1)
            out.setdefault("top_rounds", {})[engine] = [out[engine][-1]["output_throughput"]] + [
                self.serve(server, self.workload("random", max(8, 2 * top), opts, seed=top + r), top)["output_throughput"]
                for r in range(1, s.rounds)]
            self.procs.stop(server.proc)
        top = s.levels[-1]  # for context: the same top level on the paged engine alone, in this process
        out["paged_inprocess_top"] = inprocess_throughput(
            self.model_dir, self.workload("random", max(8, 2 * top), opts, seed=top)[0], s.torch_threads)
        return out

    # -- 2. gateway overhead ----------------------------------------------------------------
    def gateways(self, peers: dict[str, Path | None], skipped: dict[str, str]) -> dict:
        """`peers`: where LiteLLM's venv and Portkey's folder are (None: not installed; `skipped`
        says why). Each round: latency with the paths taking turns, then each path's ramp."""
        servers = {"baseline": self.procs.baseline(self.model_dir)}
        if peers.get("litellm") is not None:
            servers["litellm"] = self.procs.litellm(peers["litellm"], servers["baseline"], SERVED)
        if peers.get("portkey") is not None:
            servers["portkey"] = self.procs.portkey(peers["portkey"], servers["baseline"], SERVED)
        servers["kvgate"] = self.procs.kvgate("cmp2-kvgate", self.model_dir, "synthetic")
        rounds = []
        for r in range(self.sizes.rounds):
            print(f"   gateways round {r + 1}/{self.sizes.rounds}", flush=True)
            latency = {mode: self._latency(servers, stream=mode == "stream", seed=100 + r) for mode in ("nostream", "stream")}
            rounds.append({"latency": latency, "ramp": {name: self._ramp(server, seed=7 + 10 * r)
                                                        for name, server in servers.items()}})
        for server in servers.values():
            self.procs.stop(server.proc)
        ceilings = [rd["ramp"]["baseline"]["max_sustained_rps"] for rd in rounds]
        for rd in rounds:  # a path that reached the bare server's figure was held back by the client
            for d in rd["ramp"].values():
                d["client_bound"] = d["max_sustained_rps"] >= rd["ramp"]["baseline"]["max_sustained_rps"]
        return {"rounds": rounds, "latency": _pooled([rd["latency"] for rd in rounds]), "skipped": skipped,
                "client_processes": self.sizes.client_processes, "client_ceiling_rps": ceilings}

    def _latency(self, servers: dict[str, Server], stream: bool, seed: int) -> dict:
        """One request at a time, each path in turn; TTFT and E2EL distributions (and the raw
        lists, to pool the rounds). One client process: at concurrency 1 it is far from busy."""
        s = self.sizes
        opts = DatasetOptions(input_len=s.overhead_input, output_len=s.overhead_output)
        out = {}
        for name, server in servers.items():
            run = self.serve(server, self.workload("random", s.overhead_requests, opts, seed=seed), 1, stream)
            out[name] = {"ttfts_ms": run["ttfts_ms"], "e2els_ms": run["e2els_ms"], "failed": run["failed"]}
        return {name: _distributions(d) for name, d in out.items()}

    def _ramp(self, server: Server, seed: int) -> dict:
        """Evenly spaced non-streamed requests from the client processes at a rate rising level by
        level. A level is kept up when nothing failed, completions kept pace (≥ 90% of the offered
        rate) and E2EL p99 stayed under 1 s; a missed level gets one more try (the machine is
        shared), a second miss ends the ramp. The figure is the last level kept up; each level
        records the client processes' CPU use (CPU-s per s, one per process)."""
        s = self.sizes
        opts = DatasetOptions(input_len=s.overhead_input, output_len=s.overhead_output)
        levels, rate, best = [], s.ramp_start, 0.0
        while rate <= s.ramp_max:
            for attempt in range(2):
                n = max(20, int(rate * s.ramp_seconds))
                run = self.serve_from_processes(
                    server, self.workload("random", n, opts, seed=seed + attempt, rate=rate, burstiness=1000.0), rate)
                kept = run["failed"] == 0 and run["request_throughput"] >= 0.9 * rate and run["p99_e2el_ms"] <= 1000
                levels.append({"offered": rate, "achieved": run["request_throughput"], "failed": run["failed"],
                               "p50_e2el_ms": run["p50_e2el_ms"], "p99_e2el_ms": run["p99_e2el_ms"], "kept_up": kept,
                               "client_cpu": run["client_cpu_s_per_s"]})
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
        rounds = []  # a p99 of ~90 requests is set by the worst burst: one round is one draw of it
        for r in range(s.rounds):
            seed = 4 + 10 * r
            alone = self.serve(server, self.workload("long-short", s.mix_short_requests,
                                                     replace(opts, long_fraction=0.0), seed, s.mix_short_rate),
                               dataset="long-short", rate=s.mix_short_rate)
            mixed = self.serve(server, self.workload("long-short", n, replace(opts, long_fraction=n_long / n), seed,
                                                     rate), dataset="long-short", rate=rate)
            rounds.append({"alone": alone, "mixed": mixed, "p99": {
                "alone_ms": alone["p99_ttft_ms"], "mixed_ms": mixed["by_label"]["short"]["p99_ttft_ms"]}})
        self.procs.stop(server.proc)
        middle = sorted(rounds, key=lambda d: d["p99"]["mixed_ms"] / max(d["p99"]["alone_ms"], 1e-9))[len(rounds) // 2]
        return {"alone": middle["alone"], "mixed": middle["mixed"], "short_p99_rounds": [d["p99"] for d in rounds],
                "short_rate": s.mix_short_rate, "long_rate": long_rate,
                "long_ttft_alone_ms": probe["p50_ttft_ms"], "long_busy": s.mix_long_busy,
                **{k: getattr(s, k) for k in ("mix_short_input", "mix_short_output", "mix_long_input",
                                              "mix_long_output")}}, added

    def added(self) -> dict:
        """The added TTFT alone, on a stack of its own (`--only added`)."""
        server = self.procs.kvgate("cmp4-paged", self.model_dir, "paged")
        try:
            return self._ttft_added(server)
        finally:
            self.procs.stop(server.proc)

    def _ttft_added(self, server: Server) -> dict:
        """Streamed TTFT through the stack vs the same prompts on the same engine in this process,
        once per round (the two taking turns)."""
        s = self.sizes
        opts = DatasetOptions(input_len=s.engine_input, output_len=s.added_output)
        self.serve(server, self.workload("random", 5, opts, seed=50), 1)  # warm-up
        engine = _engine(self.model_dir, s.torch_threads)
        rounds = []
        for r in range(s.rounds):
            requests, times = self.workload("random", s.added_requests, opts, seed=51 + r)
            through = self.serve(server, (requests, times), 1)
            local = inprocess_ttfts(engine, [q.prompt for q in requests], s.added_output)
            gateway, alone = distribution([v / 1000 for v in through["ttfts_ms"]]), distribution(local)
            rounds.append({"gateway": gateway, "inprocess": alone, "added_p50_ms": gateway["p50"] - alone["p50"],
                           "added_p99_ms": gateway["p99"] - alone["p99"]})
        middle = sorted(rounds, key=lambda d: d["added_p50_ms"])[len(rounds) // 2]
        return {**middle, "requests": s.added_requests, "rounds": rounds}


def _distributions(d: dict) -> dict:
    return {"ttft": distribution([v / 1000 for v in d["ttfts_ms"]]), "e2el": distribution([v / 1000 for v in d["e2els_ms"]]),
            "failed": d["failed"], "requests": len(d["ttfts_ms"]), "ttfts_ms": d["ttfts_ms"], "e2els_ms": d["e2els_ms"]}


def _pooled(rounds: list[dict]) -> dict:
    """Every round's requests together, per mode and path (the tables' figures)."""
    out = {}
    for mode in rounds[0]:
        out[mode] = {}
        for name in rounds[0][mode]:
            runs = [rd[mode][name] for rd in rounds]
            out[mode][name] = _distributions({"ttfts_ms": [v for d in runs for v in d["ttfts_ms"]],
                                              "e2els_ms": [v for d in runs for v in d["e2els_ms"]],
                                              "failed": sum(d["failed"] for d in runs)})
    return out


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


def inprocess_ttfts(engine, prompts: list[str], max_tokens: int) -> list[float]:
    """TTFT (s) of each prompt alone on the engine the worker builds: tokenize, add, step until its
    first token."""
    from worker.engine.tokenizer import encode_prompt
    from worker.engine.types import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ttfts = []
    for i, prompt in enumerate(["warm up the engine"] * 3 + prompts):
        start, first = time.perf_counter(), None
        engine.add_request(f"t{time.perf_counter_ns()}-{i}", encode_prompt(engine.tokenizer, prompt), params)
        while engine.has_unfinished():
            outputs = engine.step()
            if first is None and any(o.new_token_ids for o in outputs):
                first = time.perf_counter() - start
        if i >= 3:
            ttfts.append(first)
    return ttfts


def peers(args) -> tuple[dict[str, Path | None], dict[str, str]]:
    """Where each peer gateway is installed (None: skipped) and, for each skipped, why."""
    found, skipped = {"litellm": None, "portkey": None}, {}
    if args.skip_litellm:
        skipped["litellm"] = "--skip-litellm"
    else:
        found["litellm"] = ensure_litellm(Path(args.litellm_venv).resolve())
        if found["litellm"] is None:
            skipped["litellm"] = f"LiteLLM could not be installed into {args.litellm_venv} (see its .install.log)"
    if args.skip_portkey:
        skipped["portkey"] = "--skip-portkey"
    else:
        found["portkey"], reason = ensure_portkey(Path(args.portkey_dir).resolve())
        if reason:
            print(f"Portkey's comparison is skipped: {reason}", flush=True)
            skipped["portkey"] = reason
    return found, skipped


def main(argv: list[str] | None = None) -> int:
    from kvgate.bench.report import write_report
    from kvgate.up import default_model_dir

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke check, not figures)")
    ap.add_argument("--only", choices=sorted(ONLY), help="run only one part (overhead: the gateways; added: the "
                    "TTFT gateway + Redis add; engines: paged vs naive) and merge it into the last run's results "
                    "(OUT_DIR/results.json) if there is one, else write the report to OUT_DIR/docs")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per target figure [default: 3]")
    ap.add_argument("--client-processes", type=int, default=None, help="client processes for the ramp [default: 2]")
    ap.add_argument("--out-dir", default="bench-out/serve", help="logs and stack state")
    ap.add_argument("--docs", default="docs", help="where performance.md and perf/ are written")
    ap.add_argument("--litellm-venv", default="bench-out/litellm-venv")
    ap.add_argument("--skip-litellm", action="store_true")
    ap.add_argument("--portkey-dir", default="bench-out/portkey", help="where Portkey's gateway is installed (npm)")
    ap.add_argument("--skip-portkey", action="store_true")
    ap.add_argument("--from-results", help="only rewrite the report from a run's results.json")
    args = ap.parse_args(argv)
    if args.from_results:
        results = json.loads(Path(args.from_results).read_text())
        write_report(results, Path(args.docs), quick=results.get("quick", False))
        return 0
    started = time.monotonic()
    sizes = Sizes.quick() if args.quick else Sizes()
    sizes.rounds = args.rounds or sizes.rounds
    sizes.client_processes = args.client_processes or sizes.client_processes
    os.environ["OMP_NUM_THREADS"] = str(sizes.torch_threads)  # before torch loads here or in a child
    procs = Processes(Path(args.out_dir).resolve())
    bench = Bench(default_model_dir(), procs, sizes)
    found, skipped = peers(args)
    steps = [("engines", bench.engines), ("gateways", lambda: bench.gateways(found, skipped)),
             ("prefix", bench.prefix), ("mix_added", bench.mix_and_added)]
    raw = procs.log_dir / "results.json"
    results, docs = {}, Path(args.docs)
    if args.only:  # the other parts come from the last run, as they were
        steps = [(ONLY[args.only], dict(steps).get(ONLY[args.only], bench.added))]
        results, docs = earlier_run(raw, docs)
    results.update(loadavg_start=os.getloadavg()[0], cpu_model=cpu_model())  # the machine is shared: say how busy
    try:
        for name, step in steps:
            print(f"== {name} ({time.monotonic() - started:.0f}s)", flush=True)
            results[name] = step()
    finally:
        bench.close()
        procs.stop_all()
    if "mix_added" in results:
        results["mix"], results["ttft_added"] = results.pop("mix_added")
    results["sizes"] = sizes.__dict__
    results["elapsed_s"] = time.monotonic() - started
    results["loadavg_end"] = os.getloadavg()[0]
    results["quick"] = args.quick
    results["only"] = args.only
    raw.write_text(json.dumps(results) + "\n")  # raw, for --from-results and the next --only run
    write_report(results, docs, quick=args.quick)
    return 0


def earlier_run(raw: Path, docs: Path) -> tuple[dict, Path]:
    """An `--only` run's starting results and where its report goes: the last run's results beside
    the published docs, or none and a folder beside `raw` (a report of one part would replace the
    published table's other figures with "not measured")."""
    if raw.exists():
        return json.loads(raw.read_text()), docs
    print(f"no earlier run in {raw.parent}: the report goes to {raw.parent / 'docs'}, not {docs}", flush=True)
    return {}, raw.parent / "docs"


ONLY = {"overhead": "gateways", "added": "ttft_added", "engines": "engines"}  # --only: the results' part


def cpu_model() -> str:
    """lscpu's model name (the figures differ by CPU family)."""
    import subprocess

    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")),
                "unknown")


if __name__ == "__main__":
    raise SystemExit(main())
