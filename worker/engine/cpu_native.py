"""Native CPU kernels for fp32, compiled once per process with the system C compiler (when there
is one) for this machine (`-march=native`, so AMD and Intel each get their own vector code):

- paged decode attention reading K/V in place (the torch path gathers every context each layer);
- a layer's element-wise work fused into one pass each: residual add + RMSNorm, per-head RMSNorm
  and rotary embedding in place in the qkv rows, SiLU(gate) x up; and greedy argmax.

Each fused kernel replaces 3-8 torch ops, each its own dispatch, allocation and pass over memory:
together ~10 % of a decode step on 2 cores, and torch's argmax over [64, 32000] ran
single-threaded at ~1.5 G floats/s. The linears' GEMM is one more path beside torch's oneDNN and
MKL ones (`native` in linear.py; gemm_probe.py times them all at load and keeps the fastest).

Three translation units: attention and SiLU with fast math (vectorised expf); the element-wise rest
without it, so the rotary embedding is the same products and sums as torch's, bit for bit (no FMA
contraction), and argmax still sees NaNs (torch's answer: the first NaN, else the first maximum);
the GEMM without fast math but with FMA (each output a sum over k in order, as BLAS kernels do).
"""
from __future__ import annotations

import ctypes
import functools
import logging
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from worker.engine.kv_budget import cdiv

log = logging.getLogger(__name__)

_FAST_C = r"""
#include <float.h>
#include <stddef.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
/* One query token per sequence, K/V read in place block by block: scores, softmax, weighted V.
   HEAD_DIM is fixed at compile time so the inner loops unroll into a few vector FMAs. */
#define KV_HEAD(h) (G == 1 ? (h) : (h) / G) /* no integer division per token and head without GQA */
/* With `pf`, the next block's cache lines are asked for (into L2) while this one is computed, a
   token's row of the next block with each row of this one: blocks sit anywhere in the cache, so
   the hardware prefetcher stops at every block's end. Row by row into L2 the kernel took 12 % less
   time on an Intel Xeon (8.4 against 9.6 ms for 8 layers of 51 sequences at 131 tokens), where the
   whole next block at once into L1 gained nothing; on an AMD EPYC the block-at-once prefetch cost
   7-10 %, so it is timed at start-up (below). */
static inline void prefetch(const float* p, size_t n) {
  for (size_t i = 0; i < n; i += 64 / sizeof(float)) __builtin_prefetch(p + i, 0, 2);
}
void paged_decode_f32(const float* q, const float* kc, const float* vc, const int* bt, const int* lens,
                      float* out, int B, int Hq, int Hkv, int bs, int bt_stride, int q_stride, float scale,
                      int window, int chunk, float softcap, const float* sinks, int pf, int nthreads) {
  const int G = Hq / Hkv;
  const size_t row_len = (size_t)Hkv * HEAD_DIM, block_len = row_len * bs;
  #pragma omp parallel num_threads(nthreads)
  {
    int cap = 0; float* sc = NULL;
    #pragma omp for schedule(dynamic, 1)
    for (int b = 0; b < B; b++) {
      const int L = lens[b];
      /* from `first` on: a sliding window (window > 0) attends the last `window` keys only; a chunked
         layer (chunk > 0, Llama 4's) the new token's chunk only, from key (L - 1) - (L - 1) % chunk */
      const int first = chunk > 0 ? (L - 1) - (L - 1) % chunk : window > 0 && L > window ? L - window : 0;
      const int W = L - first;
      if (W * Hq > cap) { free(sc); cap = W * Hq; sc = (float*)malloc(sizeof(float) * cap); }
      const float* qb = q + (size_t)b * q_stride;
      const int* row = bt + (size_t)b * bt_stride;
      for (int t0 = first - first % bs; t0 < L; t0 += bs) {
        const int n = L - t0 < bs ? L - t0 : bs, o0 = t0 < first ? first - t0 : 0;
        const float* k = kc + (size_t)row[t0 / bs] * block_len + (size_t)o0 * row_len;
        const float* next = !pf ? NULL : t0 + bs < L ? kc + (size_t)row[t0 / bs + 1] * block_len
                                                     : vc + (size_t)row[first / bs] * block_len;
        for (int o = o0; o < n; o++, k += row_len) {
          if (next) prefetch(next + (size_t)o * row_len, row_len);
          for (int h = 0; h < Hq; h++) {
            const float* kh = k + KV_HEAD(h) * HEAD_DIM; const float* qh = qb + h * HEAD_DIM;
            float dot = 0.f;
            #pragma omp simd reduction(+:dot)
            for (int d = 0; d < HEAD_DIM; d++) dot += qh[d] * kh[d];
            sc[h * W + t0 + o - first] = dot * scale;
          }
        }
      }
      for (int h = 0; h < Hq; h++) {
        /* gpt-oss's sink: a learned logit per head in the softmax's denominator, with no value */
        float* s = sc + h * W; float m = sinks ? sinks[h] : -FLT_MAX, sum = 0.f;
        if (softcap > 0.f) /* Gemma 2's soft-cap, in a pass of its own: the score loop stays as it was */
          for (int t = 0; t < W; t++) s[t] = tanhf(s[t] / softcap) * softcap;
        for (int t = 0; t < W; t++) m = s[t] > m ? s[t] : m;
        if (sinks) sum = expf(sinks[h] - m);
        #pragma omp simd reduction(+:sum)
        for (int t = 0; t < W; t++) { s[t] = expf(s[t] - m); sum += s[t]; }
        const float inv = 1.f / sum;
        #pragma omp simd
        for (int t = 0; t < W; t++) s[t] *= inv;
      }
      float* ob = out + (size_t)b * Hq * HEAD_DIM;
      memset(ob, 0, sizeof(float) * Hq * HEAD_DIM);
      for (int t0 = first - first % bs; t0 < L; t0 += bs) {
        const int n = L - t0 < bs ? L - t0 : bs, o0 = t0 < first ? first - t0 : 0;
        const float* v = vc + (size_t)row[t0 / bs] * block_len + (size_t)o0 * row_len;
        const float* next = pf && t0 + bs < L ? vc + (size_t)row[t0 / bs + 1] * block_len : NULL;
        for (int o = o0; o < n; o++, v += row_len) {
          if (next) prefetch(next + (size_t)o * row_len, row_len);
          for (int h = 0; h < Hq; h++) {
            const float* vh = v + KV_HEAD(h) * HEAD_DIM; const float p = sc[h * W + t0 + o - first];
            float* oh = ob + h * HEAD_DIM;
            #pragma omp simd
            for (int d = 0; d < HEAD_DIM; d++) oh[d] += p * vh[d];
          }
        }
      }
    }
    free(sc);
  }
}
/* Rows of [gate | up] (2n wide): out = silu(gate) * up. */
void silu_mul_f32(const float* gu, float* out, int rows, int n, int nthreads) {
  #pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int r = 0; r < rows; r++) {
    const float* g = gu + (size_t)r * 2 * n; const float* u = g + n; float* o = out + (size_t)r * n;
    #pragma omp simd
    for (int i = 0; i < n; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
  }
}
"""

_EXACT_C = r"""
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
/* Rows of x (row stride ld): out = w * (x * (1 / sqrt(mean(x^2) + eps))), torch's RMSNorm order.
   With delta, x += delta first, in place: the residual stream, which the next layer reads. */
void add_rmsnorm_f32(float* x, const float* delta, const float* w, float* out, int rows, int dim,
                     float eps, int nthreads) {
  #pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int r = 0; r < rows; r++) {
    float* xr = x + (size_t)r * dim; float* o = out + (size_t)r * dim;
    if (delta) {
      const float* d = delta + (size_t)r * dim;
      #pragma omp simd
      for (int i = 0; i < dim; i++) xr[i] += d[i];
    }
    float ss = 0.f;
    #pragma omp simd reduction(+:ss)
    for (int i = 0; i < dim; i++) ss += xr[i] * xr[i];
    const float inv = 1.f / sqrtf(ss / dim + eps);
    #pragma omp simd
    for (int i = 0; i < dim; i++) o[i] = w[i] * (xr[i] * inv);
  }
}
/* In place: `heads` heads of `dim` from column `col` of each row (stride ld), RMSNorm'd per head. */
void head_rmsnorm_f32(float* x, const float* w, int rows, int ld, int col, int heads, int dim,
                      float eps, int nthreads) {
  #pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int r = 0; r < rows; r++)
    for (int h = 0; h < heads; h++) {
      float* xh = x + (size_t)r * ld + col + (size_t)h * dim;
      float ss = 0.f;
      #pragma omp simd reduction(+:ss)
      for (int i = 0; i < dim; i++) ss += xh[i] * xh[i];
      const float inv = 1.f / sqrtf(ss / dim + eps);
      #pragma omp simd
      for (int i = 0; i < dim; i++) xh[i] = w[i] * (xh[i] * inv);
    }
}
/* In place: the first `heads` heads of each row (q then k in a qkv row) rotated by their
   position's [cos | sin] row of `table`: x * cos + rotate_half(x) * sin, as torch computes it, over
   each head's first `rot` of its `dim` values (the rest pass: partial rotary embeddings). */
void rope_f32(float* x, const int64_t* pos, const float* table, int rows, int ld, int heads, int dim,
              int rot, int nthreads) {
  const int half = rot / 2;
  #pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int r = 0; r < rows; r++) {
    const float* c = table + (size_t)pos[r] * 2 * rot; const float* s = c + rot;
    for (int h = 0; h < heads; h++) {
      float* xh = x + (size_t)r * ld + (size_t)h * dim;
      #pragma omp simd
      for (int i = 0; i < half; i++) {
        const float a = xh[i], b = xh[i + half];
        xh[i] = a * c[i] + (-b) * s[i];
        xh[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
  }
}
/* Rows t of k and v (row strides k_ld, v_ld; row_len floats: every KV head) copied to cache slot
   slots[t]. A slot outside [0, num_slots) is never written: it is counted, and the caller raises. */
int write_kv_f32(float* kc, float* vc, const float* k, const float* v, const int64_t* slots, int T,
                 int k_ld, int v_ld, int row_len, int64_t num_slots, int nthreads) {
  int bad = 0;
  #pragma omp parallel for num_threads(nthreads) schedule(static) reduction(+:bad) if (T > 256)
  for (int t = 0; t < T; t++) {
    const int64_t slot = slots[t];
    if (slot < 0 || slot >= num_slots) { bad++; continue; }
    memcpy(kc + slot * row_len, k + (size_t)t * k_ld, sizeof(float) * row_len);
    memcpy(vc + slot * row_len, v + (size_t)t * v_ld, sizeof(float) * row_len);
  }
  return bad;
}
/* Per row: the first NaN if there is one, else the first maximum (torch.argmax's answer). */
void argmax_f32(const float* x, int rows, int cols, int64_t* out, int nthreads) {
  #pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int r = 0; r < rows; r++) {
    const float* xr = x + (size_t)r * cols; float m = -INFINITY; int nan = 0;
    #pragma omp simd reduction(max:m) reduction(|:nan)
    for (int i = 0; i < cols; i++) { m = xr[i] > m ? xr[i] : m; nan |= xr[i] != xr[i]; }
    int64_t at = 0;
    if (nan) { while (xr[at] == xr[at]) at++; }
    else { while (at < cols - 1 && xr[at] != m) at++; }
    out[r] = at;
  }
}
"""

_GEMM_C = r"""
#include <stddef.h>
#include <string.h>
/* y = x w^T (+ bias) for fp32, w laid out at load in panels of NR output columns: panel p is
   [K][NR] (column p*NR + j of every k side by side; the last panel zero-padded), so a micro-kernel
   reads one panel front to back while it keeps MR rows x NR columns of y in vector registers.
   Each thread takes a run of panels; while it computes one it prefetches the next into L2, spread
   over the k loop: a weight read once per step streams from memory, and oneDNN's and MKL's
   kernels, without that, waited for it (their rate over a decode step's cold weights was ~60 % of
   their rate over a weight in cache). Rows go in chunks that stay in L2 beside the panel.
   Vector width from the target: 16 floats (AVX-512: 6 x 64 accumulators), 8 (AVX2: 4 x 24), else 4. */
#if defined(__AVX512F__)
#define VEC 16
#define MR 6
#define NV 4
#define BCAST(s) ((vf){s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s})
#elif defined(__AVX2__) || defined(__AVX__)
#define VEC 8
#define MR 4
#define NV 3
#define BCAST(s) ((vf){s, s, s, s, s, s, s, s})
#else
#define VEC 4
#define MR 4
#define NV 2
#define BCAST(s) ((vf){s, s, s, s})
#endif
#define NR (VEC * NV)
typedef float vf __attribute__((vector_size(VEC * 4)));
typedef float vfu __attribute__((vector_size(VEC * 4), aligned(4))); /* unaligned loads and stores */
#define LINE_FLOATS 16 /* a 64-byte cache line */

int gemm_panel_width(void) { return NR; }

static inline __attribute__((always_inline)) void micro(const float* a, int lda, const float* b, int K,
    float* c, int ldc, int ncols, const float* bias, int mr, const float* pf, int pf_per_k, const float* pf_end) {
  vf acc[MR][NV];
  for (int i = 0; i < MR; i++)
    for (int v = 0; v < NV; v++) acc[i][v] = bias ? *(const vfu*)(bias + v * VEC) : (vf){0};
  for (int k = 0; k < K; k++) {
    const float* bk = b + (size_t)k * NR;
    vf bv[NV];
    for (int v = 0; v < NV; v++) bv[v] = *(const vf*)(bk + v * VEC);
    for (int q = 0; q < pf_per_k; q++, pf += LINE_FLOATS)
      if (pf < pf_end) __builtin_prefetch(pf, 0, 2);
    for (int i = 0; i < MR; i++)
      if (i < mr) {
        const float s = a[(size_t)i * lda + k];
        const vf av = BCAST(s);
        for (int v = 0; v < NV; v++) acc[i][v] += av * bv[v];
      }
  }
  for (int i = 0; i < mr; i++) {
    if (ncols == NR) {
      for (int v = 0; v < NV; v++) *(vfu*)(c + (size_t)i * ldc + v * VEC) = acc[i][v];
    } else {
      float row[NR];
      for (int v = 0; v < NV; v++) *(vfu*)(row + v * VEC) = acc[i][v];
      memcpy(c + (size_t)i * ldc, row, sizeof(float) * ncols);
    }
  }
}

/* x [M, K] (row stride lda), panels [ceil(N / NR)][K][NR] -> y [M, N]; bias [N] or NULL. The panels
   must be 64-byte aligned (torch's CPU allocator aligns to 64). */
void gemm_f32(const float* x, int lda, const float* panels, const float* bias, float* y, int M, int N, int K,
              int nthreads) {
  if (M <= 0 || N <= 0) return;
  const int P = (N + NR - 1) / NR;
  const size_t panel = (size_t)K * NR;
  int mc = (int)((512 * 1024) / ((size_t)K * 4)) / MR * MR; /* rows per chunk: ~512 KB of x in L2 */
  if (mc < MR) mc = MR;
  for (int m0 = 0; m0 < M; m0 += mc) {
    const int rows = M - m0 < mc ? M - m0 : mc;
    const int blocks = (rows + MR - 1) / MR;
    /* the next panel's lines, spread over this panel's k steps (at least one a step) */
    const int pf_per_k = (int)((panel / LINE_FLOATS + (size_t)blocks * K - 1) / ((size_t)blocks * K));
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int p = 0; p < P; p++) {
      const float* b = panels + p * panel;
      const float* next = p + 1 < P ? b + panel : NULL;
      const float* pf_end = next ? next + panel : NULL;
      const int ncols = N - p * NR < NR ? N - p * NR : NR;
      float bias_pad[NR];
      const float* bp = NULL;
      if (bias) {
        memset(bias_pad, 0, sizeof bias_pad);
        memcpy(bias_pad, bias + p * NR, sizeof(float) * ncols);
        bp = bias_pad;
      }
      for (int mb = 0; mb < blocks; mb++) {
        const int r0 = m0 + mb * MR, mr = rows - mb * MR < MR ? rows - mb * MR : MR;
        const float* pf = next ? next + (size_t)mb * K * pf_per_k * LINE_FLOATS : NULL;
        const int ppk = next ? pf_per_k : 0;
        const float* a = x + (size_t)r0 * lda;
        float* c = y + (size_t)r0 * N + p * NR;
        switch (mr) { /* each a micro-kernel with its row count fixed: the accumulators stay in registers */
          case MR: micro(a, lda, b, K, c, N, ncols, bp, MR, pf, ppk, pf_end); break;
#if MR > 4
          case 5: micro(a, lda, b, K, c, N, ncols, bp, 5, pf, ppk, pf_end); break;
          case 4: micro(a, lda, b, K, c, N, ncols, bp, 4, pf, ppk, pf_end); break;
#endif
          case 3: micro(a, lda, b, K, c, N, ncols, bp, 3, pf, ppk, pf_end); break;
          case 2: micro(a, lda, b, K, c, N, ncols, bp, 2, pf, ppk, pf_end); break;
          default: micro(a, lda, b, K, c, N, ncols, bp, 1, pf, ppk, pf_end); break;
        }
      }
    }
  }
}
"""


class CpuKernels:
    """The compiled kernels behind typed calls. Inputs are fp32 CPU tensors; the model and sampler
    only call these where that holds (`usable`)."""

    def __init__(self, lib: ctypes.CDLL, head_dim: int):
        self.lib, self.head_dim = lib, head_dim
        self.prefetch = False  # decode attention's block prefetch: choose_prefetch times it

    def choose_prefetch(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], num_heads: int,
                        rows: int) -> dict[str, float]:
        """Decode attention with and without its block prefetch, timed over the engine's own KV
        caches as a decode step reads them (each layer in turn, `rows` sequences of PROBE_CONTEXT
        tokens on blocks spread over the pool, up to PROBE_BYTES a pass), best of PROBE_ROUNDS
        interleaved; keeps the faster. The prefetch changes no result, only the speed, and which
        is faster differs between CPU families. Returns ms per pass, "on" and "off"."""
        k0 = kv_caches[0][0]
        pool, block_size = k0.shape[:2]
        per_seq = cdiv(PROBE_CONTEXT, block_size)
        rows = min(rows, pool // per_seq)
        if rows < 1:  # a pool smaller than one probe sequence: nothing there to time
            self.prefetch = False
            return {}
        row_bytes = 2 * k0[0].numel() * k0.element_size() * per_seq  # K and V of one sequence a layer
        layers = kv_caches[:max(1, min(len(kv_caches), PROBE_BYTES // (rows * row_bytes)))]
        key = (tuple(k0.shape), len(layers), num_heads, rows, torch.get_num_threads())
        if key not in _PREFETCH_TIMINGS:
            gen = torch.Generator().manual_seed(0)
            query = torch.randn(rows, num_heads, self.head_dim, generator=gen)
            tables = [torch.randperm(pool, generator=gen)[:rows * per_seq].view(rows, per_seq).to(torch.int32)
                      for _ in layers]
            lens = torch.full((rows,), PROBE_CONTEXT, dtype=torch.int32)

            def one_pass(prefetch: bool) -> float:
                self.prefetch = prefetch
                start = time.perf_counter()
                for (k, v), table in zip(layers, tables):
                    self.paged_decode(query, k, v, table, lens, 1.0)
                return (time.perf_counter() - start) * 1e3

            one_pass(False)  # the pages and the library warm
            best = {"on": float("inf"), "off": float("inf")}
            for _ in range(PROBE_ROUNDS):
                for name in best:
                    best[name] = min(best[name], one_pass(name == "on"))
            _PREFETCH_TIMINGS[key] = best
        timings = _PREFETCH_TIMINGS[key]
        self.prefetch = timings["on"] < timings["off"]
        return timings

    @staticmethod
    def usable(*tensors: torch.Tensor) -> bool:
        return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)

    def paged_decode(self, query, k_cache, v_cache, block_tables, seq_lens, scale: float,
                     window: int | None = None, softcap: float | None = None,
                     sinks: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
        """query [B, Hq, D] -> [B, Hq, D]; the caches contiguous [blocks, block_size, Hkv, D];
        with a sliding `window`, over each sequence's last `window` keys only; with a `chunk`, over
        the keys of the new token's chunk only (from (L - 1) - (L - 1) % chunk on); with `softcap`, the
        scores capped to softcap * tanh(score / softcap) before the softmax; with `sinks` [Hq]
        (gpt-oss), each head's sink logit in the softmax's denominator."""
        batch, num_heads, dim = query.shape
        block_size, kv_heads = k_cache.shape[1:3]
        q = query if _rows_of(query, num_heads * dim) else query.contiguous()  # q heads of qkv rows: as they are
        tables = block_tables.to(torch.int32).contiguous()
        lens = seq_lens.to(torch.int32).contiguous()
        out = torch.empty(query.shape, dtype=query.dtype)
        sinks = sinks.float().contiguous() if sinks is not None else None
        self.lib.paged_decode_f32(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                                  lens.data_ptr(), out.data_ptr(), batch, num_heads, kv_heads, block_size,
                                  tables.shape[1], q.stride(0), scale, window or 0, chunk or 0, softcap or 0.0,
                                  sinks.data_ptr() if sinks is not None else None, int(self.prefetch),
                                  torch.get_num_threads())
        return out

    def write_kv(self, k_cache, v_cache, key, value, slot_mapping) -> bool:
        """key/value [T, Hkv, D] into their slots of the contiguous caches; False (nothing written)
        where the layout does not fit, for the caller's torch path."""
        heads, dim = k_cache.shape[2:]
        row_len = heads * dim
        if not (k_cache.is_contiguous() and v_cache.is_contiguous() and _rows_of(key, row_len)
                and _rows_of(value, row_len) and key.shape[0] == value.shape[0] == slot_mapping.numel()):
            return False
        slots = slot_mapping.to(torch.int64).contiguous()
        num_slots = k_cache.numel() // row_len
        bad = self.lib.write_kv_f32(k_cache.data_ptr(), v_cache.data_ptr(), key.data_ptr(), value.data_ptr(),
                                    slots.data_ptr(), key.shape[0], key.stride(0), value.stride(0), row_len,
                                    num_slots, torch.get_num_threads())
        if bad:
            raise IndexError(f"{bad} KV slot(s) outside the cache's {num_slots}: nothing written there")
        return True

    def add_rmsnorm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                    eps: float) -> torch.Tensor:
        """h += delta in place (when given); returns RMSNorm(h) * weight, a new [T, hidden]."""
        assert h.is_contiguous() and (delta is None or delta.shape == h.shape)
        delta = delta.contiguous() if delta is not None else None
        out = torch.empty_like(h)
        self.lib.add_rmsnorm_f32(h.data_ptr(), delta.data_ptr() if delta is not None else None,
                                 weight.data_ptr(), out.data_ptr(), h.shape[0], h.shape[1], eps,
                                 torch.get_num_threads())
        return out

    def head_rmsnorm_(self, qkv: torch.Tensor, col: int, heads: int, weight: torch.Tensor, eps: float,
                      dim: int | None = None) -> None:
        """RMSNorm per head, in place, of `heads` heads from column `col` of each [T, width] row;
        heads of `dim` values (OLMo's norm over all of q's heads: one head of q's width), else head_dim."""
        dim = dim or self.head_dim
        assert qkv.is_contiguous() and col + heads * dim <= qkv.shape[1] and weight.numel() == dim
        self.lib.head_rmsnorm_f32(qkv.data_ptr(), weight.data_ptr(), qkv.shape[0], qkv.shape[1], col, heads,
                                  dim, eps, torch.get_num_threads())

    def rope_(self, qkv: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, heads: int) -> None:
        """The first `heads` heads of each row rotated in place; table [positions, 2, rotary dim]
        (cos, sin) covers every position given, and each head's first rotary-dim values."""
        rot = table.shape[2]
        assert qkv.is_contiguous() and table.is_contiguous() and table.shape[1] == 2
        assert rot % 2 == 0 and 0 < rot <= self.head_dim
        pos = positions.to(torch.int64).contiguous()
        self.lib.rope_f32(qkv.data_ptr(), pos.data_ptr(), table.data_ptr(), qkv.shape[0], qkv.shape[1], heads,
                          self.head_dim, rot, torch.get_num_threads())

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2n] (gate | up) -> [T, n]."""
        gate_up = gate_up.contiguous()
        n = gate_up.shape[1] // 2
        out = gate_up.new_empty(gate_up.shape[0], n)
        self.lib.silu_mul_f32(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], n, torch.get_num_threads())
        return out

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Row-wise argmax of [rows, cols] as int64, torch.argmax's answer (first NaN, else first max)."""
        x = x.contiguous()
        out = torch.empty(x.shape[0], dtype=torch.int64)
        if x.shape[1]:
            self.lib.argmax_f32(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
        else:
            out = x.argmax(dim=-1)  # torch's own error for an empty row
        return out


PROBE_CONTEXT, PROBE_ROUNDS = 128, 3
PROBE_BYTES = 256 << 20  # a pass reads this much K/V at most (beyond the caches, ~10-20 ms on 2 cores)
_PREFETCH_TIMINGS: dict[tuple, dict[str, float]] = {}  # one probe per process per cache shape


def _rows_of(t: torch.Tensor, width: int) -> bool:
    """[T, heads, dim] whose rows are `width` contiguous floats each (any row stride): a view of
    the q, k or v heads in qkv rows, as the kernels read them."""
    return t.dim() == 3 and t.shape[1] * t.shape[2] == width and t.stride(2) == 1 and t.stride(1) == t.shape[2]


_I, _P, _F = ctypes.c_int, ctypes.c_void_p, ctypes.c_float
_SIGNATURES = {
    "paged_decode_f32": [_P] * 6 + [_I] * 6 + [_F, _I, _I, _F, _P, _I, _I],
    "write_kv_f32": [_P] * 5 + [_I] * 4 + [ctypes.c_int64, _I],
    "add_rmsnorm_f32": [_P] * 4 + [_I, _I, _F, _I],
    "head_rmsnorm_f32": [_P, _P] + [_I] * 5 + [_F, _I],
    "rope_f32": [_P] * 3 + [_I] * 6,
    "silu_mul_f32": [_P, _P, _I, _I, _I],
    "argmax_f32": [_P, _I, _I, _P, _I],
    "gemm_panel_width": [],
    "gemm_f32": [_P, _I, _P, _P, _P, _I, _I, _I, _I],
}
_RESTYPES = {"write_kv_f32": ctypes.c_int, "gemm_panel_width": ctypes.c_int}
_gemm_lib: ctypes.CDLL | None = None  # the first library built in this process: the linears' GEMM (linear.py)


@functools.cache
def load(head_dim: int) -> CpuKernels | None:
    """Build the kernels for this machine and head_dim; None (the torch paths) if impossible.
    Compiled with fast math where said but linked without it, so the process's denormal mode
    cannot flip; it links the libgomp torch already loaded, so both share one OpenMP thread pool."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.info("no C compiler: the CPU paths stay torch's (attention gathers, element-wise ops one by one)")
        return None
    out = Path(tempfile.mkdtemp(prefix="kvgate-cpu-"))
    (out / "fast.c").write_text(_FAST_C)
    (out / "exact.c").write_text(_EXACT_C)
    (out / "gemm.c").write_text(_GEMM_C)
    common = [cc, "-O3", "-march=native", "-fopenmp", "-fPIC", f"-DHEAD_DIM={head_dim}", "-c"]
    units = {"fast": ["-ffast-math"], "exact": ["-fno-fast-math", "-ffp-contract=off"], "gemm": ["-fno-fast-math"]}
    link = [cc, "-shared", "-fopenmp", *(str(out / f"{name}.o") for name in units), "-o", str(out / "cpu.so"), "-lm"]
    try:
        compiles = [subprocess.Popen([*common, *flags, str(out / f"{name}.c"), "-o", str(out / f"{name}.o")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                    for name, flags in units.items()]  # side by side: start-up waits for the slower
        for proc in compiles:
            _, err = proc.communicate(timeout=120)
            if proc.returncode:
                raise subprocess.CalledProcessError(proc.returncode, proc.args, stderr=err)
        subprocess.run(link, check=True, capture_output=True, timeout=120)
        lib = ctypes.CDLL(str(out / "cpu.so"))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("native CPU kernels unavailable (%s): using the torch paths", exc)
        return None
    finally:
        shutil.rmtree(out, ignore_errors=True)  # a loaded library no longer needs its file
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = _RESTYPES.get(name), argtypes
    global _gemm_lib
    _gemm_lib = _gemm_lib or lib
    return CpuKernels(lib, head_dim)


def panel_width() -> int | None:
    """Output columns per panel of gemm's weight layout on this CPU; None where no kernels are built
    in this process (they are built with the engine's fp32 CPU attention)."""
    return _gemm_lib.gemm_panel_width() if _gemm_lib is not None else None


def gemm(x: torch.Tensor, panels: torch.Tensor, n_out: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ w^T (+ bias) -> [..., n_out], w given as `panels` [ceil(n_out / NR), K, NR]
    (linear.to_panels); fp32 on CPU."""
    if _gemm_lib is None:
        raise RuntimeError("the native GEMM is not built in this process")
    k = panels.shape[1]
    rows = x.reshape(-1, k)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], n_out, dtype=torch.float32)
    bias = bias.contiguous() if bias is not None else None
    _gemm_lib.gemm_f32(rows.data_ptr(), rows.stride(0), panels.data_ptr(),
                       bias.data_ptr() if bias is not None else None, out.data_ptr(), rows.shape[0], n_out, k,
                       torch.get_num_threads())
    return out.view(*x.shape[:-1], n_out)
