"""The linears' GEMM path chosen per CPU at load (gemm_probe.py): each alternative, forced, is
token-exact with transformers' fp32 greedy; the probe's choice is recorded and exported; a path
that raises is never chosen."""
import pytest
import torch

from worker.engine.llm import LLM
from worker.engine.types import SamplingParams
from worker.models import gemm_probe
from worker.engine import cpu_native
from worker.models.linear import PACKED, PANELS, PATHS, ROWS, Linear, LinearKernel, layout_of, plain, to_panels

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


@pytest.fixture
def native_built():
    """The native GEMM exists once the engine's CPU kernels are built in the process (as any fp32 CPU
    engine does before its probe); a test of the probe alone builds them itself."""
    assert cpu_native.load(16) is not None
    assert cpu_native.panel_width()


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


def test_the_probe_times_each_layout_on_the_layers_own_weights_and_keeps_their_values(native_built):
    linears = _linears((64, 32, True), (100, 64, False))  # 100: the last panel padded
    before = [m.weight.detach().clone() for m in linears]
    timings = gemm_probe.probe(linears, (4, 32))
    assert set(timings) == {f"{name}@{n}" for name in PATHS for n in (4, 32)}
    assert layout_of(linears[0].weight) == PANELS  # re-laid in place: the last layout timed
    for m, w in zip(linears, before):
        assert torch.equal(plain(m.weight), w)


def test_a_process_without_the_native_gemm_never_takes_the_panels(monkeypatch):
    monkeypatch.setattr(gemm_probe, "can_panel", lambda: False)
    timings = gemm_probe.probe(_linears((64, 32, True), (128, 32, False)), (4, 32))
    assert "native@4" not in timings and "onednn_p@32" in timings
    assert gemm_probe._pick(timings).layout != PANELS


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 51, 64, 700])  # 700 rows of 1,000 inputs: two row chunks
@pytest.mark.parametrize("shape", [(100, 37), (64, 1000), (7, 3)])
def test_the_native_gemm_matches_torch_on_any_shape(native_built, shape, rows):
    torch.manual_seed(rows)
    out, inp = shape
    weight, bias = torch.randn(out, inp), torch.randn(out)
    panels = to_panels(weight)
    assert panels.shape == (-(-out // cpu_native.panel_width()), inp, cpu_native.panel_width())
    x = torch.randn(rows, inp)
    native = PATHS["native"][0]
    for b in (None, bias):
        expected = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
        assert torch.allclose(native(x, panels, b).double(), expected, atol=1e-4 * inp ** 0.5)
    wide = torch.randn(3, rows, 2 * inp)[..., :inp]  # a strided view with leading dims
    assert torch.allclose(native(wide, panels, bias), torch.nn.functional.linear(wide, weight, bias), atol=1e-4 * inp ** 0.5)
    assert native(x[:0], panels, bias).shape == (0, out)


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


@pytest.mark.parametrize("kernel", ["onednn_p", "native"])
def test_packed_weights_keep_their_values_and_a_tied_weight_stays_row_major(build_tiny, random_prompts,
                                                                           hf_greedy, kernel):
    model_dir = build_tiny("kernels-tied", tie_word_embeddings=True)
    prompts = random_prompts(3, 3, 30, seed=5)
    llm = LLM(model_dir, cpu_linear_kernel=kernel)
    model = llm.engine.runner.model
    assert layout_of(model.lm_head.weight) == ROWS and model.lm_head.weight is model.model.embed_tokens.weight
    assert {layout_of(m.weight) for m in model.model.layers.modules() if isinstance(m, Linear)} == {PATHS[kernel][1]}
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(5, layer.in_features)
    assert torch.allclose(layer(x), x @ plain(layer.weight).t(), atol=1e-5)
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
