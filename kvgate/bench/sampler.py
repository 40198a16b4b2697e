"""`kvgate bench sampler`: the sampler alone on CPU, the former full-sort path against the shortlist.

One call per step for batches of 1, 12 and 32 rows over a Qwen3-sized vocabulary (151,936), random
logits (N(0, 3^2): a 0.9 nucleus of ~7,000 tokens, so top-p alone grows its shortlist twice). With
`--forward`, the weight GEMMs of one Qwen3-0.6B decode step (kvgate's Linear, fp32, no attention)
stand in for the forward pass, to estimate what sampling costs a whole decode step:
(forward + greedy sampler) / (forward + sampler), the issue's sampled ÷ greedy tokens/s (prefill,
attention and the engine's own work left out, so the real ratio sits closer to 1 than this).
"""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from worker.engine.sampler import Sampler, SampleRow, draw_key
from worker.engine.types import SamplingParams

VOCAB = 151_936
BATCHES = (1, 12, 32)
CONFIGS = {  # name -> SamplingParams fields
    "greedy": dict(temperature=0.0),
    "top_k50_top_p0.9": dict(temperature=1.0, top_k=50, top_p=0.9),
    "top_k50_top_p0.9_seeded": dict(temperature=1.0, top_k=50, top_p=0.9, seed=0),
    "top_p0.9": dict(temperature=1.0, top_p=0.9),
    "min_p0.05": dict(temperature=1.0, min_p=0.05),
    "temperature1": dict(temperature=1.0),
}
# Qwen3-0.6B: hidden 1024, 28 layers, 16 q / 8 kv heads of 128, intermediate 3072, tied lm_head.
QWEN3_06B_GEMMS = [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024)] * 28 + [(1024, VOCAB)]


class FullSortSampler(Sampler):
    """The former sampling path, the baseline: a descending sort of every row for top-k/top-p, then
    the exponential race over the whole vocabulary (unseeded rows too)."""

    def _sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        temps = torch.tensor([row.params.temperature for row in rows], device=logits.device)
        logits = _full_sort_filter(logits / temps.unsqueeze(1), rows)
        probs = torch.softmax(logits, dim=-1)
        q = torch.empty_like(probs).exponential_(generator=self._shared_generator(probs.device))
        for r, row in enumerate(rows):
            if row.params.seed is not None:
                g = torch.Generator().manual_seed(draw_key(row.params.seed, row.choice_index, row.step))
                q[r] = torch.empty(probs.shape[1]).exponential_(generator=g)
        return (probs / q.clamp_min_(1e-20)).argmax(dim=-1)


def _full_sort_filter(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    vocab = logits.shape[1]
    ks = [row.params.top_k if 0 < row.params.top_k < vocab else vocab for row in rows]
    ps = [row.params.top_p for row in rows]
    if any(k < vocab for k in ks) or any(p < 1.0 for p in ps):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        positions = torch.arange(vocab).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(positions >= torch.tensor(ks).unsqueeze(1), -math.inf)
        probs = torch.softmax(sorted_logits, dim=-1)
        over = (probs.cumsum(dim=-1) - probs > torch.tensor(ps).unsqueeze(1)) & (positions > 0)
        sorted_logits = sorted_logits.masked_fill(over, -math.inf)
        logits = torch.full_like(logits, -math.inf).scatter(1, order, sorted_logits)
    min_ps = [row.params.min_p for row in rows]
    if any(m > 0.0 for m in min_ps):
        probs = torch.softmax(logits, dim=-1)
        floor = torch.tensor(min_ps).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, -math.inf)
    return logits


def time_calls(fns: list, reps: int) -> list[float]:
    """Median seconds per call of each function, the calls taking turns so that load from other
    processes on a shared machine falls on all of them alike; one warm-up each."""
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(reps):
        for fn, spent in zip(fns, times):
            start = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def sampler_figures(reps: int) -> dict:
    out = {}
    old_sampler, new_sampler = FullSortSampler([0]), Sampler([0])
    for batch in BATCHES:
        logits = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(batch)) * 3
        for name, fields in CONFIGS.items():
            rows = [SampleRow(SamplingParams(**fields), [1], [2] * r) for r in range(batch)]
            calls = [lambda: old_sampler(logits, rows), lambda: new_sampler(logits, rows)]
            old, new = time_calls(calls, reps)
            out[f"b{batch}.{name}"] = {"old_ms": round(old * 1e3, 2), "new_ms": round(new * 1e3, 2),
                                       "speedup": round(old / new, 2)}
    return out


def decode_gemms(batch: int):
    """The weight GEMMs of one Qwen3-0.6B decode step for `batch` rows (2.4 GB of fp32 weights),
    kvgate's Linear; attention over the context and the small ops are left out."""
    from worker.models.llama import Linear

    layers = [Linear(i, o, bias=False) for i, o in QWEN3_06B_GEMMS]
    for layer in layers:
        torch.nn.init.normal_(layer.weight, std=0.02)
    x = {i: torch.randn(batch, i) for i, _ in QWEN3_06B_GEMMS}

    @torch.inference_mode()
    def step():
        for layer in layers:
            layer(x[layer.in_features])
    return step


def step_estimates(reps: int) -> dict:
    """Sampled ÷ greedy output tokens per decode step, (forward + greedy) / (forward + sampled) for
    the issue's top_k 50, top_p 0.9, each part timed in turn with the others."""
    out = {}
    old_sampler, new_sampler = FullSortSampler([0]), Sampler([0])
    for batch in BATCHES:
        forward = decode_gemms(batch)
        logits = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(batch)) * 3
        greedy, sampled = ([SampleRow(SamplingParams(**CONFIGS[name]), [1], []) for _ in range(batch)]
                           for name in ("greedy", "top_k50_top_p0.9"))
        fwd, grd, old, new = (t * 1e3 for t in time_calls(
            [forward, lambda: new_sampler(logits, greedy), lambda: old_sampler(logits, sampled),
             lambda: new_sampler(logits, sampled)], reps))
        out[f"b{batch}"] = {"forward_ms": round(fwd, 1), "greedy_ms": round(grd, 2),
                            "old_ms": round(old, 2), "new_ms": round(new, 2),
                            "old": round((fwd + grd) / (fwd + old), 3),
                            "new": round((fwd + grd) / (fwd + new), 3)}
        del forward
    return out


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


ENGINE_RUNS = {  # name -> (SamplingParams fields, the sampler class the engine runs with)
    "greedy": (dict(temperature=0.0), Sampler),
    "top_k50_top_p0.9": (dict(temperature=1.0, top_k=50, top_p=0.9), Sampler),
    "top_k50_top_p0.9_full_sort": (dict(temperature=1.0, top_k=50, top_p=0.9), FullSortSampler),
}


def engine_figures(model_dir: str, reps: int, concurrency: int = 32, prompt_len: int = 128,
                   output_len: int = 64) -> dict:
    """The issue's end-to-end figure on a real folder: `concurrency` requests of `prompt_len`
    random prompt tokens and `output_len` output tokens, all at once through the engine; output
    tokens/s of the whole run (prefill included) for greedy, for top-k/top-p with the shortlist
    sampler and with the former full sort, the runs taking turns."""
    from worker.engine.engine import LLMEngine

    engine = LLMEngine.from_model_dir(model_dir, max_num_seqs=concurrency, max_num_batched_tokens=2048,
                                      max_model_len=prompt_len + output_len, enable_prefix_caching=False)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1000, min(100_000, engine.vocab_size), (prompt_len,), generator=gen).tolist()
               for _ in range(concurrency)]
    samplers = {cls: cls(engine.eos_token_ids) for _, cls in ENGINE_RUNS.values()}
    rates: dict[str, list[float]] = {name: [] for name in ENGINE_RUNS}
    for rep in range(reps):
        for name, (fields, cls) in ENGINE_RUNS.items():
            engine.runner.sampler = samplers[cls]
            params = SamplingParams(max_tokens=output_len, ignore_eos=True, **fields)
            for i, prompt in enumerate(prompts):
                engine.add_request(f"{name}-{rep}-{i}", prompt, params)
            start, produced = time.perf_counter(), 0
            while engine.has_unfinished():
                produced += sum(len(out.new_token_ids) for out in engine.step())
            rates[name].append(produced / (time.perf_counter() - start))
    greedy = statistics.median(rates["greedy"])
    return {"model": Path(model_dir).name, "concurrency": concurrency, "prompt_len": prompt_len,
            "output_len": output_len, "dtype": str(engine.runner.dtype).removeprefix("torch."),
            **{f"{name}.tokens_per_s": round(statistics.median(r), 1) for name, r in rates.items()},
            **{f"{name}.vs_greedy": round(statistics.median(r) / greedy, 3)
               for name, r in rates.items() if name != "greedy"}}


def run(reps: int = 5, forward: bool = False, out_json: str | None = None,
        model_dir: str | None = None) -> dict:
    result = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "vocab": VOCAB,
              "load_avg_start": os.getloadavg()[0], "sampler": sampler_figures(reps)}
    if forward:
        result["sampled_vs_greedy"] = step_estimates(reps)
    if model_dir:
        result["engine"] = engine_figures(model_dir, max(1, min(reps, 3)))
    result["load_avg_end"] = os.getloadavg()[0]  # 1-minute; other jobs on the machine skew figures
    print_table(result)
    if out_json:
        Path(out_json).parent.mkdir(parents=True, exist_ok=True)
        Path(out_json).write_text(json.dumps(result, indent=2))
    return result


def print_table(result: dict) -> None:
    load = f"{result['load_avg_start']:.1f} at the start, {result['load_avg_end']:.1f} at the end"
    print(f"sampler, vocab {result['vocab']}, {result['threads']} threads, {result['cpu']}, load {load}")
    print(f"{'figure':<34}{'old ms':>10}{'new ms':>10}{'old/new':>9}")
    for name, f in result["sampler"].items():
        print(f"{name:<34}{f['old_ms']:>10.2f}{f['new_ms']:>10.2f}{f['speedup']:>9.2f}")
    if "engine" in result:
        print("engine, " + ", ".join(f"{k} {v}" for k, v in result["engine"].items()))
    for name, e in result.get("sampled_vs_greedy", {}).items():
        print(f"{name}: decode GEMMs {e['forward_ms']} ms, greedy {e['greedy_ms']} ms, top_k50_top_p0.9 "
              f"old {e['old_ms']} / new {e['new_ms']} ms: sampled/greedy old {e['old']}, new {e['new']}")

