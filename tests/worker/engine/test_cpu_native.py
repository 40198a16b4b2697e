"""The native fp32 CPU kernels (cpu_native.py) against the torch ops they replace, one by one, and
the model's fused forward against its torch forward on the three architectures: rope is
bit-identical, the norms and SiLU within float rounding, argmax is torch's answer (first NaN, else
first maximum), and the engine stays token-exact with transformers' greedy."""
import pytest
import torch
import torch.nn.functional as F

from worker.engine import cpu_native
from worker.engine.llm import LLM
from worker.engine.types import SamplingParams
from worker.models.llama import RMSNorm, _rotate_half

HEAD_DIM = 16


@pytest.fixture(scope="module")
def ops():
    kernels = cpu_native.load(HEAD_DIM)
    if kernels is None:
        pytest.fail("no C compiler: the native kernels cannot be built here")  # CI has one
    return kernels


def norm_of(dim: int, seed: int) -> RMSNorm:
    norm = RMSNorm(dim, 1e-2)  # large enough that a wrong eps shows
    norm.weight.data = torch.randn(dim, generator=torch.Generator().manual_seed(seed))
    return norm


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_add_rmsnorm_updates_the_residual_and_normalises_it(ops, rows):
    g = torch.Generator().manual_seed(rows)
    h, delta, norm = torch.randn(rows, 96, generator=g), torch.randn(rows, 96, generator=g), norm_of(96, rows)
    expected_h = h + delta
    out = ops.add_rmsnorm(h, delta, norm.weight, norm.eps)
    assert torch.equal(h, expected_h)  # in place, the same sums as torch's
    torch.testing.assert_close(out, norm(expected_h), rtol=1e-6, atol=1e-6)
    alone = ops.add_rmsnorm(h.clone(), None, norm.weight, norm.eps)
    torch.testing.assert_close(alone, norm(h), rtol=1e-6, atol=1e-6)


def test_head_rmsnorm_normalises_only_the_heads_named(ops):
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, 6 * HEAD_DIM, generator=g)
    before, norm = qkv.clone(), norm_of(HEAD_DIM, 2)
    ops.head_rmsnorm_(qkv, 2 * HEAD_DIM, 3, norm.weight, norm.eps)  # heads 2, 3, 4
    heads = before.view(5, 6, HEAD_DIM)
    torch.testing.assert_close(qkv.view(5, 6, HEAD_DIM)[:, 2:5], norm(heads[:, 2:5]), rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv.view(5, 6, HEAD_DIM)[:, [0, 1, 5]], heads[:, [0, 1, 5]])


def test_rope_is_bit_identical_to_torch_and_leaves_v_alone(ops):
    g = torch.Generator().manual_seed(3)
    positions = torch.tensor([0, 5, 17, 2, 300])
    angles = torch.arange(400).float()[:, None] * torch.rand(HEAD_DIM // 2, generator=g)[None]
    emb = torch.cat((angles, angles), dim=-1)
    table = torch.stack((emb.cos(), emb.sin()), dim=1).contiguous()  # [positions, 2, head_dim]
    q_heads, k_heads, v_heads = 4, 2, 2
    qkv = torch.randn(5, (q_heads + k_heads + v_heads) * HEAD_DIM, generator=g)
    heads = qkv.clone().view(5, -1, HEAD_DIM)
    cos, sin = table[positions, :1], table[positions, 1:]
    ops.rope_(qkv, positions, table, q_heads + k_heads)
    rotated = heads[:, :q_heads + k_heads]
    assert torch.equal(qkv.view(5, -1, HEAD_DIM)[:, :q_heads + k_heads], rotated * cos + _rotate_half(rotated) * sin)
    assert torch.equal(qkv.view(5, -1, HEAD_DIM)[:, q_heads + k_heads:], heads[:, q_heads + k_heads:])


def test_silu_mul_matches_torch(ops):
    gate_up = torch.randn(9, 2 * 200, generator=torch.Generator().manual_seed(4)) * 6
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up, rtol=1e-6, atol=1e-6)


def test_argmax_is_torchs_answer_on_ties_nans_and_infinities(ops):
    x = torch.randn(8, 1000, generator=torch.Generator().manual_seed(5))
    x[1, 10] = x[1, 900] = 50.0  # a tie: the first
    x[2, 300], x[2, 7] = float("nan"), 99.0  # a NaN wins, wherever the maximum is
    x[3, 20], x[3, 10] = float("nan"), float("nan")  # the first NaN
    x[4] = float("-inf")  # nothing above -inf: index 0
    x[5, 999] = float("inf")
    x[6, 0] = 1e30
    assert torch.equal(ops.argmax(x), x.argmax(dim=-1))
    assert torch.equal(ops.argmax(x[:, :1]), torch.zeros(8, dtype=torch.int64))
    wide = torch.randn(3, 32000)
    assert torch.equal(ops.argmax(wide[:, ::2]), wide[:, ::2].argmax(dim=-1))  # a strided view too


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_the_fused_forward_matches_the_torch_forward_and_transformers_greedy(build_tiny, random_prompts,
                                                                             hf_greedy, arch):
    """Llama (the tiny models have GQA), Qwen2 (q/k/v biases), Qwen3 (per-head q/k RMSNorm): the engine with the
    native kernels is token-exact with transformers; its logits are the torch forward's within
    float rounding on a batch mixing prefills and decodes."""
    model_dir = build_tiny(f"native-{arch}", arch)
    prompts = random_prompts(5, 3, 40, seed=11)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    llm = LLM(model_dir)
    runner = llm.engine.runner
    assert runner.model.cpu_kernels is not None
    assert [r.token_ids for r in llm.generate(prompts, params)] == hf_greedy(model_dir, prompts, 12)
    fused, reference = [], []
    for kernels, out in ((runner.cpu_kernels, fused), (None, reference)):
        runner.model.cpu_kernels = kernels
        runner.sampler._cpu_kernels = kernels
        seen = []
        forward = runner.model.forward
        runner.model.forward = lambda *a, _f=forward, _s=seen: _s.append(_f(*a)) or _s[-1]
        llm.generate(prompts, params)
        del runner.model.forward
        out.extend(seen)
    assert len(fused) == len(reference) > 1
    for a, b in zip(fused, reference):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)


def test_write_kv_fills_the_slots_torch_would_and_refuses_a_slot_outside_the_cache(ops):
    g = torch.Generator().manual_seed(6)
    blocks, block_size, heads = 4, 4, 2
    qkv = torch.randn(5, 3 * heads * HEAD_DIM, generator=g)  # k and v as views of qkv rows
    k = qkv[:, heads * HEAD_DIM:2 * heads * HEAD_DIM].view(5, heads, HEAD_DIM)
    v = qkv[:, 2 * heads * HEAD_DIM:].view(5, heads, HEAD_DIM)
    slots = torch.tensor([0, 5, 6, 15, 9])
    caches = [torch.zeros(blocks, block_size, heads, HEAD_DIM) for _ in range(4)]
    assert ops.write_kv(caches[0], caches[1], k, v, slots)
    caches[2].view(-1, heads, HEAD_DIM).index_copy_(0, slots, k)
    caches[3].view(-1, heads, HEAD_DIM).index_copy_(0, slots, v)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(IndexError, match="1 KV slot"):
        ops.write_kv(caches[0], caches[1], k, v, torch.tensor([0, 5, 16, 15, 9]))


def test_paged_decode_reads_query_heads_in_place_from_qkv_rows(ops):
    g = torch.Generator().manual_seed(7)
    heads, kv_heads, block_size = 4, 2, 4
    k_cache, v_cache = (torch.randn(6, block_size, kv_heads, HEAD_DIM, generator=g) for _ in range(2))
    tables, lens = torch.tensor([[0, 2, 4], [1, 3, 5]]), torch.tensor([9, 12])
    qkv = torch.randn(2, (heads + 2 * kv_heads) * HEAD_DIM, generator=g)
    q = qkv[:, :heads * HEAD_DIM].view(2, heads, HEAD_DIM)
    assert not q.is_contiguous()
    assert torch.equal(ops.paged_decode(q, k_cache, v_cache, tables, lens, 0.25),
                       ops.paged_decode(q.contiguous(), k_cache, v_cache, tables, lens, 0.25))


def test_the_decode_prefetch_changes_no_result_and_the_probe_keeps_the_faster(ops):
    g = torch.Generator().manual_seed(8)
    heads, kv_heads, block_size, pool = 4, 2, 16, 64
    caches = [tuple(torch.randn(pool, block_size, kv_heads, HEAD_DIM, generator=g) for _ in range(2))
              for _ in range(3)]
    q = torch.randn(5, heads, HEAD_DIM, generator=g)
    tables = torch.randperm(pool, generator=g)[:5 * 8].view(5, 8).to(torch.int32)
    lens = torch.tensor([1, 16, 17, 100, 128], dtype=torch.int32)  # one block, a boundary, a partial one
    outs = []
    for prefetch in (False, True):
        ops.prefetch = prefetch
        outs.append(ops.paged_decode(q, caches[0][0], caches[0][1], tables, lens, 0.25))
    assert torch.equal(*outs)
    cpu_native._PREFETCH_TIMINGS.clear()
    timings = ops.choose_prefetch(caches, heads, rows=64)
    assert set(timings) == {"on", "off"} and all(t > 0 for t in timings.values())
    assert ops.prefetch == (timings["on"] < timings["off"])
    assert len(cpu_native._PREFETCH_TIMINGS) == 1  # rows capped at what the pool holds: 64 // 8 = 8
    assert next(iter(cpu_native._PREFETCH_TIMINGS))[3] == pool // 8
    ops.prefetch = True
    assert ops.choose_prefetch([(c[:4], c[:4]) for c, _ in caches], heads, rows=8) == {}  # 4 blocks < 8
    assert ops.prefetch is False


def test_the_engine_times_the_decode_prefetch_at_start_up_and_says_which(build_tiny):
    llm = LLM(str(build_tiny("llama")), max_num_seqs=4)
    runner = llm.engine.runner
    assert runner.decode_prefetch in ("on", "off") and runner.cpu_kernels is not None
    assert runner.cpu_kernels.prefetch == (runner.decode_prefetch == "on")
    torch_only = LLM(str(build_tiny("llama")), max_num_seqs=4, attention_backend="torch")
    assert torch_only.engine.runner.decode_prefetch == "n/a"
