"""The CPU attention backend: torch, reading K/V from the paged cache via block tables.

Decode rows (one new token each) are served together: one gather of all their blocks into a
reused workspace, then one masked SDPA over [B, max_len]. Rows with several new tokens (prefill
chunks) go one by one, causal within the chunk and over everything cached before it.

With `native_decode`, fp32 decode rows instead go to a small C kernel (cpu_native.py, compiled
once per process with the system C compiler, if there is one) that reads K/V in place: the gather
copies every context each layer, which made attention cost as much as all the matmuls of a decode step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.engine import cpu_native
from worker.engine.attention import AttentionMetadata
from worker.engine.kv_budget import cdiv


class TorchAttention:
    name = "torch"

    def __init__(self, native_decode: bool = False):
        self._workspace: dict[str, torch.Tensor] = {}
        self.native_decode = native_decode
        self.kernels: cpu_native.CpuKernels | None = None  # prepare's: the model and sampler use them too

    def prepare(self, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        """Compiles the native kernels now where decode steps will use them: compiling them (~0.2 s
        of `cc`) on the first decode step made a fresh worker's first request that late."""
        if self.native_decode and device.type == "cpu" and dtype == torch.float32:
            self.kernels = cpu_native.load(head_dim)

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        kernels = self.kernels
        if kernels is not None and kernels.usable(key, value, k_cache, v_cache) \
                and kernels.write_kv(k_cache, v_cache, key, value, slot_mapping):
            return
        heads, dim = k_cache.shape[2:]
        k_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, key)
        v_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, value)

    def attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, window: int | None = None,
               softcap: float | None = None, sinks: torch.Tensor | None = None,
               chunk: int | None = None) -> torch.Tensor:
        """`window`: a sliding window's width; `chunk`: Llama 4's attention chunk (a query at p reads
        keys [p - p % chunk, p]); `softcap`: Gemma 2's attention soft-cap (scores become softcap *
        tanh(score / softcap) before the softmax); `sinks`: gpt-oss's per-head sink logits (one more
        term in each softmax's denominator, with no value). SDPA can apply neither of the last two:
        those layers take the explicit softmax (`_attention`)."""
        if meta.is_decode_only:
            return self._decode(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, window, softcap,
                                sinks, chunk)
        out = torch.empty_like(query)
        starts = meta.query_start_loc.tolist()
        decode_rows = [b for b, n in enumerate(meta.query_lens_cpu) if n == 1]
        if decode_rows:
            rows = torch.tensor(decode_rows, device=query.device)
            tokens = torch.tensor([starts[b] for b in decode_rows], device=query.device)
            out[tokens] = self._decode(query[tokens], k_cache, v_cache, meta.block_tables[rows],
                                       meta.seq_lens[rows], scale, window, softcap, sinks, chunk)
        for b, (n, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            if n > 1:
                q = query[starts[b]:starts[b] + n]
                out[starts[b]:starts[b] + n] = self._prefill(q, k_cache, v_cache, meta.block_tables[b],
                                                             seq_len, scale, window, softcap, sinks, chunk)
        return out

    def _decode(self, query, k_cache, v_cache, block_tables, seq_lens, scale, window=None,
                softcap=None, sinks=None, chunk=None) -> torch.Tensor:
        """query [B, Hq, D] -> [B, Hq, D]; GQA groups ride along as extra query rows per KV head."""
        kernels = self.kernels
        if kernels is not None and kernels.usable(query, k_cache, v_cache) and k_cache.is_contiguous() \
                and v_cache.is_contiguous():
            return kernels.paged_decode(query, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap,
                                        sinks, chunk)
        batch, num_heads, dim = query.shape
        block_size, kv_heads = k_cache.shape[1:3]
        max_len = int(seq_lens.max())
        ids = block_tables[:, :cdiv(max_len, block_size)].reshape(-1)
        length = ids.numel() * block_size // batch
        k = self._gather("k", k_cache, ids).view(batch, length, kv_heads, dim).transpose(1, 2)
        v = self._gather("v", v_cache, ids).view(batch, length, kv_heads, dim).transpose(1, 2)
        keys = torch.arange(length, device=query.device)
        mask = keys < seq_lens.unsqueeze(1)
        if window:
            mask &= keys >= (seq_lens - window).unsqueeze(1)
        elif chunk:  # the new token sits at seq_len - 1: from its chunk's first key on
            mask &= keys >= ((seq_lens - 1) // chunk * chunk).unsqueeze(1)
        q = query.view(batch, kv_heads, num_heads // kv_heads, dim)
        heads_sinks = sinks.view(1, kv_heads, num_heads // kv_heads, 1) if sinks is not None else None
        out = _attention(q, k, v, mask[:, None, None, :], scale, softcap, heads_sinks)
        return out.reshape(batch, num_heads, dim)

    def _gather(self, name: str, cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """index_select into a kept buffer: fresh tensors this large would be page-faulted in each time."""
        shape = (ids.numel(), *cache.shape[1:])
        numel = shape[0] * cache[0].numel()
        buf = self._workspace.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != cache.dtype or buf.device != cache.device:
            buf = torch.empty(max(numel, 2 * (buf.numel() if buf is not None else 0)),
                              dtype=cache.dtype, device=cache.device)
            self._workspace[name] = buf
        return torch.index_select(cache, 0, ids, out=buf[:numel].view(shape))

    @staticmethod
    def _prefill(query, k_cache, v_cache, block_table, seq_len: int, scale: float,
                 window: int | None = None, softcap: float | None = None,
                 sinks: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
        """query [n, Hq, D], the last n of seq_len positions; causal over the cached context (within
        the last `window` positions of each query's, with one; within each query's own `chunk`, with
        one: a row at p from key p - p % chunk on).
        4-D inputs with K/V expanded to every query head keep SDPA on its flash kernel on CPU
        (3-D inputs, or enable_gqa with a mask, fall back to materialising every score)."""
        n, num_heads, dim = query.shape
        block_size, kv_heads = k_cache.shape[1:3]
        ids = block_table[:cdiv(seq_len, block_size)]
        k = k_cache.index_select(0, ids).view(-1, kv_heads, dim)[:seq_len].transpose(0, 1)
        v = v_cache.index_select(0, ids).view(-1, kv_heads, dim)[:seq_len].transpose(0, 1)
        if kv_heads != num_heads:
            k, v = k.repeat_interleave(num_heads // kv_heads, 0), v.repeat_interleave(num_heads // kv_heads, 0)
        q, k, v = query.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        windowed = window is not None and window < seq_len
        chunked = chunk is not None and chunk < seq_len  # within the first chunk: causal
        if n == seq_len and not windowed and not chunked and softcap is None and sinks is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            pos, keys = torch.arange(seq_len - n, seq_len, device=query.device), torch.arange(seq_len, device=query.device)
            mask = keys <= pos.unsqueeze(1)
            if windowed:
                mask &= keys > (pos - window).unsqueeze(1)
            elif chunked:
                mask &= keys >= (pos - pos % chunk).unsqueeze(1)
            out = _attention(q, k, v, mask, scale, softcap, sinks.view(1, num_heads, 1, 1) if sinks is not None
                             else None)
        return out[0].transpose(0, 1)


def _attention(q, k, v, mask: torch.Tensor, scale: float, softcap: float | None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA with a boolean mask; with a soft-cap or sinks (shaped to the scores' rows: [..., rows,
    1]), the softmax spelled out as transformers' eager attention computes it: Gemma 2's scaled
    scores / cap, tanh, x cap, masked, softmax in fp32; gpt-oss's scores masked, each row's sink
    logit beside them, the row's max taken off, softmax, the sink's column dropped."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = q @ k.transpose(-2, -1) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:
        both = torch.cat([scores, sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)], dim=-1)
        probs = torch.softmax(both - both.amax(dim=-1, keepdim=True), dim=-1, dtype=both.dtype)[..., :-1]
    return probs.to(q.dtype) @ v
