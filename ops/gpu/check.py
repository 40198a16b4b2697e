"""GPU check for the Triton path: kernel correctness in bf16, decode-attention bandwidth against the
GPU's peak and torch SDPA, and engine throughput against transformers.

    python ops/gpu/check.py [OUT_JSON] [--smoke] [--only SECTION,...] [--skip-engine]

Prints a table and writes flat JSON with stable names (decode_attn.bw_share, decode_attn.vs_sdpa,
engine.vs_sequential, engine.vs_static, engine.cuda_graph_speedup, engine.graphs_vs_eager.ok, ...).
Every section runs in a process of its own, in this order: correctness, decode_attn, then engine:
the transformers baselines (engine.hf), the engine eager (engine.eager), the engine with CUDA graphs
(engine.graphs); then tp: the engine over 2 GPUs (engine.tp; skipped, saying so, with one GPU
visible). A CUDA error is sticky for the process that hits it, so a graph capture that breaks
cannot void the baselines or the other variant. A section that fails or dies records its error and
the others still run; the JSON is rewritten as values arrive, so a run cut short by its time limit
still leaves what it measured. --smoke runs every section on tiny shapes on the CPU (Triton
interpreted), to check this script itself without a GPU.
"""
from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402

from check_common import GPU, SMOKE, Report, Scale, interpreter_problem  # noqa: E402

TARGETS = {"decode_attn.bw_share": 0.70, "engine.vs_sequential": 20.0, "engine.vs_static": 3.0}
GROUPS = {"correctness": ("correctness",), "decode_attn": ("decode_attn",),
          "engine": ("engine.hf", "engine.eager", "engine.graphs"), "tp": ("engine.tp",)}
STARTED = time.monotonic()


# ---------------------------------------------------------------- one section, in its own process

def run_section(name: str, s: Scale, part: Path, model_dir: Path, fault: str | None) -> None:
    """What a section's process does: measure, writing values to `part` as they come."""
    report = Report(part)
    report.put("env.device", torch.cuda.get_device_name() if s.device == "cuda" else "cpu", quiet=True)
    if fault == name:
        os.abort()  # test-only: a process that dies mid-check, as a sticky CUDA error would end it
    try:
        if name in ("correctness", "decode_attn"):
            import check_kernels

            section = {"correctness": check_kernels.correctness, "decode_attn": check_kernels.decode_bandwidth}
            section[name](report, s)
        elif name == "engine.tp":
            import check_engine

            check_engine.tp_variant(report, s, model_dir)
        elif name == "engine.hf":
            import check_engine

            check_engine.hf_baselines(report, s, model_dir)
        else:
            import check_engine

            check_engine.engine_variant(report, s, model_dir, name.split(".")[1])
    except Exception as exc:  # recorded here, so the parent sees why and not just an exit status
        traceback.print_exc()
        report.put(f"{name}.error", f"{type(exc).__name__}: {exc}"[:500])


# ---------------------------------------------------------------- the parent: sections in turn

def spawn_section(name: str, args, s: Scale, report: Report, tmp: Path, deadline: float) -> None:
    """Runs one section's process under its time limit, echoing its output, and merges its values."""
    limit = min(s.section_s[name], deadline - time.monotonic())
    print(f"== {name} (t={time.monotonic() - STARTED:.0f}s, limit {limit:.0f}s)", flush=True)
    if limit < 10:
        report.put(f"{name}.error", "skipped: the check's time budget is spent")
        return
    part = tmp / f"{name}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--section", name, "--part", str(part),
           "--model-dir", str(tmp / "model"), *(["--smoke"] if args.smoke else []),
           *(["--fault", args.fault] if args.fault else [])]
    status, last_lines = run_echoing(cmd, limit)
    values = json.loads(part.read_text()) if part.exists() else {}
    report.values.update(values)
    report.save()
    if status and f"{name}.error" not in values:
        report.put(f"{name}.error", f"{status}; last output: {' | '.join(last_lines)}"[:500])


def run_echoing(cmd: list[str], limit: float) -> tuple[str | None, list[str]]:
    """(why it failed or None, its last lines of output); killed after `limit` seconds."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timer = threading.Timer(limit, proc.kill)
    timer.start()
    last = collections.deque(maxlen=4)
    for line in proc.stdout:
        print(line, end="", flush=True)
        if line.strip():
            last.append(line.strip())
    returncode = proc.wait()
    killed = not timer.is_alive()
    timer.cancel()
    if killed:
        return f"killed at its {limit:.0f} s limit", list(last)
    return (f"process exited with status {returncode}" if returncode else None), list(last)


def summarise_engine(report: Report, s: Scale) -> None:
    """Ratios across the engine sections' processes, and eager vs graphs on the same prompts."""
    v = report.values
    eager, graphs = v.get("engine.eager.tokens_per_s"), v.get("engine.graphs.tokens_per_s")
    best = graphs or eager
    sequential, static = v.get("hf.sequential.tokens_per_s"), v.get("hf.static.tokens_per_s")
    report.put("engine.tokens_per_s", best)
    report.put("engine.cuda_graph_speedup", graphs / eager if graphs and eager else None)
    report.put("engine.vs_sequential", best / sequential if best and sequential else None)
    report.put("engine.vs_static", best / static if best and static else None)
    eager_steps, graph_steps = v.pop("engine.eager.greedy", None), v.pop("engine.graphs.greedy", None)
    if not (eager_steps and graph_steps):
        report.put("engine.graphs_vs_eager.ok", None)
        return
    import check_engine

    compared = check_engine.compare_greedy(eager_steps, graph_steps, s.logprob_tolerance)
    compared["ok"] = compared["ok"] and bool(v.get("engine.graphs.graph_steps"))  # graphs really ran
    for key, value in compared.items():
        report.put(f"engine.graphs_vs_eager.{key}", value)


def summarise_tp(report: Report, s: Scale) -> None:
    """TP 2 must generate what one GPU does (same tolerance as graphs vs eager); its throughput
    against the one-GPU graphs run."""
    v = report.values
    tp_steps, one_gpu = v.pop("engine.tp.greedy", None), v.get("engine.graphs.greedy")
    tp, graphs = v.get("engine.tp.tokens_per_s"), v.get("engine.graphs.tokens_per_s")
    report.put("engine.tp.vs_one_gpu", tp / graphs if tp and graphs else None)
    if not (tp_steps and one_gpu):
        return
    import check_engine

    compared = check_engine.compare_greedy(one_gpu, tp_steps, s.logprob_tolerance)
    for key in ("ok", "identical_tokens", "max_logprob_diff"):
        report.put(f"engine.tp_vs_one_gpu.{key}", compared[key])


def table(values: dict) -> str:
    rows = []
    for name in ("decode_attn.bw_share", "decode_attn.vs_sdpa", "engine.vs_sequential",
                 "engine.vs_static", "engine.cuda_graph_speedup"):  # then the rest, tp's among them
        value, target = values.get(name), TARGETS.get(name)
        verdict = "" if target is None or value is None else ("PASS" if value >= target else "MISS")
        shown = "n/a" if value is None else f"{value:.3g}"
        rows.append(f"| {name} | {shown} | {'' if target is None else f'>= {target:g}'} | {verdict} |")
    shown_too = (".ok", ".error", ".skipped", "vs_one_gpu", "comm_share", "tokens_per_s", "tb_per_s", "jit_compiles_timed", "graph_steps",
                 "identical_tokens", "max_logprob_diff")
    for name, value in sorted(values.items()):
        if name.endswith(shown_too) and name not in TARGETS:
            rows.append(f"| {name} | {value if not isinstance(value, float) else f'{value:.4g}'} | | |")
    return "\n".join(["| metric | value | target | |", "| --- | --- | --- | --- |", *rows])


def sections(args) -> list[str]:
    groups = args.only.split(",") if args.only else list(GROUPS)
    if args.skip_engine:
        groups = [g for g in groups if g != "engine"]
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        raise SystemExit(f"unknown section {unknown}: choose from {', '.join(GROUPS)}")
    return [name for g in groups for name in GROUPS[g]]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", help="JSON path (default docs/perf/gpu-check.json, "
                        "bench-out/gpu-check-smoke.json with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--only", help=f"comma-separated groups of sections: {', '.join(GROUPS)}")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--fault", help="test-only: the named section's process aborts at its start")
    parser.add_argument("--section", help=argparse.SUPPRESS)  # the parent starts one process per section
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    scale = SMOKE if args.smoke else GPU
    if args.section:
        run_section(args.section, scale, Path(args.part), Path(args.model_dir), args.fault)
        return 0
    import numpy
    import triton

    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device; use --smoke to check this script on the CPU", file=sys.stderr)
        return 2
    problem = interpreter_problem(triton.__version__, numpy.__version__) if args.smoke else None
    if problem:
        print(f"--smoke needs Triton's interpreter, but {problem}", file=sys.stderr)
        return 2
    names = sections(args)
    default = "bench-out/gpu-check-smoke.json" if args.smoke else "docs/perf/gpu-check.json"
    report = Report(Path(args.out or ROOT / default))
    for key, value in (("env.torch", torch.__version__), ("env.triton", triton.__version__),
                       ("env.numpy", numpy.__version__), ("env.python", sys.version.split()[0])):
        report.put(key, value)
    deadline = STARTED + scale.budget_s
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for name in names:
            spawn_section(name, args, scale, report, Path(tmp), deadline)
        if "engine.tp" in names:  # first: it reads the graphs run's greedy tokens, which the next pops
            summarise_tp(report, scale)
        if "engine.hf" in names:
            summarise_engine(report, scale)
    report.put("env.seconds", round(time.monotonic() - STARTED, 1))
    print()
    print(table(report.values))
    print(f"\nwrote {report.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
