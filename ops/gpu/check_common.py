"""What the GPU check's sections share: problem sizes, timing, and the report they write to."""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch


@dataclasses.dataclass
class Scale:
    """Problem sizes: the issue's on a GPU, tiny ones for --smoke on a CPU."""
    device: str
    dtype: torch.dtype
    bench: dict  # decode bandwidth problem
    block_size: int
    heads: tuple[int, int, int]  # q heads, kv heads, head dim for correctness
    max_len: int  # longest context in the correctness batches
    model: dict  # engine model shape
    num_requests: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    static_batch: int
    iters: int  # timed calls per repeat in the kernel benchmarks
    sweep: tuple[tuple[int, int, int], ...]  # (kv splits, block_n, num_stages) tried for decode
    extra_decode_seqs: int  # random-length sequences added to the decode correctness batch
    hf_seconds: float  # time allowed to each transformers baseline (a subset, then a rate)
    engine_seconds: float  # a run stopped here reports its rate so far
    greedy_prompts: tuple[int, ...]  # prompt lengths compared eager vs CUDA graphs (batch padded)
    greedy_tokens: int
    logprob_tolerance: float  # eager vs graphs, on the chosen token's logprob
    budget_s: float  # the whole check; check.sh kills it at 480 s
    section_s: dict  # each section's process is killed after this long

    @property
    def dtype_name(self) -> str:
        return "bfloat16" if self.dtype == torch.bfloat16 else "float32"


GPU = Scale(
    device="cuda", dtype=torch.bfloat16,
    bench=dict(batch=64, context=4096, q_heads=32, kv_heads=8, head_dim=128),
    block_size=16, heads=(32, 8, 128), max_len=4096,
    model=dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64),
    num_requests=64, prompt_len=(128, 512), output_len=(128, 512), static_batch=16, iters=20,
    sweep=tuple((sp, bn, st) for sp in (1, 2, 4, 8) for bn, st in ((32, 2), (64, 2), (64, 3))),
    extra_decode_seqs=27,
    hf_seconds=30.0, engine_seconds=100.0,
    greedy_prompts=(7, 33, 100, 250, 400), greedy_tokens=32,  # 5 rows: a bucket of 8, 3 padding rows
    logprob_tolerance=0.1,  # bf16 logits carry ~3 significant digits; batch padding reorders GEMMs
    budget_s=460.0,
    section_s={"correctness": 120, "decode_attn": 120, "engine.hf": 150, "engine.eager": 150,
               "engine.graphs": 150, "engine.tp": 150},
)
SMOKE = Scale(
    device="cpu", dtype=torch.float32,
    bench=dict(batch=4, context=64, q_heads=4, kv_heads=2, head_dim=16),
    block_size=4, heads=(4, 2, 16), max_len=40,
    model=dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    num_requests=4, prompt_len=(8, 16), output_len=(2, 5), static_batch=2, iters=1,
    sweep=((1, 32, 2), (3, 64, 3)), extra_decode_seqs=3,
    hf_seconds=5.0, engine_seconds=60.0,
    greedy_prompts=(5, 11, 17), greedy_tokens=4,  # 3 rows: a graph bucket of 4, one padding row
    logprob_tolerance=1e-3,
    budget_s=600.0,
    section_s={"correctness": 180, "decode_attn": 180, "engine.hf": 180, "engine.eager": 180,
               "engine.graphs": 180, "engine.tp": 180},
)


def interpreter_problem(triton_version: str, numpy_version: str) -> str | None:
    """Why Triton's interpreter cannot run the kernels here, if it cannot: triton 3.6's (the H200
    image's) fails on numpy >= 2.4 ("only 0-dimensional arrays can be converted to Python scalars").
    Compiled kernels are unaffected."""
    def major_minor(version: str) -> tuple[int, int]:
        major, minor = version.split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)

    if major_minor(triton_version) < (3, 7) and major_minor(numpy_version) >= (2, 4):
        return (f"triton {triton_version}'s interpreter cannot run the kernels with numpy "
                f"{numpy_version} (>= 2.4); triton >= 3.7 or numpy < 2.4 can (compiled kernels are unaffected)")
    return None


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def seconds_per_call(fn, device: str, iters: int, warmup: int = 3, repeats: int = 3) -> float:
    """Best of `repeats` means over `iters` calls, CUDA events on a GPU."""
    for _ in range(warmup):
        fn()
    sync(device)
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3 / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            best = min(best, (time.perf_counter() - t0) / iters)
    return best


def max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.float() - want.float()).abs().max().item()


def tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 2e-2


class Report:
    """Flat name -> value, rewritten on every put: a process killed at its time limit still leaves
    what it measured."""

    def __init__(self, path: Path):
        self.path = path
        self.values: dict = {}

    def put(self, name: str, value, quiet: bool = False) -> None:
        self.values[name] = value
        if not quiet:
            shown = f"{value:.4g}" if isinstance(value, float) else value
            print(f"  {name} = {shown}", flush=True)
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.values, indent=2, sort_keys=True) + "\n")
