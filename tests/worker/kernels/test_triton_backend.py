import pytest
import torch

from worker.engine.attention import AttentionMetadata
from worker.engine.triton_attention import TritonAttentionBackend, num_kv_splits


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


def test_is_an_attention_backend():
    backend = TritonAttentionBackend()
    assert backend.name == "triton"
    assert isinstance(AttentionMetadata, type)
