"""The GPU check's kernel sections: correctness of each Triton kernel in the check's dtype against an
fp32 reference (and a decode step replayed from a CUDA graph), and decode-attention bandwidth
against the GPU's peak and torch SDPA."""
from __future__ import annotations

import dataclasses
import random

import torch
import torch.nn.functional as F

from check_common import Report, Scale, max_err, seconds_per_call, tolerance
from worker.engine.attention import AttentionMetadata
from worker.engine.cuda_graphs import DecodeGraphs
from worker.engine.triton_attention import TritonAttentionBackend
from worker.kernels import decode_attention, write_kv

PEAK_BYTES_PER_S = 4.8e12  # H200 HBM3e, datasheet


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
