"""The linears' GEMM path chosen per CPU at load (gemm_probe.py): each alternative, forced, is
token-exact with transformers' fp32 greedy; the probe's choice is recorded and exported; a path
that raises is never chosen."""
import pytest
import torch

from worker.engine.llm import LLM
from worker.engine.types import SamplingParams
from worker.models import gemm_probe
from worker.models.linear import PACKED, PATHS, ROWS, Linear, LinearKernel, layout_of

torch.set_num_threads(1)
MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


@pytest.fixture(scope="module")
def case(build_tiny, random_prompts, hf_greedy):
    model_dir = build_tiny("kernels-qwen2", "qwen2")  # q/k/v biases: the bias goes through each path
    prompts = random_prompts(6, 3, 40, seed=3)
    return model_dir, prompts, hf_greedy(model_dir, prompts, MAX_NEW)


@pytest.mark.parametrize("kernel", list(PATHS))
def test_each_forced_kernel_is_token_exact(case, kernel):
    model_dir, prompts, expected = case
    llm = LLM(model_dir, cpu_linear_kernel=kernel)
    runner = llm.engine.runner
    assert (runner.kernels.kernel, runner.kernels.source) == (LinearKernel(kernel, kernel), "forced")
    layouts = {layout_of(m.weight) for m in runner.model.modules() if isinstance(m, Linear)}
    assert layouts == {PATHS[kernel][1]}  # the weights are in the kernel's layout
    assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected


def test_the_probe_records_its_choice_and_it_is_exact(case):
    model_dir, prompts, expected = case
    llm = LLM(model_dir)
    choice = llm.engine.runner.kernels
    assert choice.source == "probe"
    assert {k.split("@")[0] for k in choice.timings_ms} == set(PATHS)  # every path timed on this CPU
    assert all(t > 0 for t in choice.timings_ms.values())
    assert llm.engine.kv_cache.linear_kernel == choice.label()
    assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected


def _linears(*shapes):
    torch.manual_seed(0)
    return [Linear(inp, out, bias=bias) for out, inp, bias in shapes]


def test_a_path_that_raises_is_never_chosen(monkeypatch):
    def broken(x, w, b):
        raise RuntimeError("no such kernel on this CPU")

    monkeypatch.setitem(PATHS, "onednn", (broken, ROWS))
    timings = gemm_probe.probe(_linears((64, 32, True), (64, 32, True), (128, 32, False)), (4, 32))
    assert "onednn@4" not in timings and "aten@32" in timings
    assert "onednn" not in (gemm_probe._pick(timings).small, gemm_probe._pick(timings).large)


def test_the_probe_times_each_layout_on_the_layers_own_weights_and_keeps_their_values():
    linears = _linears((64, 32, True), (128, 64, False))
    before = [m.weight.detach().clone() for m in linears]
    timings = gemm_probe.probe(linears, (4, 32))
    assert set(timings) == {f"{name}@{n}" for name in PATHS for n in (4, 32)}
    assert layout_of(linears[0].weight) == PACKED  # re-laid in place: the last layout timed
    for m, w in zip(linears, before):
        assert torch.equal(m.weight.to_dense(), w)


def test_pick_takes_the_layout_best_at_both_sizes_then_each_sizes_fastest():
    timings = {"onednn@4": 10, "aten@4": 8, "onednn_t@4": 2, "aten_t@4": 3,
               "onednn@64": 50, "aten@64": 70, "onednn_t@64": 60, "aten_t@64": 55}
    assert gemm_probe._pick(timings) == LinearKernel("onednn_t", "aten_t")
    timings["onednn@64"] = 10  # now row-major wins at 64 rows by more than it loses at 4
    assert gemm_probe._pick(timings) == LinearKernel("aten", "onednn")


def test_pick_takes_the_packed_layout_where_it_wins_at_both_sizes():
    timings = {"onednn@4": 10, "aten@4": 8, "onednn_t@4": 6, "aten_t@4": 5, "onednn_p@4": 4,
               "onednn@64": 50, "aten@64": 70, "onednn_t@64": 60, "aten_t@64": 55, "onednn_p@64": 40}
    assert gemm_probe._pick(timings) == LinearKernel("onednn_p", "onednn_p")
    timings["onednn_p@4"] = 20  # 5x the fastest at 4 rows outweighs 0.8x at 64
    assert gemm_probe._pick(timings).small == "aten_t"


def test_a_build_that_cannot_pack_never_takes_the_packed_path(monkeypatch):
    monkeypatch.setattr(gemm_probe, "can_pack", lambda: False)
    timings = gemm_probe.probe(_linears((64, 32, True), (128, 32, False)), (4, 32))
    assert "onednn_p@4" not in timings and "onednn_t@32" in timings
    assert gemm_probe._pick(timings).layout != PACKED


def test_packed_weights_keep_their_values_and_a_tied_weight_stays_row_major(build_tiny, random_prompts,
                                                                           hf_greedy):
    model_dir = build_tiny("kernels-tied", tie_word_embeddings=True)
    prompts = random_prompts(3, 3, 30, seed=5)
    llm = LLM(model_dir, cpu_linear_kernel="onednn_p")
    model = llm.engine.runner.model
    assert layout_of(model.lm_head.weight) == ROWS and model.lm_head.weight is model.model.embed_tokens.weight
    assert {layout_of(m.weight) for m in model.model.layers.modules() if isinstance(m, Linear)} == {PACKED}
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(5, layer.in_features)
    assert torch.allclose(layer(x), x @ layer.weight.to_dense().t(), atol=1e-5)
    assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == hf_greedy(model_dir, prompts, MAX_NEW)


def test_an_unknown_kernel_is_refused_naming_the_choices(tmp_path):
    with pytest.raises(ValueError, match="unknown linear kernel 'mkl': auto, onednn, aten"):
        LinearKernel("mkl", "mkl")


def test_the_native_kernels_are_compiled_when_the_engine_is_built_not_by_a_request(case):
    """Compiled by the first decode step, they made a fresh worker's first request ~0.2 s late."""
    from worker.engine import cpu_native

    model_dir, prompts, expected = case
    cpu_native.load.cache_clear()
    llm = LLM(model_dir)  # auto: torch attention with the native kernels on CPU, fp32
    built = cpu_native.load.cache_info()
    assert built.misses == 1 and built.currsize == 1
    runner = llm.engine.runner
    assert runner.model.cpu_kernels is runner.cpu_kernels is not None  # the model's fused path is on
    assert [r.token_ids for r in llm.generate(prompts[:2], GREEDY)] == expected[:2]
    assert cpu_native.load.cache_info().misses == 1  # the decode steps compiled nothing
