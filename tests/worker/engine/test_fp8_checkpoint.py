"""FP8 checkpoints, each linear's weight in float8 e4m3 beside its scales, dequantized as it loads: "fp8"
(`weight_block_size`, as Qwen3-*-FP8 and DeepSeek-V3 are saved: `<weight>_scale_inv` one a block),
"compressed-tensors" (llm-compressor's FP8: `<weight>_scale` one an output channel, or one the tensor)
and "fbgemm_fp8" (one an output channel). The reference is the same model saved unquantized with those
dequantized weights (what transformers serves with `dequantize=True`): on the FP8 folder the engine
answers as transformers does on the reference, token for token and to the logprob, and a
tensor-parallel rank's slice of a weight — scale blocks straddling its edges — is the dequantized
weight's slice."""
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.worker.engine.test_deepseek import deepseek_dir
from tests.worker.engine.test_model_families import GREEDY, exact_on_cpu_paths, tokens
from worker.engine.llm import LLM
from worker.engine.types import SamplingParams
from worker.models.config import read_model_config
from worker.models.loader import _read_dequantized, weight_files
from worker.models.parallel import Piece

torch.set_num_threads(1)
# the linears FP8 releases quantize (DeepSeek-V3's latent projections too); routers, norms, embeddings
# and heads stay as they were
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "q_a_proj", "q_b_proj",
             "kv_a_proj_with_mqa", "kv_b_proj")
BLOCK = (16, 24)  # neither divides every weight: the last blocks of a row or column are partial
E4M3_MAX = 448.0


# how each format's config says it, and the block each scale covers (None: a row, or the whole tensor)
SCHEMES = {
    "fp8-blocks": ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": list(BLOCK)}, "_scale_inv", BLOCK),
    "compressed-channel": ({"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                "type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True}}}},
                           "_scale", "channel"),
    "compressed-tensor": ({"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                           "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                               "type": "float", "num_bits": 8, "strategy": "tensor", "symmetric": True}}}},
                          "_scale", "tensor"),
    "fbgemm-channel": ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}, "_scale", "channel"),
}


def _quantize(w: torch.Tensor, how) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float8 weight, its scales as stored, the scale of each value) as FP8 checkpoints are made: each
    block's (row's, tensor's) largest magnitude to 448."""
    block = {"channel": (1, w.shape[1]), "tensor": tuple(w.shape)}.get(how, how)
    rows, cols = (-(-n // b) for n, b in zip(w.shape, block))
    padded = torch.zeros(rows * block[0], cols * block[1])
    padded[:w.shape[0], :w.shape[1]] = w
    amax = padded.view(rows, block[0], cols, block[1]).abs().amax(dim=(1, 3))
    scale = (amax / E4M3_MAX).clamp(min=1e-12)
    each = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:w.shape[0], :w.shape[1]]
    stored = scale.reshape(1) if how == "tensor" else scale  # [out, 1] a channel's; [1] the tensor's
    return (w / each).to(torch.float8_e4m3fn), stored, each


@pytest.fixture(scope="module", params=[("qwen3", "fp8-blocks"), ("deepseek-v3", "fp8-blocks"),
                                        ("qwen3", "compressed-channel"), ("qwen3", "compressed-tensor"),
                                        ("qwen3", "fbgemm-channel")],
                ids=lambda p: "-".join(p))
def folders(request, build_tiny, tmp_path_factory):
    """(fp8 folder, reference folder, source folder): a Qwen3 (q/k norms) with an MLP 80 wide, so blocks
    of 24 split it, or a DeepSeek-V3 (latent attention, its latent 40 rows wide; experts)."""
    family, scheme = request.param
    if family == "qwen3":
        source = build_tiny("fp8-source", "qwen3", intermediate_size=80, head_dim=16)
    else:
        source = deepseek_dir("v3-q-lora-yarn", build_tiny)
    config_entry, suffix, how = SCHEMES[scheme]
    fp8, ref = tmp_path_factory.mktemp("fp8"), tmp_path_factory.mktemp("fp8-reference")
    for target in (fp8, ref):
        shutil.copytree(source, target, dirs_exist_ok=True)
    weights = load_file(str(source / "model.safetensors"))
    quantized, dequantized = dict(weights), dict(weights)
    for name, w in weights.items():
        if name.split(".")[-2] in QUANTIZED:
            q, scale, each = _quantize(w.float(), how)
            quantized[name], quantized[f"{name}{suffix}"] = q, scale
            dequantized[name] = (q.float() * each).to(w.dtype)
    assert sum(t.dtype == torch.float8_e4m3fn for t in quantized.values()) >= 2 * 7
    save_file(quantized, str(fp8 / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(ref / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8 / "config.json").read_text())
    (fp8 / "config.json").write_text(json.dumps({**config, "quantization_config": config_entry}))
    return fp8, ref, source


def test_an_fp8_folder_answers_as_transformers_on_its_dequantized_weights(folders, random_prompts, hf_greedy):
    fp8, ref, _ = folders
    assert read_model_config(fp8).fp8.suffix in ("_scale_inv", "_scale")
    answers_as_reference(fp8, ref, random_prompts(3, 5, 40, seed=8), hf_greedy)


def answers_as_reference(folder, ref, prompts, hf_greedy) -> None:
    """A quantized `folder` is token-exact with transformers on `ref` (the same model saved with the
    dequantized weights) on the CPU paths, and its first token's top 5 logprobs are the reference's."""
    expected = hf_greedy(ref, prompts, GREEDY.max_tokens)
    llm = exact_on_cpu_paths(folder, prompts, expected)
    reference = LLM(ref, attention_backend="torch")
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    [got], [want] = llm.generate(prompts[:1], params), reference.generate(prompts[:1], params)
    got, want = got.outputs[0].logprobs[0].top, want.outputs[0].logprobs[0].top
    assert [t for t, _ in got] == [t for t, _ in want]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], abs=1e-5)


def test_the_quantization_is_not_a_no_op(folders):
    """FP8 changed the weights (else the reference would be the source model, and the test above
    could pass with the scales ignored in a model that happens to answer the same)."""
    fp8, ref, source = folders
    name = "model.layers.0.mlp.down_proj.weight"
    stored, plain, before = (load_file(str(f / "model.safetensors"))[name] for f in (fp8, ref, source))
    assert stored.dtype == torch.float8_e4m3fn and plain.dtype == before.dtype == torch.float32
    assert not torch.equal(plain, before) and torch.allclose(plain, before, rtol=0.07, atol=1e-3)
    assert not torch.allclose(stored.float(), plain, atol=1e-2)  # the scales matter


@pytest.mark.parametrize("dim,start,stop", [(0, 0, 40), (0, 40, 80), (0, 13, 77), (1, 0, 32), (1, 32, 64),
                                            (1, 5, 50)])
def test_a_slice_of_an_fp8_weight_is_the_slice_of_the_dequantized_weight(folders, dim, start, stop):
    """A rank's rows (column-parallel) or columns (row-parallel), their edges inside a block."""
    fp8, ref, _ = folders
    files = weight_files(fp8)
    handles = {f: safe_open(str(f), "pt") for f in set(files.values())}
    name = "model.layers.0.mlp.gate_proj.weight" if dim == 0 else "model.layers.0.mlp.down_proj.weight"
    whole = load_file(str(ref / "model.safetensors"))[name].float()
    got = _read_dequantized(handles, files, Piece(name, dim, start, stop), read_model_config(fp8).fp8)
    assert torch.equal(got, whole.narrow(dim, start, stop - start))


@pytest.mark.parametrize("quant,says", [
    ({"quant_method": "fp8", "fmt": "e4m3"}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}, "e5m2"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, r"quantization_config \(bitsandbytes\)"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized"}, "'int-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {"weights": {
        "type": "int", "num_bits": 8, "strategy": "channel"}}}}, r"8-bit floats \(here \[\('int', 8\)\]\)"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {"weights": {
        "type": "float", "num_bits": 8, "strategy": "group", "group_size": 128}}}}, r"here \['group'\]"),
])
def test_what_the_loader_cannot_dequantize_is_refused_by_name(folders, tmp_path, quant, says):
    fp8, _, _ = folders
    shutil.copytree(fp8, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    with pytest.raises(ValueError, match=says):
        read_model_config(tmp_path / "m")


def test_an_fp8_weight_without_its_scale_is_refused_by_name(folders, tmp_path):
    fp8, _, _ = folders
    shutil.copytree(fp8, tmp_path / "m")
    weights = load_file(str(tmp_path / "m" / "model.safetensors"))
    scale = "model.layers.0.self_attn.o_proj.weight" + read_model_config(fp8).fp8.suffix
    del weights[scale]
    save_file(weights, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=scale):
        tokens(LLM(tmp_path / "m").generate([[5, 6, 7]], GREEDY))
