"""GPU check for the Triton path: kernel correctness in bf16, decode-attention bandwidth against the
GPU's peak and torch SDPA, and engine throughput against transformers.

    python ops/gpu/check.py [OUT_JSON] [--skip-engine] [--smoke]

Prints a table and writes flat JSON with stable names (decode_attn.bw_share, decode_attn.vs_sdpa,
engine.vs_sequential, engine.vs_static, engine.cuda_graph_speedup, ...). The JSON is rewritten after
every section, so a run cut short by its time limit still leaves what it measured. A section that
fails records its error and the others still run. --smoke runs every section on tiny shapes on the
CPU (Triton interpreted), to check this script itself without a GPU.
"""
from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from worker.engine.attention import AttentionMetadata  # noqa: E402
from worker.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from worker.engine.triton_attention import TritonAttentionBackend  # noqa: E402
from worker.kernels import decode_attention, write_kv  # noqa: E402

PEAK_BYTES_PER_S = 4.8e12  # H200 HBM3e, datasheet
TARGETS = {"decode_attn.bw_share": 0.70, "engine.vs_sequential": 20.0, "engine.vs_static": 3.0}
STARTED = time.monotonic()


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


GPU = Scale(
    device="cuda", dtype=torch.bfloat16,
    bench=dict(batch=64, context=4096, q_heads=32, kv_heads=8, head_dim=128),
    block_size=16, heads=(32, 8, 128), max_len=4096,
    model=dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64),
    num_requests=64, prompt_len=(128, 512), output_len=(128, 512), static_batch=16, iters=20,
    sweep=tuple((sp, bn, st) for sp in (1, 2, 4, 8) for bn, st in ((32, 2), (64, 2), (64, 3))),
    extra_decode_seqs=27,
    hf_seconds=45.0, engine_seconds=100.0,
)
SMOKE = Scale(
    device="cpu", dtype=torch.float32,
    bench=dict(batch=4, context=64, q_heads=4, kv_heads=2, head_dim=16),
    block_size=4, heads=(4, 2, 16), max_len=40,
    model=dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    num_requests=4, prompt_len=(8, 16), output_len=(4, 8), static_batch=2, iters=1,
    sweep=((1, 32, 2), (3, 64, 3)), extra_decode_seqs=3,
    hf_seconds=5.0, engine_seconds=60.0,
)


# ---------------------------------------------------------------- timing and reporting

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


class Report:
    def __init__(self, path: Path):
        self.path = path
        self.values: dict = {}

    def put(self, name: str, value) -> None:
        self.values[name] = value
        shown = f"{value:.4g}" if isinstance(value, float) else value
        print(f"  {name} = {shown}", flush=True)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.values, indent=2, sort_keys=True) + "\n")

    def section(self, name: str, fn, *args) -> None:
        print(f"== {name} (t={time.monotonic() - STARTED:.0f}s)", flush=True)
        try:
            fn(self, *args)
        except Exception as exc:  # one broken section must not hide the others' numbers
            traceback.print_exc()
            self.put(f"{name}.error", f"{type(exc).__name__}: {exc}"[:500])
        self.save()

    def table(self) -> str:
        rows = []
        for name in ("decode_attn.bw_share", "decode_attn.vs_sdpa", "engine.vs_sequential",
                     "engine.vs_static", "engine.cuda_graph_speedup"):
            value = self.values.get(name)
            target = TARGETS.get(name)
            verdict = "" if target is None or value is None else ("PASS" if value >= target else "MISS")
            shown = "n/a" if value is None else f"{value:.3g}"
            rows.append(f"| {name} | {shown} | {'' if target is None else f'>= {target:g}'} | {verdict} |")
        for name, value in sorted(self.values.items()):
            if name.endswith((".ok", ".error")) or "tokens_per_s" in name or name.endswith("tb_per_s"):
                rows.append(f"| {name} | {value if not isinstance(value, float) else f'{value:.4g}'} | | |")
        return "\n".join(["| metric | value | target | |", "| --- | --- | --- | --- |", *rows])


# ---------------------------------------------------------------- paged batches and reference

def paged_batch(seq_lens: list[int], query_lens: list[int], heads: tuple[int, int, int],
                block_size: int, dtype: torch.dtype, device: str, seed: int = 0):
    """Random caches over shuffled blocks; returns (query, k_cache, v_cache, meta)."""
    q_heads, kv_heads, head_dim = heads
    gen = torch.Generator(device=device).manual_seed(seed)
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 1
    order = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(per_seq), dtype=torch.int32, device=device)
    used = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = order[used:used + n]
        used += n
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    v_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    query = torch.randn(sum(query_lens), q_heads, head_dim, generator=gen, device=device).to(dtype)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens))
    return query, k_cache, v_cache, meta


def reference(query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """fp32, one sequence at a time: gather through the block table, causal softmax."""
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = query.shape[1] // kv_heads
    out = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    starts = meta.query_start_loc.tolist()
    for b, n in enumerate(meta.seq_lens_cpu):
        q0, q1 = starts[b], starts[b + 1]
        pos = torch.arange(n, device=query.device)
        blocks = meta.block_tables[b].long()[pos // block_size]
        k = k_cache[blocks, pos % block_size].float().repeat_interleave(group, 1).transpose(0, 1)
        v = v_cache[blocks, pos % block_size].float().repeat_interleave(group, 1).transpose(0, 1)
        q = query[q0:q1].float().transpose(0, 1)
        q_pos = torch.arange(n - (q1 - q0), n, device=query.device)
        mask = pos[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[q0:q1] = o.transpose(0, 1)
    return out


def max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.float() - want.float()).abs().max().item()


def tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 2e-2


# ---------------------------------------------------------------- sections

def correctness(report: Report, s: Scale) -> None:
    dev, dt, bs = s.device, s.dtype, s.block_size
    q_heads, kv_heads, head_dim = s.heads
    tol = tolerance(dt)
    gen = torch.Generator(device=dev).manual_seed(1)

    # K/V write: rows taken from a fused qkv projection (strided), random distinct slots
    num_tokens, num_blocks = 3 * s.max_len // 4, s.max_len // bs
    qkv = torch.randn(num_tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen,
                      device=dev).to(dt)
    key = qkv[:, q_heads * head_dim:(q_heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    value = qkv[:, (q_heads + kv_heads) * head_dim:].view(num_tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * bs, generator=gen, device=dev)[:num_tokens]
    k_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=gen, device=dev).to(dt)
    v_cache = torch.randn_like(k_cache)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k.view(-1, kv_heads, head_dim).index_copy_(0, slots, key)
    want_v.view(-1, kv_heads, head_dim).index_copy_(0, slots, value)
    write_kv(k_cache, v_cache, key, value, slots)
    report.put("correctness.write_kv.ok", bool(torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)))

    torch_backend = None
    try:
        from worker.engine.torch_attention import TorchAttention
        torch_backend = TorchAttention()
    except ImportError:
        pass
    scale = head_dim ** -0.5
    rng = random.Random(2)
    n = s.max_len
    decode_lens = [1, bs - 1, bs, bs + 1, n] + [rng.randint(1, n) for _ in range(s.extra_decode_seqs)]
    # (context already cached, new tokens): fresh prompts, prefix hits, a long chunk, decode rows
    extend_rows = [(0, n // 8), (n // 4, n // 16), (bs, bs), (n - 1, 1), (n // 2, n // 2),
                   (bs + 1, n // 40 + 1), (0, 1), (n // 12, 1)]
    batches = {
        "decode": paged_batch(decode_lens, [1] * len(decode_lens), s.heads, bs, dt, dev, seed=3),
        "extend": paged_batch([c + q for c, q in extend_rows], [q for _, q in extend_rows],
                              s.heads, bs, dt, dev, seed=4),
    }
    backend = TritonAttentionBackend()
    for name, (query, k_cache, v_cache, meta) in batches.items():
        want = reference(query, k_cache, v_cache, meta, scale)
        err = max_err(backend.attend(query, k_cache, v_cache, meta, scale), want)
        report.put(f"correctness.{name}.max_err", err)
        ok = err <= tol
        if name == "decode":
            for splits in (1, 7):  # the plain path and an odd split count
                got = decode_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                       scale, num_kv_splits=splits)
                split_err = max_err(got, want)
                report.put(f"correctness.decode.splits{splits}.max_err", split_err)
                ok = ok and split_err <= tol
        if torch_backend is not None:
            report.put(f"correctness.{name}.vs_torch_backend.max_err",
                       max_err(backend.attend(query, k_cache, v_cache, meta, scale),
                               torch_backend.attend(query, k_cache, v_cache, meta, scale)))
        report.put(f"correctness.{name}.ok", ok)

    # a decode step captured in CUDA graphs at bucketed sizes replays like the eager step
    query, k_cache, v_cache, meta = batches["decode"]
    fixed = TritonAttentionBackend(kv_splits=4)  # same kernels eager and replayed: equal outputs
    buffers = {"query": torch.zeros_like(query[:16]), "seq_lens": torch.zeros_like(meta.seq_lens[:16]),
               "block_tables": torch.zeros_like(meta.block_tables[:16])}

    def step(x):
        rows = x["seq_lens"].shape[0]
        static = dataclasses.replace(meta, seq_lens=x["seq_lens"], block_tables=x["block_tables"],
                                     query_start_loc=meta.query_start_loc[:rows + 1])
        return fixed.attend(x["query"], k_cache, v_cache, static, scale)

    graphs = DecodeGraphs(step, buffers, pad={"seq_lens": 0})
    graphs.capture()
    live = {"query": query[:11], "seq_lens": meta.seq_lens[:11], "block_tables": meta.block_tables[:11]}
    err = max_err(graphs.run(live), step(live))
    report.put("correctness.graph_replay.captured", sorted(graphs.graphs))
    report.put("correctness.graph_replay.max_err", err)
    report.put("correctness.graph_replay.ok", err <= tolerance(dt))


def decode_bandwidth(report: Report, s: Scale) -> None:
    """Batch x context decode over paged bf16 K/V; bytes of K/V read / time, and SDPA on the same
    data laid out contiguously."""
    b, ctx, q_heads, kv_heads, head_dim = (s.bench[k] for k in
                                           ("batch", "context", "q_heads", "kv_heads", "head_dim"))
    query, k_cache, v_cache, meta = paged_batch([ctx] * b, [1] * b, (q_heads, kv_heads, head_dim),
                                                s.block_size, s.dtype, s.device, seed=5)
    scale = head_dim ** -0.5
    kv_bytes = 2 * b * ctx * kv_heads * head_dim * k_cache.element_size()
    backend = TritonAttentionBackend()
    triton_out = backend.attend(query, k_cache, v_cache, meta, scale)
    t = seconds_per_call(lambda: backend.attend(query, k_cache, v_cache, meta, scale), s.device,
                         s.iters)
    report.put("decode_attn.splits", backend._splits(query, k_cache, meta))
    report.put("decode_attn.us", t * 1e6)
    report.put("decode_attn.tb_per_s", kv_bytes / t / 1e12)
    report.put("decode_attn.bw_share", kv_bytes / t / PEAK_BYTES_PER_S)
    sweep = {}
    for splits, block_n, stages in s.sweep:
        def call():
            decode_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                             num_kv_splits=splits, block_n=block_n, num_stages=stages)
        name = f"splits={splits},block_n={block_n},stages={stages}"
        try:
            t_cfg = seconds_per_call(call, s.device, max(1, s.iters // 2), repeats=2)
            sweep[name] = round(kv_bytes / t_cfg / PEAK_BYTES_PER_S, 4)
        except Exception as exc:  # a config that does not build on this GPU is a finding, not a stop
            sweep[name] = f"{type(exc).__name__}: {exc}"[:200]
    report.put("decode_attn.sweep_bw_share", sweep)
    report.put("decode_attn.best_bw_share",
               max((v for v in sweep.values() if isinstance(v, float)), default=None))

    # the same keys, contiguous [B, H, ctx, D]
    pos = torch.arange(ctx, device=s.device)
    blocks = meta.block_tables.long()[:, pos // s.block_size]
    k = k_cache[blocks, pos % s.block_size].transpose(1, 2).contiguous()
    v = v_cache[blocks, pos % s.block_size].transpose(1, 2).contiguous()
    q = query.unsqueeze(2)  # [B, Hq, 1, D]
    group = q_heads // kv_heads
    k_rep, v_rep = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # reads group x the bytes
    variants = {
        "enable_gqa": lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True),
        "repeat_kv": lambda: F.scaled_dot_product_attention(q, k_rep, v_rep, scale=scale),
    }
    times = {}
    for mode, sdpa in variants.items():
        try:
            report.put(f"decode_attn.sdpa_{mode}.max_err", max_err(sdpa().squeeze(2), triton_out))
            times[mode] = seconds_per_call(sdpa, s.device, s.iters)
            report.put(f"decode_attn.sdpa_{mode}.us", times[mode] * 1e6)
        except (TypeError, RuntimeError) as exc:  # e.g. a torch without enable_gqa
            report.put(f"decode_attn.sdpa_{mode}.error", f"{type(exc).__name__}: {exc}"[:300])
    mode = min(times, key=times.get)
    report.put("decode_attn.sdpa_mode", mode)
    report.put("decode_attn.sdpa_tb_per_s", kv_bytes / times[mode] / 1e12)  # counting K/V once
    report.put("decode_attn.vs_sdpa", times[mode] / t)

    # what this GPU's memory actually moves: a large device-to-device copy (read + write)
    src = torch.empty(s.bench["batch"] * 2 ** 23, dtype=torch.uint8, device=s.device)
    dst = torch.empty_like(src)
    t_copy = seconds_per_call(lambda: dst.copy_(src), s.device, s.iters)
    report.put("env.copy_tb_per_s", 2 * src.numel() / t_copy / 1e12)
    report.put("decode_attn.bw_share_of_copy", kv_bytes / t / (2 * src.numel() / t_copy))


def engine_throughput(report: Report, s: Scale) -> None:
    try:
        from worker.engine.config import EngineConfig
        from worker.engine.engine import LLMEngine
    except ImportError as exc:
        report.put("engine.skipped", f"engine not importable: {exc}")
        return
    from worker.engine.types import SamplingParams

    rng = random.Random(0)
    requests = [([rng.randrange(3, 2000) for _ in range(rng.randint(*s.prompt_len))],
                 rng.randint(*s.output_len)) for _ in range(s.num_requests)]
    report.put("engine.requests", len(requests))
    report.put("engine.output_tokens", sum(o for _, o in requests))
    with tempfile.TemporaryDirectory() as tmp:
        hf_model = build_llama_like(Path(tmp), s)
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        base = dict(device=s.device, dtype="bfloat16" if s.dtype == torch.bfloat16 else "float32",
                    attention_backend="triton", block_size=s.block_size,
                    max_num_seqs=s.num_requests, max_num_batched_tokens=max(2048, 8 * s.prompt_len[1]),
                    max_model_len=s.prompt_len[1] + s.output_len[1] + 16)
        total = s.num_requests * (s.prompt_len[1] + s.output_len[1])
        base["num_blocks"] = 2 * -(-total // s.block_size)  # sized by the work, not the free memory
        base = {k: v for k, v in base.items() if k in fields}
        if "enforce_eager" in fields:
            variants = {"eager": {"enforce_eager": True}, "graphs": {"enforce_eager": False}}
        elif "use_cuda_graphs" in fields:
            variants = {"eager": {"use_cuda_graphs": False}, "graphs": {"use_cuda_graphs": True}}
        else:
            variants = {"eager": {}}
        rates = {}
        for name, flags in variants.items():
            try:
                rates[name] = run_engine(LLMEngine, SamplingParams, tmp, {**base, **flags}, requests,
                                         s.engine_seconds)
                report.put(f"engine.{name}.tokens_per_s", rates[name])
            except Exception as exc:
                traceback.print_exc()
                report.put(f"engine.{name}.error", f"{type(exc).__name__}: {exc}"[:500])
            free_memory()
            report.save()
        best = rates.get("graphs", rates.get("eager"))
        report.put("engine.tokens_per_s", best)
        report.put("engine.cuda_graph_speedup",
                   rates["graphs"] / rates["eager"] if {"graphs", "eager"} <= rates.keys() else None)

        sequential = hf_sequential(hf_model, requests, s)
        report.put("hf.sequential.tokens_per_s", sequential)
        report.save()
        static = hf_static(hf_model, requests, s)
        report.put("hf.static.tokens_per_s", static)
        report.put("engine.vs_sequential", best / sequential if best else None)
        report.put("engine.vs_static", best / static if best else None)


def build_llama_like(path: Path, s: Scale):
    """A random-weight Llama-3.2-1B-shaped folder (llama3 RoPE scaling, tied embeddings) plus the
    demo tokenizer; returns the transformers model, kept for the baselines."""
    import transformers

    from worker.models.demo import train_tokenizer

    tokenizer = train_tokenizer(vocab_size=2048)
    dtype_name = "bfloat16" if s.dtype == torch.bfloat16 else "float32"
    config = transformers.LlamaConfig(
        **s.model, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 8192},
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype=dtype_name)
    torch.manual_seed(0)
    with torch.device(s.device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=s.dtype)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    model.generation_config.eos_token_id = None  # like ignore_eos: generate the full length
    model.generation_config.save_pretrained(path)
    return model.eval()


def run_engine(engine_cls, params_cls, model_dir: str, config: dict, requests, seconds: float) -> float:
    """Output tokens/s for all requests at once; warm-up requests first (Triton compiles, graphs)."""
    engine = engine_cls.from_model_dir(model_dir, **config)
    for i in range(2):
        engine.add_request(f"warm{i}", [5 + i] * 16, params_cls(max_tokens=8, temperature=0.0,
                                                               ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    sync(config.get("device", "cuda"))
    start = time.perf_counter()
    for i, (prompt, out_len) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params_cls(max_tokens=out_len, temperature=0.0,
                                                       ignore_eos=True))
    tokens = 0
    while engine.has_unfinished() and time.perf_counter() - start < seconds:
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    elapsed = time.perf_counter() - start
    if engine.has_unfinished():
        print(f"  engine stopped after {elapsed:.0f}s with {tokens} tokens (rate so far)")
    del engine
    return tokens / elapsed


@torch.inference_mode()
def hf_sequential(model, requests, s: Scale) -> float:
    """transformers generate, one request at a time, until the time allowance is spent."""
    device = model.device
    model.generate(torch.tensor([[5] * 16], device=device), max_new_tokens=4, do_sample=False,
                   pad_token_id=0)  # warm-up
    sync(s.device)
    tokens, start = 0, time.perf_counter()
    for prompt, out_len in requests:
        model.generate(torch.tensor([prompt], device=device), max_new_tokens=out_len,
                       min_new_tokens=out_len, do_sample=False, pad_token_id=0)
        tokens += out_len
        if time.perf_counter() - start > s.hf_seconds:
            break
    sync(s.device)
    print(f"  sequential: {tokens} tokens in {time.perf_counter() - start:.1f}s")
    return tokens / (time.perf_counter() - start)


@torch.inference_mode()
def hf_static(model, requests, s: Scale) -> float:
    """Padded static batches (left-padded, each runs to its longest output); counts only the
    tokens each request asked for."""
    device = model.device
    tokens, start = 0, time.perf_counter()
    for i in range(0, len(requests), s.static_batch):
        batch = requests[i:i + s.static_batch]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=device)
        longest = max(o for _, o in batch)
        model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                       do_sample=False, pad_token_id=0)
        tokens += sum(o for _, o in batch)
        if time.perf_counter() - start > s.hf_seconds:
            break
    sync(s.device)
    print(f"  static: {tokens} useful tokens in {time.perf_counter() - start:.1f}s")
    return tokens / (time.perf_counter() - start)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", help="JSON path (default docs/perf/gpu-check.json, "
                        "bench-out/gpu-check-smoke.json with --smoke)")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device; use --smoke to check this script on the CPU", file=sys.stderr)
        return 2
    scale = SMOKE if args.smoke else GPU
    default = "bench-out/gpu-check-smoke.json" if args.smoke else "docs/perf/gpu-check.json"
    report = Report(Path(args.out or ROOT / default))
    import triton

    report.put("env.device", torch.cuda.get_device_name() if scale.device == "cuda" else "cpu")
    report.put("env.torch", torch.__version__)
    report.put("env.triton", triton.__version__)
    report.section("correctness", correctness, scale)
    report.section("decode_attn", decode_bandwidth, scale)
    if not args.skip_engine:
        report.section("engine", engine_throughput, scale)
    report.put("env.seconds", round(time.monotonic() - STARTED, 1))
    report.save()
    print()
    print(report.table())
    print(f"\nwrote {report.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
