import pytest
import torch

from worker.kernels import extend_attention

CASES = {
    # name: (seq_lens, query_lens); block size 4
    "prefill_ragged": ([1, 4, 7, 16, 19], [1, 4, 7, 16, 19]),
    "cached_prefix": ([9, 12, 21], [3, 4, 9]),  # contexts 6, 8 (a block boundary) and 12
    "chunk_with_decode_rows": ([13, 1, 8, 30], [1, 1, 5, 1]),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("block_m,window", [  # block_m 16: several query tiles per sequence
    (16, None), (64, None),
    (16, 1), (16, 5), (16, 16), (64, 5)])  # a sliding window: one key, within a tile, past most rows
def test_matches_reference(device, paged_batch, reference, case, block_m, window):
    seq_lens, query_lens = CASES[case]
    batch = paged_batch(seq_lens, query_lens, q_heads=4, kv_heads=2, device=device)
    meta = batch.meta
    got = extend_attention(batch.query, batch.k_cache, batch.v_cache, meta.block_tables,
                           meta.seq_lens, meta.query_start_loc, meta.max_query_len, 0.25,
                           block_m=block_m, block_n=16, window=window)
    want = reference(batch.query, batch.k_cache, batch.v_cache, meta, 0.25, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_a_soft_cap_caps_every_score(device, paged_batch, reference, window):
    """Gemma 2's cap * tanh(score / cap), several query tiles a sequence, decode rows among them."""
    seq_lens, query_lens = CASES["chunk_with_decode_rows"]
    batch = paged_batch(seq_lens, query_lens, q_heads=4, kv_heads=2, device=device)
    meta = batch.meta
    got = extend_attention(batch.query, batch.k_cache, batch.v_cache, meta.block_tables, meta.seq_lens,
                           meta.query_start_loc, meta.max_query_len, 0.25, block_m=16, block_n=16, window=window,
                           softcap=0.5)
    torch.testing.assert_close(got, reference(batch.query, batch.k_cache, batch.v_cache, meta, 0.25, window,
                                              softcap=0.5), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, reference(batch.query, batch.k_cache, batch.v_cache, meta, 0.25, window),
                              atol=1e-3)


@pytest.mark.parametrize("window", [None, 5])
def test_sinks_count_once_in_every_softmax(device, paged_batch, reference, window):
    """gpt-oss's sink logit per head in each row's denominator, several query tiles a sequence,
    decode rows among them."""
    seq_lens, query_lens = CASES["chunk_with_decode_rows"]
    batch = paged_batch(seq_lens, query_lens, q_heads=4, kv_heads=2, device=device)
    meta, sinks = batch.meta, torch.tensor([0.5, -1.0, 2.0, 1.0], device=device)
    got = extend_attention(batch.query, batch.k_cache, batch.v_cache, meta.block_tables, meta.seq_lens,
                           meta.query_start_loc, meta.max_query_len, 0.25, block_m=16, block_n=16, window=window,
                           sinks=sinks)
    torch.testing.assert_close(got, reference(batch.query, batch.k_cache, batch.v_cache, meta, 0.25, window,
                                              sinks=sinks), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, reference(batch.query, batch.k_cache, batch.v_cache, meta, 0.25, window),
                              atol=1e-3)


def test_odd_group_and_head_dim(device, paged_batch, reference):
    # 6 query heads on 2 kv heads (group 3, padded to 4), head_dim 24 (padded to 32)
    batch = paged_batch([11, 5], [6, 5], q_heads=6, kv_heads=2, head_dim=24, block_size=8,
                       device=device)
    meta = batch.meta
    got = extend_attention(batch.query, batch.k_cache, batch.v_cache, meta.block_tables,
                           meta.seq_lens, meta.query_start_loc, meta.max_query_len, 0.2,
                           block_m=16, block_n=16)
    want = reference(batch.query, batch.k_cache, batch.v_cache, meta, 0.2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
