"""Chunked attention (Llama 4's rotated layers: a query at p reads keys [p - p % chunk, p] only) in every
attention path — the native decode kernel, the torch path's decode and prefill, the Triton decode and
extend kernels (interpreted on CPU) — against an explicit mask over each sequence's dense K/V, written
as transformers' chunked_overlay writes it (key // chunk == query // chunk, key <= query). Sequences
cross several chunks; decodes sit at the first and the last position of a chunk; prefill pieces start
mid-chunk and straddle chunk boundaries; a chunk of 6 (not a multiple of the blocks' 4) too."""
import pytest
import torch

from tests.worker.engine.test_paged_attention import batch
from worker.engine import cpu_native
from worker.engine.torch_attention import TorchAttention

torch.set_num_threads(1)

# lengths L (the new token at L - 1) for a chunk of 8: within the first chunk, at a chunk's first position
# (L - 1 = 8, 16, 40) and its last (L - 1 = 7, 15, 47), and between (L - 1 = 29)
DECODE = ([1] * 8, [3, 8, 9, 16, 17, 30, 41, 48])
# a whole prompt across four chunks; a piece from 13 to 21 (over 16); one from 16 to 20 (from a chunk's
# first key); one from 5 to 17 (over 8 and 16); decodes beside them
PREFILL = ([29, 9, 1, 5, 12, 1], [29, 22, 17, 21, 17, 24])
SCALE = 0.3


def chunked_reference(q, k, v, chunk: int) -> torch.Tensor:
    """q [n, Hq, D] = the last n positions of k/v [L, Hkv, D]; each query reads its own chunk's keys up to itself."""
    n, hq, _ = q.shape
    L, hkv, _ = k.shape
    k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * SCALE
    keys, queries = torch.arange(L)[None, :], torch.arange(L - n, L)[:, None]
    visible = (keys // chunk == queries // chunk) & (keys <= queries)
    return torch.einsum("hnl,lhd->nhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)


def assert_chunked(out, query, meta, contiguous, chunk: int) -> None:
    starts = meta.query_start_loc.tolist()
    for b, (k, v) in enumerate(contiguous):
        got, q = out[starts[b]:starts[b + 1]], query[starts[b]:starts[b + 1]]
        torch.testing.assert_close(got, chunked_reference(q, k, v, chunk), atol=1e-5, rtol=1e-5)
    # the longest sequence's last row reads one chunk, not the whole context: causal attention differs
    last = len(contiguous) - 1
    k, v = contiguous[last]
    assert not torch.allclose(out[-1], chunked_reference(query[starts[last]:], k, v, 10 ** 6)[-1], atol=1e-3)


@pytest.mark.parametrize("chunk", [8, 6])
@pytest.mark.parametrize("query_lens,seq_lens", [DECODE, PREFILL], ids=["decode", "prefill"])
@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_the_cpu_paths_attend_within_each_querys_chunk(native, query_lens, seq_lens, chunk):
    """Native: its kernel takes the decode rows (prefill pieces stay torch's); torch: both."""
    if native and cpu_native.load(16) is None:
        pytest.skip("no C compiler here")
    query, k_cache, v_cache, meta, contiguous = batch(query_lens, seq_lens, dim=16)
    backend = TorchAttention(native_decode=native)
    backend.prepare(16, query.dtype, query.device)
    assert (backend.kernels is not None) == native
    out = backend.attend(query, k_cache, v_cache, meta, SCALE, chunk=chunk)
    assert_chunked(out, query, meta, contiguous, chunk)


def test_the_native_kernel_reads_the_chunk_with_its_prefetch_too():
    """The prefetch's last target is V's block of the first key read: the chunk's, not the context's."""
    if cpu_native.load(16) is None:
        pytest.skip("no C compiler here")
    query, k_cache, v_cache, meta, contiguous = batch(*DECODE, dim=16)
    kernels = cpu_native.load(16)
    kernels.prefetch = True
    try:
        out = kernels.paged_decode(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, SCALE, chunk=8)
    finally:
        kernels.prefetch = False
    assert_chunked(out, query, meta, contiguous, 8)


@pytest.mark.parametrize("chunk", [8, 6])
@pytest.mark.parametrize("query_lens,seq_lens", [DECODE, PREFILL], ids=["decode", "prefill"])
def test_the_triton_backend_attends_within_each_querys_chunk(query_lens, seq_lens, chunk):
    """Decode-only steps through the split-K kernel (3 splits), the rest through extend (one tile a sequence)."""
    pytest.importorskip("triton")
    from worker.engine.triton_attention import TritonAttentionBackend

    query, k_cache, v_cache, meta, contiguous = batch(query_lens, seq_lens, dim=16)
    out = TritonAttentionBackend(kv_splits=3).attend(query, k_cache, v_cache, meta, SCALE, chunk=chunk)
    assert_chunked(out, query, meta, contiguous, chunk)


@pytest.mark.parametrize("chunk", [8, 6])
def test_the_extend_kernel_starts_each_tile_at_its_first_rows_chunk(chunk):
    """Tiles of 8 new tokens (block_m 16, 2 heads a KV head) and keys in tiles of 16: a sequence's
    tiles each begin in a different chunk, and rows of one tile in different chunks."""
    pytest.importorskip("triton")
    from worker.kernels import extend_attention

    query, k_cache, v_cache, meta, contiguous = batch(*PREFILL, dim=16)
    out = extend_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                           meta.max_query_len, SCALE, block_m=16, block_n=16, chunk=chunk)
    assert_chunked(out, query, meta, contiguous, chunk)
