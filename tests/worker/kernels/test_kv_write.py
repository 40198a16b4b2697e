import torch

from worker.kernels import write_kv


def test_writes_rows_at_their_slots_and_nowhere_else(device):
    num_blocks, block_size, kv_heads, head_dim = 5, 4, 2, 24  # head_dim not a power of two
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(device)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(device)
    # K and V as views into one fused projection output, as a model produces them
    kv = torch.randn(6, 2, kv_heads, head_dim, generator=gen).to(device)
    key, value = kv[:, 0], kv[:, 1]
    slots = torch.tensor([0, 3, 4, 19, -1, 9], dtype=torch.int64, device=device)  # -1: padding

    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expect_k[slot // block_size, slot % block_size] = key[t]
            expect_v[slot // block_size, slot % block_size] = value[t]

    write_kv(k_cache, v_cache, key, value, slots)
    assert torch.equal(k_cache, expect_k)
    assert torch.equal(v_cache, expect_v)


def test_casts_to_the_cache_dtype(device):
    k_cache = torch.zeros(2, 4, 1, 16, dtype=torch.float16, device=device)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(3, 1, 16, device=device)
    write_kv(k_cache, v_cache, key, -key, torch.tensor([1, 2, 7], device=device))
    assert torch.equal(k_cache.view(8, 16)[[1, 2, 7]], key[:, 0].half())
    assert torch.equal(v_cache.view(8, 16)[[1, 2, 7]], -key[:, 0].half())
