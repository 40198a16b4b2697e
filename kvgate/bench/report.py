"""Turns one `make bench` run into docs/perf/bench.json, docs/perf/*.png and the serve section of
docs/performance.md (between its bench-serve markers; the rest of the file is left as it is)."""
from __future__ import annotations

import json
import os
import platform
import re
from datetime import datetime, timezone
from pathlib import Path

from kvgate.bench import plots as bench_plots

START, END = "<!-- bench-serve:start -->", "<!-- bench-serve:end -->"
TARGETS = {  # stable name (issue 25's): (comparison, target value, what it is)
    "overhead_p50_vs_portkey": ("<=", 1.0, "kvgate's added latency p50 ÷ Portkey's (worst of the three measures)"),
    "overhead_p50_vs_litellm": ("<=", 0.3, "kvgate's added latency p50 ÷ LiteLLM's (worst of the three measures)"),
    "rps_vs_litellm": (">=", 4.0, "highest sustained req/s, kvgate ÷ LiteLLM (one process each)"),
    "ttft_added_ms_p50": ("<=", 3.0, "TTFT p50 through gateway + Redis − in-process engine (ms)"),
    "vs_naive_c64": (">=", 10.0, "paged ÷ naive `hf` output tokens/s at concurrency 64"),
    "mix_short_ttft_p99_ratio": ("<=", 3.0, "short requests' TTFT p99 with long prompts ÷ alone"),
}
_LISTS = ("ttfts_ms", "e2els_ms", "labels")


def round_figures(r: dict) -> dict[str, list[float | None]]:
    """Each target figure once per round of the run (one value where a part has no rounds); a
    name is missing where its part did not run."""
    out = {}
    if eng := r.get("engines"):
        top = eng.get("top_rounds") or {e: [eng[e][-1]["output_throughput"]] for e in ("paged", "hf")}
        out["vs_naive_c64"] = [_ratio(p, h) for p, h in zip(top["paged"], top["hf"])]
    if gw := r.get("gateways"):
        rounds = gw.get("rounds") or [{"latency": gw["latency"], "ramp": gw["ramp"]}]
        for peer in ("portkey", "litellm"):
            out[f"overhead_p50_vs_{peer}"] = [_worst_ratio(overheads(rd["latency"]), peer) for rd in rounds]
        out["rps_vs_litellm"] = [_ratio(rd["ramp"]["kvgate"]["max_sustained_rps"], rd["ramp"]["litellm"]["max_sustained_rps"])
                                 if "litellm" in rd["ramp"] else None for rd in rounds]
    if added := r.get("ttft_added"):
        out["ttft_added_ms_p50"] = [d["added_p50_ms"] for d in added.get("rounds") or [added]]
    if mix := r.get("mix"):
        out["mix_short_ttft_p99_ratio"] = [_ratio(d["mixed_ms"], d["alone_ms"]) for d in _mix_rounds(mix)]
    return out


def _worst_ratio(added: dict, peer: str) -> float | None:
    """kvgate's added p50 ÷ the peer's, the worst (highest) of the measures; None if the peer did
    not run or added nothing measurable (a ratio to ≤ 0 says nothing)."""
    ratios = [_ratio(paths["kvgate"]["p50"], paths[peer]["p50"]) for paths in added.values() if peer in paths]
    return max(ratios) if ratios and None not in ratios else None


def spread(values: list[float | None]) -> dict | None:
    """min / median / max of a figure's rounds (None if any round could not measure it)."""
    if not values or None in values:
        return None
    ordered = sorted(values)
    return {"min": ordered[0], "median": ordered[len(ordered) // 2], "max": ordered[-1], "runs": values}


def figures(r: dict) -> dict:
    """The stable numbers (each the median of its rounds); None where a comparison could not run."""
    spreads = {name: spread(values) for name, values in round_figures(r).items()}
    return {name: (spreads[name] or {}).get("median") if name in spreads else None for name in TARGETS}


def _ratio(a: float, b: float) -> float | None:
    return a / b if b and b > 0 else None


def _mix_rounds(mix: dict) -> list[dict]:
    """Short requests' TTFT p99 alone and beside long prompts, per round (one, in older results)."""
    return mix.get("short_p99_rounds") or [{"alone_ms": mix["alone"]["p99_ttft_ms"],
                                            "mixed_ms": mix["mixed"]["by_label"]["short"]["p99_ttft_ms"]}]


def overheads(latency: dict) -> dict:
    """Added latency (path − bare baseline) per measure and path: {measure: {path: {p50, p99}}}."""
    measures = {"non-streamed E2EL": ("nostream", "e2el"), "streamed TTFT": ("stream", "ttft"),
                "streamed E2EL": ("stream", "e2el")}
    out = {}
    for label, (mode, metric) in measures.items():
        base = latency[mode]["baseline"][metric]
        out[label] = {path: {p: d[metric][p] - base[p] for p in ("p50", "p99")}
                      for path, d in latency[mode].items() if path != "baseline"}
    return out


def met(name: str, value: float | None) -> str:
    if value is None:
        return "not measured"
    op, target, _ = TARGETS[name]
    return "met" if (value >= target if op == ">=" else value <= target) else "**not met**"


def write_report(r: dict, docs: Path, quick: bool = False) -> None:
    perf = docs / "perf"
    perf.mkdir(parents=True, exist_ok=True)
    figs = figures(r)
    spreads = {name: spread(values) for name, values in round_figures(r).items()}
    plots = make_plots(r, perf)
    stripped = _strip_lists(r)
    (perf / "bench.json").write_text(json.dumps({**figs, "spread": spreads,
                                                 "targets": {k: [v[0], v[1]] for k, v in TARGETS.items()},
                                                 "machine": {"cpu_model": r.get("cpu_model"), "cores": os.cpu_count(),
                                                             "loadavg_start": r.get("loadavg_start"),
                                                             "loadavg_end": r.get("loadavg_end")},
                                                 "client": _client(r.get("gateways")),
                                                 "skipped": (r.get("gateways") or {}).get("skipped", {}),
                                                 "quick": quick, "results": stripped}, indent=1) + "\n")
    section = markdown(r, figs, spreads, [p.relative_to(docs) for p in plots], quick)
    path = docs / "performance.md"
    text = path.read_text() if path.exists() else "# kvgate performance\n"
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
    block = f"{START}\n{section}\n{END}"
    path.write_text(pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n")
    print(f"wrote {path}, {perf / 'bench.json'} and {len(plots)} plots")
    for name, value in figs.items():
        print(f"  {name} = {_fmt(value)} {_spread_text(spreads.get(name))} ({met(name, value)})")


def _client(gw: dict | None) -> dict | None:
    """The load generator and where it saturates: the bare server's highest sustained rate is the
    client's ceiling (no path can be measured above it)."""
    if not gw or "rounds" not in gw:
        return None
    return {"processes": gw["client_processes"], "ceiling_rps": gw["client_ceiling_rps"],
            "client_bound": {name: [rd["ramp"][name]["client_bound"] for rd in gw["rounds"]]
                             for name in gw["rounds"][0]["ramp"] if name != "baseline"}}


def _strip_lists(obj):
    if isinstance(obj, dict):
        return {k: _strip_lists(v) for k, v in obj.items() if k not in _LISTS}
    if isinstance(obj, list):
        return [_strip_lists(v) for v in obj]
    return obj


def make_plots(r: dict, perf: Path) -> list[Path]:
    """The plots of the parts that ran."""
    paths = []
    if eng := r.get("engines"):
        levels = eng["levels"]
        paths += [
            bench_plots.against_concurrency({e: (levels, [x["output_throughput"] for x in eng[e]]) for e in ("paged", "hf")},
                                            "output tokens/s", perf / "engines_throughput.png",
                                            "Paged vs naive hf worker, behind the gateway", log_y=True),
            bench_plots.against_concurrency({e: (levels, [x["p99_ttft_ms"] for x in eng[e]]) for e in ("paged", "hf")},
                                            "TTFT p99 (ms)", perf / "engines_ttft_p99.png", "TTFT p99 against concurrency",
                                            log_y=True)]
    if gw := r.get("gateways"):
        paths += [bench_plots.grouped_bars({measure: {path: v["p50"] for path, v in d.items()}
                                            for measure, d in overheads(gw["latency"]).items()},
                                           "added latency p50 (ms)", perf / "gateway_overhead.png",
                                           "Latency added over the bare server (p50)"),
                  _ramp_plot(_last_ramp(gw), perf / "gateway_ramp.png")]
    if pre := r.get("prefix"):
        paths.append(bench_plots.ttft_cdf({f"prefix caching {k}": pre[k]["ttfts_ms"] for k in ("on", "off")},
                                          perf / "prefix_ttft_cdf.png", "Shared-prefix workload: TTFT CDF"))
    if mix := r.get("mix"):
        paths.append(bench_plots.ttft_cdf(_mix_series(mix), perf / "mix_ttft_cdf.png", "Short requests: TTFT CDF"))
    return paths


def _last_ramp(gw: dict) -> dict:
    return gw["rounds"][-1]["ramp"] if gw.get("rounds") else gw["ramp"]


def _mix_series(mix: dict) -> dict:
    mixed = mix["mixed"]
    return {"short, alone": mix["alone"]["ttfts_ms"],
            "short, with long prompts": [t for t, lb in zip(mixed["ttfts_ms"], mixed["labels"]) if lb == "short"],
            "long": [t for t, lb in zip(mixed["ttfts_ms"], mixed["labels"]) if lb == "long"]}


def _ramp_plot(ramp: dict, path: Path) -> Path:
    plt = bench_plots._pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, d in ramp.items():
        ax.plot([lv["offered"] for lv in d["levels"]], [lv["achieved"] for lv in d["levels"]], marker="o", label=name)
    top = max((lv["offered"] for d in ramp.values() for lv in d["levels"]), default=1)
    ax.plot([0, top], [0, top], ls=":", color="grey", label="offered = achieved")
    ax.set(xlabel="offered requests/s", ylabel="completed requests/s", title="One process under a rising rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return bench_plots._save(fig, path)


def _fmt(v, digits: int = 2) -> str:
    if v is None:
        return "—"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def markdown(r: dict, figs: dict, spreads: dict, plots: list[Path], quick: bool) -> str:
    only = f" (`--only {r['only']}`: that part measured now, the rest from the last full run)" if r.get("only") else ""
    lines = [
        "## Serving benchmark (`make bench`)", "",
        f"Generated by `make bench` (`kvgate/bench/compare.py`) on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC "
        f"in {r['elapsed_s'] / 60:.1f} min{only}{' — QUICK sizes, not figures to quote' if quick else ''}. Machine: "
        f"{os.cpu_count()} CPU cores ({r.get('cpu_model') or platform.machine()}), no GPU, shared with other jobs{_load(r)}; client, "
        "servers and Redis all on it. Model: the random-weight demo Llama (`kvgate demo-model`; 4 layers, hidden 256, "
        "vocab 2048), fp32 on CPU, one torch thread per engine process (`OMP_NUM_THREADS=1`: with two, a "
        "worker sharing the two cores with client, gateway and Redis ran its first token ~40× slower). Metrics are client-side, with vLLM `bench serve`'s definitions "
        "(`kvgate bench serve`; see `kvgate/bench/metrics.py`). Figures in `docs/perf/bench.json`. Each target "
        f"figure was measured in {r.get('sizes', {}).get('rounds', 1)} rounds within the run: the figure is their "
        "median, with min / max beside it; ratios within one run are what compare.", "",
        "| figure | target | measured (median) | min / max of the rounds | |", "| --- | --- | --- | --- | --- |",
    ]
    for name, (op, target, what) in TARGETS.items():
        lines.append(f"| `{name}`: {what} | {op.replace('>=', '≥').replace('<=', '≤')} {target:g} | "
                     f"{_fmt(figs[name])} | {_spread_text(spreads.get(name))} | {met(name, figs[name])} |")
    parts = (("engines", _engines_md), ("gateways", _gateways_md), ("prefix", _prefix_md), ("mix", _mix_md),
             ("ttft_added", _added_md))
    lines += [line for key, part in parts if key in r for line in part(r[key])]
    lines += ["", " ".join(f"![{p.stem}]({p.as_posix()})" for p in plots)]
    lines += ["", "### Measuring a server yourself", "",
              "`kvgate bench serve` is the client all of the above used; it talks to any OpenAI-compatible "
              "`/v1/completions` (URL, key and tokenizer default to what `kvgate up` wrote in `.kvgate/`):", "",
              "```sh",
              "kvgate bench serve --dataset random --num-prompts 200 --request-rate 20 --slo-ttft-ms 200 --slo-tpot-ms 50",
              "kvgate bench serve --dataset shared-prefix --sweep 1,4,16,64 --out run.json --plots plots/",
              "kvgate bench serve --dataset long-short --max-concurrency 16 --long-input-len 1024 --long-fraction 0.25",
              "kvgate up --engine synthetic   # no model: fixed tokens, for load tests of the serving path only",
              "```", "",
              "It prints a table, writes JSON (`--out`: every run's TTFT/TPOT/ITL/E2EL mean, median, std, p50/p90/p99 "
              "in ms, request and token throughput, goodput under the `--slo-*` given, per-class figures for mixed "
              "datasets) and PNGs (`--plots`: TTFT CDF; with `--sweep`, throughput and TTFT p99 against concurrency)."]
    return "\n".join(lines)


def _spread_text(d: dict | None) -> str:
    return f"{d['min']:.2f} / {d['max']:.2f}" if d and len(d["runs"]) > 1 else "—"


def _load(r: dict) -> str:
    if "loadavg_start" not in r:
        return ""
    return (f" (1-minute load average {r['loadavg_start']:.1f} at the start, {r['loadavg_end']:.1f} at the end; "
            "on a busy machine these figures swing by 2-3× from run to run)")


def _engines_md(e: dict) -> list[str]:
    lines = ["", "### 1. Paged engine vs the naive `hf` worker, same gateway", "",
             f"Random prompts of {e['input_len']} tokens, {e['output_len']} output tokens (`ignore_eos`), "
             "max(8, 2 × concurrency) requests per level, streamed.", "",
             "| concurrency | paged req/s | paged out tok/s | paged TTFT p99 ms | hf req/s | hf out tok/s | "
             "hf TTFT p99 ms | paged ÷ hf |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for c, p, h in zip(e["levels"], e["paged"], e["hf"]):
        lines.append(f"| {c} | {p['request_throughput']:.2f} | {p['output_throughput']:.0f} | {p['p99_ttft_ms']:.0f} | "
                     f"{h['request_throughput']:.2f} | {h['output_throughput']:.0f} | {h['p99_ttft_ms']:.0f} | "
                     f"{_fmt(_ratio(p['output_throughput'], h['output_throughput']), 1)}× |")
    if top := e.get("top_rounds"):
        lines += ["", f"At concurrency {e['levels'][-1]}, paged ÷ hf in each round: " + ", ".join(
            f"{_fmt(_ratio(p, h), 1)}×" for p, h in zip(top["paged"], top["hf"])) + "."]
    if alone := e.get("paged_inprocess_top"):
        lines += ["", f"For scale: the paged engine alone in one process, the same {alone['requests']} requests "
                  f"submitted at once, makes {alone['output_throughput']:.0f} output tokens/s; behind the gateway "
                  f"at concurrency {e['levels'][-1]} it made {e['paged'][-1]['output_throughput']:.0f}, every token "
                  "a Redis message and an SSE chunk, on the same two cores as the client."]
    return lines


def _gateways_md(g: dict) -> list[str]:
    lines = ["", "### 2. Gateway overhead, synthetic engine", "",
             "The synthetic engine (`--engine synthetic`: no model, one fixed token per request per step) served "
             "four ways: **baseline**, a bare OpenAI-compatible server around it in one process "
             "(`kvgate/bench/baseline.py`, bearer-key check); **litellm**, LiteLLM's proxy 1.108.7 (one worker, "
             "master key, deployment rpm/tpm limit enforced in memory by its `enforce_model_rate_limits` pre-call "
             "check; key-level limits would need its Postgres) in front of that server; **portkey**, Portkey's "
             "open-source gateway (npm `@portkey-ai/gateway` 1.15.2, one Node process) in front of that server, with "
             "the governance the open-source gateway has: a per-request config (provider, upstream, retries off) "
             "validated on every request and an input guardrail that denies any model but the served one "
             "(`default.modelWhitelist`) — it has no caller keys, rate limits or budgets (those are Portkey's hosted "
             "control plane), so it counts nothing against a shared limit, and streams only with a one-line fix to its "
             "@hono/node-server (see `kvgate/bench/portkey.py`); **kvgate**, gateway + Redis + one worker, with a key "
             "whose rpm/tpm limits are set (counted on every request, never hit) and the queue hop to the worker. "
             "One request at a time (one client process), the paths taking turns, every round; 32-token prompts, "
             "16 output tokens; the tables pool the rounds.", ""]
    if g.get("skipped"):
        lines += ["Skipped: " + "; ".join(f"**{name}**: {why}" for name, why in g["skipped"].items()) + ".", ""]
    lines += ["| mode | path | requests | TTFT p50 ms | TTFT p99 ms | E2EL p50 ms | E2EL p99 ms |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for mode, paths in g["latency"].items():
        for path, d in paths.items():
            lines.append(f"| {mode} | {path} | {d['requests']} | {d['ttft']['p50']:.2f} | {d['ttft']['p99']:.2f} | "
                         f"{d['e2el']['p50']:.2f} | {d['e2el']['p99']:.2f} |")
    lines += ["", "Added over the baseline (path − baseline), ms:", "",
              "| measure | path | added p50 | added p99 |", "| --- | --- | ---: | ---: |"]
    for measure, paths in overheads(g["latency"]).items():
        for path, v in paths.items():
            lines.append(f"| {measure} | {path} | {v['p50']:.2f} | {v['p99']:.2f} |")
    rounds = g.get("rounds") or [{"ramp": g["ramp"]}]
    lines += ["", f"Highest sustained rate, one server process each: evenly spaced non-streamed requests from "
              f"{g.get('client_processes', 1)} client processes (`--client-processes`) at a rate rising ×1.5 a level; "
              "kept up = no failure, completions ≥ 90% of the offered rate, E2EL p99 ≤ 1 s; a missed level is tried "
              "once more (the machine is shared), a second miss ends the ramp. The baseline's figure is the client's "
              "ceiling on this machine at that moment (client and server share the cores): a path that reaches it is "
              "marked client-bound; each level's client CPU (CPU-s per s, per process) says how near saturation the "
              "client processes were.", "",
              "| round | path | highest sustained req/s | levels tried (offered → completed req/s, E2EL p99 ms, client CPU; ✗ missed) |",
              "| --- | --- | ---: | --- |"]
    for i, rd in enumerate(rounds, 1):
        for path, d in rd["ramp"].items():
            levels = "; ".join(f"{lv['offered']:g} → {lv['achieved']:.0f} ({lv['p99_e2el_ms']:.0f}"
                               + (f", {max(lv['client_cpu']):.2f}" if lv.get("client_cpu") else "") + ")"
                               + ("" if lv["kept_up"] else " ✗") for lv in d["levels"])
            bound = " (client-bound)" if d.get("client_bound") and path != "baseline" else ""
            lines.append(f"| {i} | {path} | {d['max_sustained_rps']:g}{bound} | {levels} |")
    return lines


def _prefix_md(p: dict) -> list[str]:
    lines = ["", "### 3. Shared-prefix workload, prefix caching on vs off", "",
             f"4 shared prefixes of {p['prefix_len']} tokens, a unique {p['suffix_len']}-token suffix each, "
             f"{p['output_len']} output tokens, concurrency {p['concurrency']}, paged engine behind the gateway.", "",
             "| prefix caching | requests | TTFT p50 ms | TTFT p99 ms | E2EL p50 ms | req/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for k in ("on", "off"):
        d = p[k]
        lines.append(f"| {k} | {d['completed']} | {d['p50_ttft_ms']:.1f} | {d['p99_ttft_ms']:.1f} | "
                     f"{d['p50_e2el_ms']:.1f} | {d['request_throughput']:.2f} |")
    return lines


def _mix_md(m: dict) -> list[str]:
    short = m["mixed"]["by_label"]["short"]
    long_ = m["mixed"]["by_label"].get("long", {})
    return ["", "### 4. Short requests while long prompts arrive", "",
            f"Short: {m['mix_short_input']}-token prompts, {m['mix_short_output']} output tokens, Poisson at "
            f"{m['short_rate']:g} req/s. Mix: the same short stream plus long prompts of {m['mix_long_input']} tokens "
            f"({m['mix_long_output']} output tokens) at {m['long_rate']:.2f} req/s: a long prompt's TTFT alone was "
            f"{m['long_ttft_alone_ms']:.0f} ms here, and the rate is set so long prefills keep the engine about "
            f"{m['long_busy']:.0%} busy (feasible load: the figure is about scheduling, not overload).", "",
            "| run | class | requests | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | ITL p99 ms |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: |",
            _mix_row("alone", "short", m["alone"]), _mix_row("mix", "short", short),
            _mix_row("mix", "long", long_)] + (
        ["", "The table is the median round; short TTFT p99 with long prompts ÷ alone in each round: "
         + ", ".join(f"{d['mixed_ms']:.1f} ÷ {d['alone_ms']:.1f} ms" for d in m["short_p99_rounds"]) + "."]
        if m.get("short_p99_rounds") else [])


def _mix_row(run: str, label: str, d: dict) -> str:
    """A class's row; ITL p99 is a stream's worst gaps between tokens (a long step shows there)."""
    return (f"| {run} | {label} | {d.get('completed', 0)} | {d.get('p50_ttft_ms', 0):.1f} | "
            f"{d.get('p99_ttft_ms', 0):.1f} | {d.get('p50_tpot_ms', 0):.2f} | {d.get('p99_itl_ms', 0):.1f} |")


def _added_md(a: dict) -> list[str]:
    return ["", "### TTFT added by gateway + Redis", "",
            f"{a['requests']} prompts of 32 tokens, one at a time, streamed through the stack (paged engine); "
            "the same prompts on the same engine built the worker's way in the benchmark's own process "
            "(tokenize → add_request → step until the first token).", "",
            "| path | TTFT p50 ms | TTFT p99 ms |", "| --- | ---: | ---: |",
            f"| in-process engine | {a['inprocess']['p50']:.2f} | {a['inprocess']['p99']:.2f} |",
            f"| gateway + Redis + worker | {a['gateway']['p50']:.2f} | {a['gateway']['p99']:.2f} |",
            f"| added | {a['added_p50_ms']:.2f} | {a['added_p99_ms']:.2f} |", "",
            "The table is the median round; added p50 in each round, ms: "
            + ", ".join(f"{d['added_p50_ms']:.2f}" for d in a.get("rounds") or [a]) + "."]
