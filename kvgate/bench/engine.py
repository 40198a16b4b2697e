"""`kvgate bench engine`: the paged engine against transformers in one process, on a random ~58M
Llama built for the run or on any model folder (`--model DIR`), in the dtype the engine picks.

W1 throughput: output tokens/s of transformers one request at a time, transformers in left-padded
static batches of 8, and the engine with every request submitted at once; plus the engine's
FLOP/s in steady decode against a torch.mm peak measured in the same run (and against the peak of
the GEMM the engine itself uses, oneDNN on CPU, which on some CPUs is twice torch.mm's).
W2 prefix cache: sequential requests sharing a long prefix, TTFT p50 with caching on vs off.
W3 KV efficiency: peak concurrency at a fixed KV budget vs reserving max_model_len per sequence,
and the share of allocated KV slots that hold live tokens.
With --tensor-parallel-size N, instead: W1's requests through the engine at TP 1 and at TP N on the
same cores (each rank takes its share of the threads), and at TP N the time rank 0 spends in
communication (the plan broadcast and the layers' collectives, waits for the other ranks
included), in ms per step and as a share of the step.
"""
from __future__ import annotations

import json
import platform
import random
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.engine.engine import LLMEngine
from worker.engine.kv_budget import cdiv
from worker.engine.types import SamplingParams
from worker.models.config import read_model_config

MODEL = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
             intermediate_size=1408, vocab_size=32000, max_position_embeddings=2048)
# Offline throughput runs take the GPU-sized step budget (the CPU serving default, 256, trades a
# little throughput for short prompts' TTFT beside long ones); the published table was measured so.
STEP_BUDGET = 2048
MAX_LEN = 2048  # every workload's context (capped by the model's): W3's reservation is in these
TARGETS = {"w1.vs_sequential": (">=", 8.0), "w1.vs_static": (">=", 3.0), "w1.flops_share": (">=", 0.5),
           "w2.ttft_ratio": ("<=", 0.1), "w2.hit_rate": None, "w3.concurrency_ratio": (">=", 5.0),
           "w3.slot_use": (">=", 0.95)}


@dataclass
class Sizes:
    w1_requests: int = 64
    w1_prompt: tuple[int, int] = (16, 128)
    w1_output: tuple[int, int] = (32, 256)
    w2_requests: int = 32
    w2_prefix: int = 1024
    w2_output: int = 32
    w3_reserved_seqs: int = 4  # the KV budget, in max_model_len-long sequences

    @classmethod
    def quick(cls) -> Sizes:
        return cls(w1_requests=12, w1_prompt=(16, 64), w1_output=(8, 24), w2_requests=6, w2_prefix=512,
                   w2_output=4, w3_reserved_seqs=1)


def build_model(path: Path) -> Path:
    """Random weights, fixed seed; the demo tokenizer (the benchmark feeds token ids)."""
    import transformers

    from worker.models.demo import train_tokenizer

    tokenizer = train_tokenizer()
    config = transformers.LlamaConfig(**MODEL, bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def w1_requests(sizes: Sizes, vocab_size: int, seed: int = 1) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(100, vocab_size) for _ in range(rng.randint(*sizes.w1_prompt))],
             rng.randint(*sizes.w1_output)) for _ in range(sizes.w1_requests)]


def cpu_name() -> str:
    """lscpu's model name (what a reader compares machines by), else /proc/cpuinfo's, else Python's."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    try:
        out += open("/proc/cpuinfo").read()
    except OSError:
        pass
    for line in out.splitlines():
        if line.lower().startswith("model name") and ":" in line:
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def mm_peak(n: int = 2048, reps: int = 5) -> float:
    """Best-of-reps fp32 torch.mm FLOP/s on this machine with the current thread count."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return _gemm_peak(lambda: torch.mm(a, b), n, reps)


def engine_gemm_peak(kernel=None, n: int = 2048, reps: int = 5) -> float:
    """The same for the GEMM path the engine's linears took (gemm_probe.py; default: oneDNN on CPU),
    which can beat torch.mm."""
    from worker.models.linear import DEFAULT, Linear, use_kernel

    layer, x = Linear(n, n, bias=False), torch.randn(n, n)
    use_kernel(layer, kernel or DEFAULT)
    with torch.inference_mode():
        return _gemm_peak(lambda: layer(x), n, reps)


def _gemm_peak(fn, n: int, reps: int) -> float:
    fn()
    return 2 * n ** 3 / min(_timed(fn) for _ in range(reps))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@torch.inference_mode()
def hf_sequential(model, reqs) -> float:
    def run():
        for prompt, n in reqs:
            model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return sum(n for _, n in reqs) / _timed(run)


@torch.inference_mode()
def hf_static(model, reqs, batch: int = 8) -> float:
    """Left-padded batches run to their longest output; only the requested tokens count."""
    def run():
        for i in range(0, len(reqs), batch):
            group = reqs[i:i + batch]
            width = max(len(p) for p, _ in group)
            ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in group])
            n = max(n for _, n in group)
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return sum(n for _, n in reqs) / _timed(run)


def matmul_params(engine: LLMEngine) -> int:
    """Weights that take part in a matmul per token: every layer plus lm_head, not the embedding lookup
    (a weight in the native GEMM's panels counts its real output width, not the padding); of a
    mixture of experts' experts, the top k a token goes through."""
    moe = engine.model_config.moe
    total = 0.0
    for name, p in engine.runner.model.named_parameters():
        if p.dim() >= 2 and "embed_tokens" not in name:
            size = p.n_out * p.shape[1] if p.dim() == 3 else p.numel()
            total += size * moe.top_k / moe.num_experts if moe is not None and ".experts." in name else size
    return round(total)


def run_engine(engine: LLMEngine, reqs, on_step=None) -> dict:
    """All requests at once; time every step, and note the decode-only ones for FLOP accounting."""
    cfg = engine.model_config
    per_token = 2 * matmul_params(engine)
    attn_per_ctx = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim  # QK^T and PV, per context token
    start = time.perf_counter()
    for i, (prompt, n) in enumerate(reqs):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    decode_steps, tokens, steps = [], 0, 0
    while engine.has_unfinished():
        steps += 1
        running = engine.scheduler.running
        decode_only = not engine.scheduler.waiting and all(s.num_tokens - s.num_computed_tokens == 1 for s in running)
        flops = len(running) * per_token + attn_per_ctx * sum(s.num_tokens for s in running)
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        tokens += sum(len(o.new_token_ids) for o in outs)
        if decode_only and running:
            decode_steps.append((len(running), flops, dt))
        if on_step:
            on_step(engine)
    return {"tokens": tokens, "seconds": time.perf_counter() - start, "decode_steps": decode_steps,
            "steps": steps}


def workload_1(model_dir: Path, sizes: Sizes) -> dict:
    """The pool holds every request at once: W1 measures throughput, not preemption."""
    from transformers import AutoModelForCausalLM

    cfg = read_model_config(model_dir)
    reqs = w1_requests(sizes, cfg.vocab_size)
    peak = mm_peak()
    max_len = min(MAX_LEN, cfg.max_context)
    blocks = max(sum(cdiv(len(p) + n, 16) for p, n in reqs), cdiv(max_len, 16))
    engine = LLMEngine.from_model_dir(model_dir, num_blocks=blocks, block_size=16, max_model_len=max_len,
                                      max_num_seqs=256, max_num_batched_tokens=STEP_BUDGET)
    run_engine(engine, reqs[:4])  # warm-up
    result = run_engine(engine, reqs)
    engine_tps = result["tokens"] / result["seconds"]
    params = matmul_params(engine)
    kernels, prefetch = engine.runner.kernels, engine.runner.decode_prefetch
    embed_params = engine.runner.model.model.embed_tokens.weight.numel()
    dtype = engine.runner.dtype
    del engine
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    hf.generation_config.pad_token_id = 0
    static_tps = hf_static(hf, reqs)
    seq_tps = hf_sequential(hf, reqs)
    peak = max(peak, mm_peak())  # the better of before and after: load from elsewhere only lowers it
    gemm_peak = max(peak, engine_gemm_peak(kernels.kernel))
    shares = decode_flops(result["decode_steps"], peak, 2 * embed_params)
    shares["flops_share_vs_engine_gemm_peak"] = shares["decode_flops"] / gemm_peak
    return {
        "dtype": str(dtype).removeprefix("torch."), "requests": len(reqs), "output_tokens": result["tokens"], "sequential_tok_s": seq_tps,
        "static_tok_s": static_tps, "engine_tok_s": engine_tps, "vs_sequential": engine_tps / seq_tps,
        "vs_static": engine_tps / static_tps, "mm_peak_flops": peak, "engine_gemm_peak_flops": gemm_peak,
        "matmul_params": params, "linear_kernel": kernels.label(), "linear_kernel_source": kernels.source,
        "linear_kernel_timings_ms": kernels.timings_ms, "decode_prefetch": prefetch, **shares,
    }


def decode_flops(steps: list[tuple[int, float, float]], peak: float, embed_flops_per_token: int) -> dict:
    """Steady decode: decode-only steps whose batch is at least half its peak (W1's batch drains as
    requests finish). FLOPs are the matmuls' (2 x weights, lm_head included, the embedding lookup
    not) plus QK^T and PV; `flops_share_2x_all_params` counts 2 x every parameter instead."""
    full = max((b for b, _, _ in steps), default=0)

    def rate(selected, extra_per_token=0):
        flops = sum(f + b * extra_per_token for b, f, _ in selected)
        return flops / max(sum(t for _, _, t in selected), 1e-9)

    steady = [s for s in steps if s[0] >= full / 2]
    flops = rate(steady)
    return {"decode_flops": flops, "flops_share": flops / peak, "steady_decode_steps": len(steady),
            "flops_share_full_batch": rate([s for s in steps if s[0] == full]) / peak,
            "flops_share_all_decode_steps": rate(steps) / peak,
            "flops_share_2x_all_params": rate(steady, embed_flops_per_token) / peak}


def workload_2(model_dir: Path, sizes: Sizes) -> dict:
    """Sequential requests: a pool of four requests' blocks keeps the shared prefix cached."""
    rng, cfg = random.Random(2), read_model_config(model_dir)
    prefix = [rng.randrange(100, cfg.vocab_size) for _ in range(sizes.w2_prefix)]
    prompts = [prefix + [rng.randrange(100, cfg.vocab_size) for _ in range(32)] for _ in range(sizes.w2_requests)]
    max_len = min(MAX_LEN, cfg.max_context)
    blocks = max(4 * cdiv(len(prompts[0]) + sizes.w2_output, 16), cdiv(max_len, 16))
    out = {}
    for caching in (True, False):
        engine = LLMEngine.from_model_dir(model_dir, enable_prefix_caching=caching, num_blocks=blocks,
                                          block_size=16, max_model_len=max_len,
                                          max_num_batched_tokens=STEP_BUDGET)
        ttfts = [_ttft(engine, str(i), p, sizes.w2_output) for i, p in enumerate(prompts)]
        out["on" if caching else "off"] = statistics.median(ttfts)
        if caching:
            stats = engine.stats()
            out["hit_rate"] = stats["prefix_cache_hits"] / max(stats["prefix_cache_queries"], 1)
    return {"requests": len(prompts), "prefix_tokens": len(prefix), "ttft_p50_on_s": out["on"],
            "ttft_p50_off_s": out["off"], "ttft_ratio": out["on"] / out["off"], "hit_rate": out["hit_rate"]}


def _ttft(engine: LLMEngine, request_id: str, prompt: list[int], max_tokens: int) -> float:
    """Seconds to the first token; then the request runs to its end before the next one starts."""
    start = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    first = None
    while engine.has_unfinished():
        outs = engine.step()
        if first is None and any(o.new_token_ids for o in outs):
            first = time.perf_counter() - start
    return first


def workload_3(model_dir: Path, sizes: Sizes) -> dict:
    """A pool of w3_reserved_seqs sequences of max_len tokens: how many run at once when blocks
    are allocated as sequences grow, against that many when each reserves its whole context."""
    cfg = read_model_config(model_dir)
    max_len = min(MAX_LEN, cfg.max_context)
    blocks = sizes.w3_reserved_seqs * cdiv(max_len, 16)
    engine = LLMEngine.from_model_dir(model_dir, num_blocks=blocks, block_size=16, max_model_len=max_len,
                                      max_num_seqs=256, max_num_batched_tokens=STEP_BUDGET)
    samples = {"peak": 0, "live": 0, "allocated": 0}

    def sample(e: LLMEngine) -> None:
        running = e.scheduler.running
        samples["peak"] = max(samples["peak"], len(running))
        samples["live"] += sum(s.num_computed_tokens for s in running)
        samples["allocated"] += sum(len(s.block_table) for s in running) * e.pool.block_size

    run_engine(engine, w1_requests(sizes, cfg.vocab_size), on_step=sample)
    reserved = sizes.w3_reserved_seqs
    return {"kv_budget_bytes": engine.kv_cache.bytes, "max_model_len": max_len, "reserved_seqs": reserved,
            "peak_concurrent": samples["peak"], "concurrency_ratio": samples["peak"] / reserved,
            "slot_use": samples["live"] / max(samples["allocated"], 1),
            "num_preemptions": engine.stats()["num_preemptions"]}


def workload_tp(model_dir: Path, sizes: Sizes, size: int, reps: int = 3) -> dict:
    """W1's requests at TP 1 and TP `size`, the engine alone (transformers is not the question).
    Both engines live side by side and take turns, best of `reps` each: a load that comes and goes
    on the host then hits both alike."""
    cfg = read_model_config(model_dir)
    reqs = w1_requests(sizes, cfg.vocab_size)
    max_len = min(MAX_LEN, cfg.max_context)
    blocks = max(sum(cdiv(len(p) + n, 16) for p, n in reqs), cdiv(max_len, 16))
    threads = torch.get_num_threads()
    engines = {n: LLMEngine.from_model_dir(model_dir, num_blocks=blocks, block_size=16, max_model_len=max_len,
                                           max_num_seqs=256, max_num_batched_tokens=STEP_BUDGET,
                                           tensor_parallel_size=n) for n in (size, 1)}
    share = max(1, threads // size)  # what RankProcesses gave each rank
    # (label, engine, threads): TP 1 on all the threads, TP N, and TP 1 on one rank's share of them
    runs = [("tp1", engines[1], threads), (f"tp{size}", engines[size], share), (f"tp1_{share}t", engines[1], share)]
    best: dict[str, dict] = {}
    try:
        for rep in range(reps + 1):  # the first: warm-up
            for label, engine, n_threads in runs:
                torch.set_num_threads(n_threads)
                comm_before = engine.runner.shard.comm_seconds
                result = run_engine(engine, reqs[:4] if rep == 0 else reqs)
                result["comm"] = engine.runner.shard.comm_seconds - comm_before
                if rep and (label not in best or result["seconds"] < best[label]["seconds"]):
                    best[label] = result
    finally:
        engines[size].close()
        torch.set_num_threads(threads)
    out = {label: {"tok_s": r["tokens"] / r["seconds"], "steps": r["steps"], "step_ms": 1e3 * r["seconds"] / r["steps"],
                   "comm_ms_per_step": 1e3 * r["comm"] / r["steps"], "comm_share": r["comm"] / r["seconds"]}
           for label, r in best.items()}
    return {"size": size, "requests": len(reqs), "threads": threads, "rank_threads": share, "reps": reps,
            "runs": out, "speedup": out[f"tp{size}"]["tok_s"] / out["tp1"]["tok_s"]}


def run_bench(quick: bool = False, out_json: str | None = "bench_engine.json",
              model_dir: str | Path | None = None, tensor_parallel_size: int = 1) -> dict:
    """On `model_dir`, or on the random Llama of MODEL built for the run; with a tensor-parallel
    size above 1, the TP comparison alone."""
    sizes = Sizes.quick() if quick else Sizes()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(model_dir) if model_dir else build_model(Path(tmp) / "bench-llama")
        report = {"quick": quick, "cpu": cpu_name(), "threads": torch.get_num_threads(),
                  "model": describe_model(path) if model_dir else MODEL}
        if tensor_parallel_size > 1:
            report["tp"] = workload_tp(path, sizes, tensor_parallel_size)
        else:
            report.update(w1=workload_1(path, sizes), w2=workload_2(path, sizes), w3=workload_3(path, sizes))
    print(format_tp_table(report) if "tp" in report else format_table(report))
    if out_json:
        Path(out_json).parent.mkdir(parents=True, exist_ok=True)
        Path(out_json).write_text(json.dumps(report, indent=2))
    return report


def describe_model(model_dir: Path) -> dict:
    cfg = read_model_config(model_dir)
    return {"dir": str(model_dir), "arch": cfg.arch, "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "intermediate_size": cfg.intermediate_size,
            "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_position_embeddings,
            "checkpoint_dtype": cfg.dtype}


def format_table(report: dict) -> str:
    rows = ["quick run: smaller workloads, the targets are for the full run"] if report["quick"] else []
    rows.append(f"on {report['cpu']}, {report['threads']} torch threads; model "
                f"{Path(report['model'].get('dir', 'random Llama')).name}")
    rows.append(f"{'metric':<22}{'value':>12}  {'target':<8}{'met':<4}")
    for name, target in TARGETS.items():
        section, key = name.split(".")
        value = report[section][key]
        if target is None:
            rows.append(f"{name:<22}{value:>12.3f}  {'-':<8}-")
            continue
        op, bound = target
        met = value >= bound if op == ">=" else value <= bound
        rows.append(f"{name:<22}{value:>12.3f}  {op}{bound:<6}{'yes' if met else 'NO':<4}")
    w1 = report["w1"]
    rows.append(f"tok/s: sequential {w1['sequential_tok_s']:.1f}, static {w1['static_tok_s']:.1f}, "
                f"engine {w1['engine_tok_s']:.1f}; decode {w1['decode_flops'] / 1e9:.1f} GFLOP/s "
                f"vs torch.mm peak {w1['mm_peak_flops'] / 1e9:.1f} (engine GEMM peak "
                f"{w1['engine_gemm_peak_flops'] / 1e9:.1f}: {w1['flops_share_vs_engine_gemm_peak']:.0%}); "
                f"linear kernel {w1['linear_kernel']}, decode prefetch {w1.get('decode_prefetch', '-')}")
    return "\n".join(rows)


def format_tp_table(report: dict) -> str:
    tp = report["tp"]
    n = tp["size"]
    rows = ["quick run: smaller workloads"] if report["quick"] else []
    rows.append(f"W1, {tp['requests']} requests, engine alone, best of {tp['reps']}, on {report['cpu']}, "
                f"{tp['threads']} torch threads shared by the ranks; model {Path(report['model'].get('dir', 'random Llama')).name}")
    rows.append(f"{'':<9}{'tok/s':>7}{'steps':>8}{'ms/step':>10}{'comm ms/step':>14}{'comm share':>12}")
    for key, r in tp["runs"].items():
        rows.append(f"{key:<9}{r['tok_s']:>7.1f}{r['steps']:>8}{r['step_ms']:>10.2f}"
                    f"{r['comm_ms_per_step']:>14.2f}{r['comm_share']:>12.1%}")
    rows.append(f"TP {n} vs TP 1: {tp['speedup']:.2f}x throughput (tp1_{tp['rank_threads']}t: TP 1 on one "
                f"rank's share of the threads)")
    return "\n".join(rows)
