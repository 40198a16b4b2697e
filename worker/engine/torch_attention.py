"""The CPU attention backend: torch, reading K/V from the paged cache via block tables.

Decode rows (one new token each) are served together: one gather of all their blocks into a
reused workspace, then one masked SDPA over [B, max_len]. Rows with several new tokens (prefill
chunks) go one by one, causal within the chunk and over everything cached before it.

With `native_decode`, fp32 decode rows instead go to a small C kernel (compiled once per process
with the system C compiler, if there is one) that reads K/V in place: the gather copies every
context each layer, which made attention cost as much as all the matmuls of a decode step.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from worker.engine.attention import AttentionMetadata

log = logging.getLogger(__name__)


class TorchAttention:
    name = "torch"

    def __init__(self, native_decode: bool = False):
        self._workspace: dict[str, torch.Tensor] = {}
        self._native = _native_kernel() if native_decode else None

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        heads, dim = k_cache.shape[2:]
        k_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, key)
        v_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, value)

    def attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.is_decode_only:
            return self._decode(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
        out = torch.empty_like(query)
        starts = meta.query_start_loc.tolist()
        decode_rows = [b for b, n in enumerate(meta.query_lens_cpu) if n == 1]
        if decode_rows:
            rows = torch.tensor(decode_rows, device=query.device)
            tokens = torch.tensor([starts[b] for b in decode_rows], device=query.device)
            out[tokens] = self._decode(query[tokens], k_cache, v_cache, meta.block_tables[rows],
                                       meta.seq_lens[rows], scale)
        for b, (n, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            if n > 1:
                q = query[starts[b]:starts[b] + n]
                out[starts[b]:starts[b] + n] = self._prefill(q, k_cache, v_cache, meta.block_tables[b],
                                                             seq_len, scale)
        return out

    def _decode(self, query, k_cache, v_cache, block_tables, seq_lens, scale) -> torch.Tensor:
        """query [B, Hq, D] -> [B, Hq, D]; GQA groups ride along as extra query rows per KV head."""
        if self._native is not None and _native_ok(query, k_cache, v_cache):
            return _native_decode(self._native, query, k_cache, v_cache, block_tables, seq_lens, scale)
        batch, num_heads, dim = query.shape
        block_size, kv_heads = k_cache.shape[1:3]
        max_len = int(seq_lens.max())
        ids = block_tables[:, :-(-max_len // block_size)].reshape(-1)
        length = ids.numel() * block_size // batch
        k = self._gather("k", k_cache, ids).view(batch, length, kv_heads, dim).transpose(1, 2)
        v = self._gather("v", v_cache, ids).view(batch, length, kv_heads, dim).transpose(1, 2)
        mask = torch.arange(length, device=query.device) < seq_lens.unsqueeze(1)
        q = query.view(batch, kv_heads, num_heads // kv_heads, dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=scale)
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
    def _prefill(query, k_cache, v_cache, block_table, seq_len: int, scale: float) -> torch.Tensor:
        """query [n, Hq, D], the last n of seq_len positions; causal over the cached context."""
        n, num_heads, dim = query.shape
        block_size, kv_heads = k_cache.shape[1:3]
        ids = block_table[:-(-seq_len // block_size)]
        k = k_cache.index_select(0, ids).view(-1, kv_heads, dim)[:seq_len].transpose(0, 1)
        v = v_cache.index_select(0, ids).view(-1, kv_heads, dim)[:seq_len].transpose(0, 1)
        q = query.transpose(0, 1)
        if n == seq_len:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            pos = torch.arange(seq_len - n, seq_len, device=query.device)
            mask = torch.arange(seq_len, device=query.device) <= pos.unsqueeze(1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        return out.transpose(0, 1)


_DECODE_C = r"""
#include <math.h>
#include <stdlib.h>
#include <string.h>
/* One query token per sequence; two passes over its context (scores, then softmax-weighted V). */
void paged_decode_f32(const float* q, const float* kc, const float* vc, const int* bt, const int* lens,
                      float* out, int B, int Hq, int Hkv, int D, int bs, int bt_stride, float scale,
                      int nthreads) {
  int G = Hq / Hkv;
  #pragma omp parallel num_threads(nthreads)
  {
    int cap = 0; float* sc = NULL;
    #pragma omp for schedule(dynamic, 1)
    for (int b = 0; b < B; b++) {
      int L = lens[b];
      if (L * Hq > cap) { free(sc); cap = L * Hq; sc = (float*)malloc(sizeof(float) * cap); }
      const float* qb = q + (size_t)b * Hq * D;
      const int* row = bt + (size_t)b * bt_stride;
      for (int t = 0; t < L; t++) {
        const float* k = kc + ((size_t)row[t / bs] * bs + t % bs) * Hkv * D;
        for (int h = 0; h < Hq; h++) {
          const float* kh = k + (h / G) * D; const float* qh = qb + h * D;
          float dot = 0.f;
          #pragma omp simd reduction(+:dot)
          for (int d = 0; d < D; d++) dot += qh[d] * kh[d];
          sc[h * L + t] = dot * scale;
        }
      }
      for (int h = 0; h < Hq; h++) {
        float* s = sc + h * L; float m = -INFINITY, sum = 0.f;
        for (int t = 0; t < L; t++) m = s[t] > m ? s[t] : m;
        for (int t = 0; t < L; t++) { s[t] = expf(s[t] - m); sum += s[t]; }
        for (int t = 0; t < L; t++) s[t] /= sum;
      }
      float* ob = out + (size_t)b * Hq * D;
      memset(ob, 0, sizeof(float) * Hq * D);
      for (int t = 0; t < L; t++) {
        const float* v = vc + ((size_t)row[t / bs] * bs + t % bs) * Hkv * D;
        for (int h = 0; h < Hq; h++) {
          const float* vh = v + (h / G) * D; const float p = sc[h * L + t]; float* oh = ob + h * D;
          #pragma omp simd
          for (int d = 0; d < D; d++) oh[d] += p * vh[d];
        }
      }
    }
    free(sc);
  }
}
"""


@functools.cache
def _native_kernel() -> ctypes.CDLL | None:
    """Build the decode kernel for this machine; None (the torch path) when that is not possible.
    It links the libgomp torch already loaded, so both share one OpenMP thread pool."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.info("no C compiler: CPU decode attention stays on the torch gather path")
        return None
    out = Path(tempfile.mkdtemp(prefix="kvgate-decode-"))
    (out / "decode.c").write_text(_DECODE_C)
    cmd = [cc, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(out / "decode.c"),
           "-o", str(out / "decode.so"), "-lm"]
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        lib = ctypes.CDLL(str(out / "decode.so"))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("CPU decode kernel unavailable (%s): using the torch gather path", exc)
        return None
    lib.paged_decode_f32.restype = None
    lib.paged_decode_f32.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]
    return lib


def _native_ok(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
               for t in (k_cache, v_cache)) and query.dtype == torch.float32


def _native_decode(lib, query, k_cache, v_cache, block_tables, seq_lens, scale) -> torch.Tensor:
    batch, num_heads, dim = query.shape
    block_size, kv_heads = k_cache.shape[1:3]
    q = query.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    lib.paged_decode_f32(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                         lens.data_ptr(), out.data_ptr(), batch, num_heads, kv_heads, dim, block_size,
                         tables.shape[1], scale, torch.get_num_threads())
    return out
