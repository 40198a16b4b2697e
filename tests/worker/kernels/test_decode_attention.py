import pytest
import torch

from worker.kernels import decode_attention

# block size 4: lengths 4, 8 and 16 end exactly on a block boundary, 1 is a lone token;
# 70 gives every split of 3 or 4 more than one key tile, so the running rescale is exercised
RAGGED = [1, 4, 5, 8, 13, 16, 17, 70]


@pytest.mark.parametrize("splits", [1, 3, 4])  # 3 and 4: the split path and its merge
def test_ragged_gqa_matches_reference(device, paged_batch, reference, splits):
    batch = paged_batch(RAGGED, [1] * len(RAGGED), q_heads=4, kv_heads=2, device=device)
    scale = 0.25
    got = decode_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta.block_tables,
                           batch.meta.seq_lens, scale, num_kv_splits=splits, block_n=16)
    want = reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_more_splits_than_tiles_and_wide_groups(device, paged_batch, reference):
    # 8 query heads on 1 kv head; 8 splits of a 5-token context leave most splits empty
    batch = paged_batch([5, 40], [1, 1], q_heads=8, kv_heads=1, head_dim=24, block_size=8,
                       device=device)
    got = decode_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta.block_tables,
                           batch.meta.seq_lens, 0.3, num_kv_splits=8, block_n=16)
    want = reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, 0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_padding_row_of_length_zero_gives_zeros(device, paged_batch, reference):
    batch = paged_batch([6, 3], [1, 1], device=device)
    seq_lens = torch.tensor([6, 0], dtype=torch.int32, device=device)
    got = decode_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta.block_tables,
                           seq_lens, 0.25, num_kv_splits=2, block_n=16)
    want = reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, 0.25)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(got[1], torch.zeros_like(got[1]))


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("window", [1, 6, 16])  # one key; a window inside a block; one past most lengths
def test_a_sliding_window_reads_the_last_keys_only(device, paged_batch, reference, splits, window):
    batch = paged_batch(RAGGED, [1] * len(RAGGED), q_heads=4, kv_heads=2, device=device)
    got = decode_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta.block_tables,
                           batch.meta.seq_lens, 0.25, num_kv_splits=splits, block_n=16, window=window)
    want = reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, 0.25, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got[-1], reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, 0.25)[-1])


@pytest.mark.parametrize("splits", [1, 3])
def test_a_soft_cap_caps_every_score(device, paged_batch, reference, splits):
    """Gemma 2's cap * tanh(score / cap), with a window too; a cap of 0.5 changes every row."""
    batch = paged_batch(RAGGED, [1] * len(RAGGED), q_heads=4, kv_heads=2, device=device)
    for window in (None, 6):
        got = decode_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta.block_tables,
                               batch.meta.seq_lens, 0.25, num_kv_splits=splits, block_n=16, window=window,
                               softcap=0.5)
        want = reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, 0.25, window, softcap=0.5)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        uncapped = reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, 0.25, window)
        assert not torch.allclose(got[-1], uncapped[-1], atol=1e-3)


@pytest.mark.parametrize("splits", [1, 3])
def test_sinks_count_once_in_every_softmax(device, paged_batch, reference, splits):
    """gpt-oss's sink logit per head, in the denominator once however many splits the merge sums
    (with a window too); sinks around the scores' size change every row."""
    batch = paged_batch(RAGGED, [1] * len(RAGGED), q_heads=4, kv_heads=2, device=device)
    sinks = torch.tensor([0.5, -1.0, 2.0, 1.0], device=device)
    for window in (None, 6):
        got = decode_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta.block_tables,
                               batch.meta.seq_lens, 0.25, num_kv_splits=splits, block_n=16, window=window,
                               sinks=sinks)
        want = reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, 0.25, window, sinks=sinks)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        plain = reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, 0.25, window)
        assert not torch.allclose(got[-1], plain[-1], atol=1e-3)
