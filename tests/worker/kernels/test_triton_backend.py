import pytest
import torch

from worker.engine.attention import AttentionMetadata
from worker.engine.triton_attention import (MAX_EXTEND_TILE, TritonAttentionBackend, num_kv_splits,
                                            powers_of_two)
from worker.kernels.decode_attention import _decode_partial_kernel
from worker.kernels.extend_attention import _extend_kernel, extend_block_q


def _run_step(backend, batch, scale: float) -> torch.Tensor:
    """What one layer does: write this step's K/V, then attend (the cache starts without them)."""
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    slots = batch.meta.slot_mapping
    k_cache.view(-1, *k_cache.shape[2:])[slots] = 0.0
    v_cache.view(-1, *v_cache.shape[2:])[slots] = 0.0
    backend.write_kv(k_cache, v_cache, batch.new_keys, batch.new_values, slots)
    return backend.attend(batch.query, k_cache, v_cache, batch.meta, scale)


@pytest.mark.parametrize("seq_lens,query_lens", [
    ([3, 8, 9, 33], [1, 1, 1, 1]),  # decode only: the split-K kernel
    ([12, 1, 9], [4, 1, 9]),  # prefix hit, a decode row, a fresh prompt: the extend kernel
])
def test_write_then_attend_matches_reference(device, paged_batch, reference, seq_lens, query_lens):
    batch = paged_batch(seq_lens, query_lens, device=device)
    got = _run_step(TritonAttentionBackend(kv_splits=2), batch, 0.25)
    want = reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, 0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_agrees_with_the_torch_backend(device, paged_batch):
    torch_attention = pytest.importorskip("worker.engine.torch_attention")
    cls = next(v for v in vars(torch_attention).values()
               if isinstance(v, type) and getattr(v, "name", None) == "torch")
    for seq_lens, query_lens in (([5, 17], [1, 1]), ([10, 6], [3, 6])):
        batch = paged_batch(seq_lens, query_lens, device=device)
        got = _run_step(TritonAttentionBackend(), batch, 0.3)
        want = _run_step(cls(), batch, 0.3)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_split_count_fills_the_gpu_but_not_for_short_contexts():
    assert num_kv_splits(num_seqs=64, kv_heads=8, max_seq_len=4096, num_sms=132) >= 2
    assert num_kv_splits(num_seqs=1, kv_heads=8, max_seq_len=32768, num_sms=132) == 16
    assert num_kv_splits(num_seqs=1, kv_heads=8, max_seq_len=100, num_sms=132) == 1


def test_every_split_count_and_tile_a_step_picks_is_one_warm_up_builds():
    """Each split count and extend tile height is a kernel Triton compiles on first use (seconds
    on a GPU): the steps of a run may only pick from the few that warm_up launches."""
    splits = {num_kv_splits(b, h, n, sms) for b in range(1, 300) for h in (1, 2, 8)
              for n in (1, 255, 257, 1000, 4096, 131072) for sms in (4, 132)}
    assert splits == set(TritonAttentionBackend().split_choices()) == {1, 2, 4, 8, 16}
    for group in (1, 2, 3, 4, 7, 8, 16):
        tiles = {extend_block_q(group, q, MAX_EXTEND_TILE) for q in range(1, 5000)}
        assert tiles == {extend_block_q(group, q, MAX_EXTEND_TILE) for q in powers_of_two(MAX_EXTEND_TILE)}


def test_warm_up_launches_every_variant_and_leaves_the_caches_alone(device, paged_batch):
    batch = paged_batch([5, 17], [1, 1], q_heads=4, kv_heads=2, device=device)
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    launched = TritonAttentionBackend().warm_up(batch.query, k_cache, v_cache, 0.3)
    assert [n for kind, n in launched if kind == "decode"] == [1, 2, 4, 8, 16]
    assert {n for kind, n in launched if kind == "extend"} == {extend_block_q(2, q) for q in range(1, 5000)}
    assert torch.equal(k_cache, batch.k_cache) and torch.equal(v_cache, batch.v_cache)


def test_the_block_table_width_is_not_a_kernel_variant():
    """Triton specialises integer arguments equal to 1 or divisible by 16; the table's width (its
    row stride) changes with the longest sequence of each eager step."""
    for kernel in (_decode_partial_kernel, _extend_kernel):
        options = getattr(kernel, "kwargs", None) or vars(kernel)  # interpreted or compiled
        assert "stride_bt" in options["do_not_specialize"]


def test_is_an_attention_backend():
    backend = TritonAttentionBackend()
    assert backend.name == "triton"
    assert isinstance(AttentionMetadata, type)
