"""The torch backend (gather path and native decode kernel) against naive attention over a
contiguous copy of each sequence: GQA, ragged lengths, prefill chunks mixed with decodes, with and
without a sliding window."""
import pytest
import torch

from worker.engine.attention import AttentionMetadata
from worker.engine import cpu_native
from worker.engine.torch_attention import TorchAttention

torch.set_num_threads(1)


def naive(q, k, v, scale, window=None, softcap=None, sinks=None):
    """q [n, Hq, D] = the last n positions of k/v [L, Hkv, D]; causal (within a sliding window;
    scores soft-capped with a softcap; each head's sink logit a column of the softmax, dropped
    after it, with sinks [Hq])."""
    n, hq, _ = q.shape
    L, hkv, _ = k.shape
    k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    visible = torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None]
    if window:
        visible &= torch.arange(L)[None, :] > torch.arange(L - n, L)[:, None] - window
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        probs = scores.softmax(-1)
    else:
        probs = torch.cat([scores, sinks[:, None, None].expand(-1, n, 1)], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hnl,lhd->nhd", probs, v)


def batch(query_lens, seq_lens, hq=4, hkv=2, dim=8, bs=4, num_blocks=64, seed=0):
    """Random caches, shuffled block tables, and each sequence's contiguous K/V for the reference."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, bs, hkv, dim, generator=g)
    v_cache = torch.randn(num_blocks, bs, hkv, dim, generator=g)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-L // bs))] for L in seq_lens]
    width = max(map(len, tables))
    qs = [0]
    for n in query_lens:
        qs.append(qs[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(qs[-1], dtype=torch.long), query_start_loc=torch.tensor(qs, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens))
    query = torch.randn(qs[-1], hq, dim, generator=g)
    contiguous = [(k_cache[t].reshape(-1, hkv, dim)[:L], v_cache[t].reshape(-1, hkv, dim)[:L])
                  for t, L in zip(tables, seq_lens)]
    return query, k_cache, v_cache, meta, contiguous


SINKS = torch.tensor([0.5, -1.0, 2.0, 1.0])  # gpt-oss's, one per query head


@pytest.mark.parametrize("window,softcap,sinks", [(None, None, None), (1, None, None), (6, None, None),
                                                  (None, 0.5, None), (6, 0.5, None), (None, None, SINKS),
                                                  (6, None, SINKS)])
@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("query_lens,seq_lens", [
    ([1, 1, 1, 1], [1, 5, 17, 40]),  # decode only, ragged
    ([3, 1, 9, 1], [3, 22, 13, 7]),  # prefill from scratch, chunk over a cached prefix, decodes
])
def test_matches_naive_attention(native, query_lens, seq_lens, window, softcap, sinks):
    if native and cpu_native.load(8) is None:
        pytest.skip("no C compiler here")
    query, k_cache, v_cache, meta, contiguous = batch(query_lens, seq_lens)
    backend = TorchAttention(native_decode=native)
    backend.prepare(query.shape[-1], query.dtype, query.device)  # where the native kernels are obtained
    assert (backend.kernels is not None) == native
    out = backend.attend(query, k_cache, v_cache, meta, 0.3, window, softcap, sinks)
    starts = meta.query_start_loc.tolist()
    for b, (k, v) in enumerate(contiguous):
        q = query[starts[b]:starts[b + 1]]
        torch.testing.assert_close(out[starts[b]:starts[b + 1]], naive(q, k, v, 0.3, window, softcap, sinks),
                                   atol=1e-5, rtol=1e-5)
    if softcap or sinks is not None:  # Gemma 2's soft-cap, gpt-oss's sinks change the result (the longest row)
        assert not torch.allclose(out[-1], naive(query[starts[-2]:], *contiguous[-1], 0.3, window)[-1], atol=1e-3)


def test_write_kv_lands_in_the_slots():
    backend = TorchAttention()
    k_cache, v_cache = torch.zeros(4, 2, 1, 3), torch.zeros(4, 2, 1, 3)
    key, value = torch.randn(3, 1, 3), torch.randn(3, 1, 3)
    backend.write_kv(k_cache, v_cache, key, value, torch.tensor([7, 0, 3]))
    assert torch.equal(k_cache[3, 1], key[0]) and torch.equal(k_cache[0, 0], key[1])
    assert torch.equal(v_cache[1, 1], value[2])
