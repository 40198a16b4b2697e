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
from worker.engine.kv_budget import cdiv

log = logging.getLogger(__name__)


class TorchAttention:
    name = "torch"

    def __init__(self, native_decode: bool = False):
        self._workspace: dict[str, torch.Tensor] = {}
        self.native_decode = native_decode

    def prepare(self, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        """Compiles the native decode kernel now where decode steps will use it: compiling it
        (~0.2 s of `cc`) on the first decode step made a fresh worker's first request that late."""
        if self.native_decode and device.type == "cpu" and dtype == torch.float32:
            _native_kernel(head_dim)

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
        if self.native_decode and _native_ok(query, k_cache, v_cache):
            out = _native_decode(query, k_cache, v_cache, block_tables, seq_lens, scale)
            if out is not None:
                return out
        batch, num_heads, dim = query.shape
        block_size, kv_heads = k_cache.shape[1:3]
        max_len = int(seq_lens.max())
        ids = block_tables[:, :cdiv(max_len, block_size)].reshape(-1)
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
        """query [n, Hq, D], the last n of seq_len positions; causal over the cached context.
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
        if n == seq_len:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            pos = torch.arange(seq_len - n, seq_len, device=query.device)
            mask = torch.arange(seq_len, device=query.device) <= pos.unsqueeze(1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return out[0].transpose(0, 1)


_DECODE_C = r"""
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
/* One query token per sequence, K/V read in place block by block: scores, softmax, weighted V.
   HEAD_DIM is fixed at compile time so the inner loops unroll into a few vector FMAs. */
#define KV_HEAD(h) (G == 1 ? (h) : (h) / G) /* no integer division per token and head without GQA */
void paged_decode_f32(const float* q, const float* kc, const float* vc, const int* bt, const int* lens,
                      float* out, int B, int Hq, int Hkv, int bs, int bt_stride, float scale, int nthreads) {
  const int G = Hq / Hkv;
  const size_t row_len = (size_t)Hkv * HEAD_DIM, block_len = row_len * bs;
  #pragma omp parallel num_threads(nthreads)
  {
    int cap = 0; float* sc = NULL;
    #pragma omp for schedule(dynamic, 1)
    for (int b = 0; b < B; b++) {
      const int L = lens[b];
      if (L * Hq > cap) { free(sc); cap = L * Hq; sc = (float*)malloc(sizeof(float) * cap); }
      const float* qb = q + (size_t)b * Hq * HEAD_DIM;
      const int* row = bt + (size_t)b * bt_stride;
      for (int t0 = 0; t0 < L; t0 += bs) {
        const float* k = kc + (size_t)row[t0 / bs] * block_len;
        const int n = L - t0 < bs ? L - t0 : bs;
        for (int o = 0; o < n; o++, k += row_len)
          for (int h = 0; h < Hq; h++) {
            const float* kh = k + KV_HEAD(h) * HEAD_DIM; const float* qh = qb + h * HEAD_DIM;
            float dot = 0.f;
            #pragma omp simd reduction(+:dot)
            for (int d = 0; d < HEAD_DIM; d++) dot += qh[d] * kh[d];
            sc[h * L + t0 + o] = dot * scale;
          }
      }
      for (int h = 0; h < Hq; h++) {
        float* s = sc + h * L; float m = -FLT_MAX, sum = 0.f;
        for (int t = 0; t < L; t++) m = s[t] > m ? s[t] : m;
        #pragma omp simd reduction(+:sum)
        for (int t = 0; t < L; t++) { s[t] = expf(s[t] - m); sum += s[t]; }
        const float inv = 1.f / sum;
        #pragma omp simd
        for (int t = 0; t < L; t++) s[t] *= inv;
      }
      float* ob = out + (size_t)b * Hq * HEAD_DIM;
      memset(ob, 0, sizeof(float) * Hq * HEAD_DIM);
      for (int t0 = 0; t0 < L; t0 += bs) {
        const float* v = vc + (size_t)row[t0 / bs] * block_len;
        const int n = L - t0 < bs ? L - t0 : bs;
        for (int o = 0; o < n; o++, v += row_len)
          for (int h = 0; h < Hq; h++) {
            const float* vh = v + KV_HEAD(h) * HEAD_DIM; const float p = sc[h * L + t0 + o];
            float* oh = ob + h * HEAD_DIM;
            #pragma omp simd
            for (int d = 0; d < HEAD_DIM; d++) oh[d] += p * vh[d];
          }
      }
    }
    free(sc);
  }
}
"""


@functools.cache
def _native_kernel(head_dim: int) -> ctypes.CDLL | None:
    """Build the decode kernel for this machine and head_dim; None (the torch path) if impossible.
    Compiled with fast math but linked without it, so it cannot flip the process's denormal mode;
    it links the libgomp torch already loaded, so both share one OpenMP thread pool."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.info("no C compiler: CPU decode attention stays on the torch gather path")
        return None
    out = Path(tempfile.mkdtemp(prefix="kvgate-decode-"))
    (out / "decode.c").write_text(_DECODE_C)
    compile_ = [cc, "-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", f"-DHEAD_DIM={head_dim}",
                "-c", str(out / "decode.c"), "-o", str(out / "decode.o")]
    link = [cc, "-shared", "-fopenmp", str(out / "decode.o"), "-o", str(out / "decode.so"), "-lm"]
    try:
        for cmd in (compile_, link):
            subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        lib = ctypes.CDLL(str(out / "decode.so"))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("CPU decode kernel unavailable (%s): using the torch gather path", exc)
        return None
    finally:
        shutil.rmtree(out, ignore_errors=True)  # a loaded library no longer needs its file
    lib.paged_decode_f32.restype = None
    lib.paged_decode_f32.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 5 + [ctypes.c_float, ctypes.c_int]
    return lib


def _native_ok(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
               for t in (k_cache, v_cache)) and query.dtype == torch.float32


def _native_decode(query, k_cache, v_cache, block_tables, seq_lens, scale) -> torch.Tensor | None:
    """None when this head_dim has no kernel (no compiler): the caller then gathers."""
    batch, num_heads, dim = query.shape
    lib = _native_kernel(dim)
    if lib is None:
        return None
    block_size, kv_heads = k_cache.shape[1:3]
    q = query.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    lib.paged_decode_f32(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                         lens.data_ptr(), out.data_ptr(), batch, num_heads, kv_heads, block_size,
                         tables.shape[1], scale, torch.get_num_threads())
    return out
