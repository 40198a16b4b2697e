"""Int4 and int8 checkpoints, each linear's int values packed into int32s beside its scales and zeros,
dequantized as they load: GPTQ (`qweight` packed along the input, `qzeros` along the output, zeros
stored less 1 in its classic format and as they are in gptq_v2, `g_idx` in activation order with
desc_act), AWQ (AutoAWQ's GEMM layout: packed along the output in its interleaved order) and
compressed-tensors' pack-quantized (llm-compressor's W4A16 and W8A16: values stored offset, zero
points packed along the output, or unpacked as older releases saved them). The test quantizes a tiny
model itself, packs it as each format's own packer does (written here from the formats, not from the
loader), and saves beside it a reference folder with the weights dequantized from those ints: on the
int folder the engine answers as transformers does on the reference, token for token and to the
logprob; every parameter loads as from the reference, whole or as either rank's slices under TP = 2
(Phi-3's fused q/k/v and gate/up too); a slice whose edges fall inside a group or a packed word is the
dequantized weight's slice. A linear left unquantized (its plain `.weight` in the folder) loads as it
is. What the loader cannot read is refused by name."""
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.worker.engine.test_fp8_checkpoint import answers_as_reference
from tests.worker.engine.test_model_families import GREEDY, tokens, with_norms_drawn
from worker.engine.llm import LLM
from worker.models.config import read_model_config
from worker.models.loader import _read_dequantized, load_model, weight_files
from worker.models.parallel import Piece, Shard

torch.set_num_threads(1)
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")
LEFT_ALONE = "model.layers.1.self_attn.o_proj"  # a linear the releases below leave unquantized
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's WQLinear_GEMM.from_linear: the int32's i-th 4 bits hold this column


def gptq_config(bits, group, desc_act, sym, fmt):
    """As AutoGPTQ (classic format) and GPTQModel (gptq_v2) write quantization_config."""
    config = {"bits": bits, "group_size": group, "damp_percent": 0.01, "desc_act": desc_act, "static_groups": False,
              "sym": sym, "true_sequential": True, "model_name_or_path": None, "model_file_base_name": "model",
              "quant_method": "gptq", "checkpoint_format": fmt}
    return config | ({"pack_dtype": "int32", "lm_head": False, "meta": {"quantizer": ["gptqmodel:2.2.0"]}}
                     if fmt == "gptq_v2" else {})


def compressed_config(bits, strategy, group, symmetric, actorder):
    """As llm-compressor writes a W4A16 or W8A16 folder's quantization_config."""
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": strategy, "group_size": group,
               "actorder": actorder, "block_structure": None, "dynamic": False, "observer": "minmax",
               "observer_kwargs": {}}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None}},
            "ignore": ["lm_head", LEFT_ALONE], "kv_cache_scheme": None, "global_compression_ratio": None}


# name: (family, format, bits, group size (None: one group, or a channel), symmetric, activation order, config)
SCHEMES = {
    "gptq-int4-desc-act": ("qwen3", "gptq", 4, 16, False, True, gptq_config(4, 16, True, False, "gptq")),
    "gptq-int8-no-g-idx": ("qwen2", "gptq", 8, 32, True, False, gptq_config(8, 32, False, True, "gptq")),
    "gptq-v2-one-group": ("qwen3", "gptq_v2", 4, None, False, False, gptq_config(4, -1, False, False, "gptq_v2")),
    "awq-moe": ("qwen2_moe", "awq", 4, 16, False, False, {
        "quant_method": "awq", "bits": 4, "group_size": 16, "version": "gemm", "zero_point": True,
        "modules_to_not_convert": ["gate", LEFT_ALONE]}),
    "w4a16-actorder": ("qwen3", "compressed", 4, 16, True, True, compressed_config(4, "group", 16, True, "group")),
    "w8a16-channel-asym": ("qwen2", "compressed", 8, None, False, False,
                           compressed_config(8, "channel", None, False, None)),
    "w4a16-asym-unpacked-zeros": ("qwen3", "compressed-int8-zeros", 4, 16, False, False,
                                  compressed_config(4, "group", 16, False, None)),
}


def quantize(w: torch.Tensor, bits: int, group: int | None, symmetric: bool, act_order: bool, lowest_zero: int):
    """(q [out, in] unsigned ints, zeros [out, groups], scales [out, groups] in fp16, g_idx [in]): each
    group's range spread over the bits; in activation order, the groups take the columns in a shuffled
    order (desc_act's), so g_idx is not sorted."""
    out, inputs = w.shape
    order = torch.randperm(inputs, generator=torch.Generator().manual_seed(inputs)) if act_order \
        else torch.arange(inputs)
    g_idx = torch.empty(inputs, dtype=torch.long)
    g_idx[order] = torch.arange(inputs) // (group or inputs)
    groups, top = int(g_idx.max()) + 1, (1 << bits) - 1
    scales, zeros = torch.empty(out, groups), torch.empty(out, groups, dtype=torch.long)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if symmetric:
            scales[:, g], zeros[:, g] = cols.abs().amax(1) / (top // 2), 1 << (bits - 1)
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            scales[:, g] = (hi - lo) / top
            zeros[:, g] = (-lo / scales[:, g]).round().clamp(lowest_zero, top).long()
    scales = scales.half()
    q = ((w / scales.float()[:, g_idx]).round().long() + zeros[:, g_idx]).clamp(0, top)
    return q, zeros, scales, g_idx


def dequantized(q, zeros, scales, g_idx) -> torch.Tensor:
    return (q - zeros[:, g_idx]).float() * scales.float()[:, g_idx]


def pack(values: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """int32 words of 32 / bits values along dim (padded with zeros), the first value in the lowest
    bits; with an order, a word's i-th bits hold value order[i] of its group (AWQ's)."""
    per = 32 // bits
    v = values.long().movedim(dim, -1)
    v = torch.nn.functional.pad(v, (0, -v.shape[-1] % per)).unflatten(-1, (-1, per))
    if order is not None:
        v = v[..., list(order)]
    words = (v << (bits * torch.arange(per))).sum(-1)  # the values' bits do not overlap: a sum is an or
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32).movedim(-1, dim).contiguous()


def packed_tensors(prefix: str, w: torch.Tensor, scheme: str) -> tuple[dict, torch.Tensor]:
    """A linear's weight [out, in] quantized and packed as the scheme's format saves it; and the weight
    dequantized from those ints."""
    _, fmt, bits, group, symmetric, act_order, _ = SCHEMES[scheme]
    q, zeros, scales, g_idx = quantize(w, bits, group, symmetric, act_order, 1 if fmt == "gptq" else 0)
    if fmt in ("gptq", "gptq_v2"):
        stored = {"qweight": pack(q.T, bits, 0), "qzeros": pack(zeros.T - int(fmt == "gptq"), bits, 1),
                  "scales": scales.T.contiguous()}
        stored |= {"g_idx": g_idx.to(torch.int32)} if scheme != "gptq-int8-no-g-idx" else {}
    elif fmt == "awq":
        stored = {"qweight": pack(q.T, 4, 1, AWQ_ORDER), "qzeros": pack(zeros.T, 4, 1, AWQ_ORDER),
                  "scales": scales.T.contiguous()}
    else:  # compressed-tensors: unsigned values are the signed ones + 2^(bits - 1), as its zero points
        stored = {"weight_packed": pack(q, bits, 1), "weight_scale": scales.to(torch.bfloat16 if bits == 4 else
                                                                              torch.float16),
                  "weight_shape": torch.tensor(w.shape)}
        scales = stored["weight_scale"]
        if act_order:
            stored["weight_g_idx"] = g_idx.to(torch.int32)
        if not symmetric:
            stored["weight_zero_point"] = pack(zeros, bits, 0) if fmt == "compressed" \
                else (zeros - (1 << (bits - 1))).to(torch.int8)
    return {f"{prefix}.{k}": v for k, v in stored.items()}, dequantized(q, zeros, scales, g_idx)


def quantized_folders(source, scheme: str, int_dir, ref_dir):
    """The source model quantized into int_dir (its config saying so), dequantized into ref_dir."""
    for target in (int_dir, ref_dir):
        shutil.copytree(source, target, dirs_exist_ok=True)
    weights = load_file(str(source / "model.safetensors"))
    packed, plain = {}, dict(weights)
    for name, w in weights.items():
        prefix = name.removesuffix(".weight")
        if name.endswith(".weight") and prefix.split(".")[-1] in QUANTIZED and prefix != LEFT_ALONE:
            stored, plain[name] = packed_tensors(prefix, w.float(), scheme)
            packed.update(stored)
        else:
            packed[name] = w
    assert sum(k.endswith(("qweight", "weight_packed")) for k in packed) >= 2 * 4 - 1  # Phi-3: 4 linears a layer
    save_file(packed, str(int_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(plain, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((int_dir / "config.json").read_text())
    (int_dir / "config.json").write_text(json.dumps({**config, "quantization_config": SCHEMES[scheme][-1]}))
    return int_dir, ref_dir


def source_model(family: str, build_tiny):
    """A tiny Qwen3 (q/k norms), Qwen2 (q/k/v biases, drawn) or Qwen2-MoE (experts 32 wide, a shared
    expert 48 wide, routers and the shared expert's gate left unquantized)."""
    if family == "qwen2_moe":
        return build_tiny("int-source-qwen2-moe", "qwen2_moe", config_extra=dict(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48))
    if family == "qwen2":
        return with_norms_drawn(build_tiny("int-source-qwen2", "qwen2"), seed=3, bias_std=0.1)
    return build_tiny(f"int-source-{family}", family)


@pytest.fixture(scope="module", params=list(SCHEMES))
def folders(request, build_tiny, tmp_path_factory):
    """(int folder, reference folder, source folder, scheme)."""
    source = source_model(SCHEMES[request.param][0], build_tiny)
    int_dir, ref_dir = quantized_folders(source, request.param, tmp_path_factory.mktemp(request.param),
                                         tmp_path_factory.mktemp(f"{request.param}-reference"))
    return int_dir, ref_dir, source, request.param


def test_an_int_folder_answers_as_transformers_on_its_dequantized_weights(folders, random_prompts, hf_greedy):
    int_dir, ref, *_ = folders
    assert read_model_config(int_dir).int_weights is not None
    answers_as_reference(int_dir, ref, random_prompts(3, 5, 40, seed=9), hf_greedy)


def test_the_quantization_is_not_a_no_op(folders):
    """The ints changed the weights (else the reference would be the source model), within a few
    percent; the linear left alone is stored, and loads, as it was."""
    int_dir, ref, source, _ = folders
    stored, plain, before = (load_file(str(f / "model.safetensors")) for f in (int_dir, ref, source))
    name = next(n for n in plain if n.endswith("down_proj.weight"))
    assert name not in stored and not torch.equal(plain[name], before[name])
    assert (plain[name] - before[name]).norm() < 0.25 * before[name].norm()
    assert torch.equal(stored[f"{LEFT_ALONE}.weight"], before[f"{LEFT_ALONE}.weight"])


def loaded(folder, rank: int = 0, size: int = 1) -> dict[str, torch.Tensor]:
    """Every parameter of the model a rank of `size` loads from the folder."""
    model = load_model(folder, read_model_config(folder), torch.device("cpu"), torch.float32, None, Shard(rank, size))
    return dict(model.named_parameters())


@pytest.mark.parametrize("rank,size", [(0, 1), (0, 2), (1, 2)])
def test_every_parameter_loads_as_from_the_reference(folders, rank, size):
    """Under TP = 2 each rank holds q/k/v's and gate/up's rows (fused into one parameter from their
    parts) and o's and down's columns: each the dequantized weight's."""
    int_dir, ref, *_ = folders
    got, want = loaded(int_dir, rank, size), loaded(ref, rank, size)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_phi3_fused_qkv_and_gate_up_load_as_from_the_reference(tmp_path, build_tiny):
    """Phi-3 stores q/k/v as one qkv_proj and gate/up as one gate_up_proj: quantized as wholes, each
    part's rows (and a rank's share of them) dequantized from there."""
    source = build_tiny("int-source-phi3", "phi3")
    int_dir, ref = quantized_folders(source, "gptq-int4-desc-act", tmp_path / "int", tmp_path / "ref")
    assert "model.layers.0.self_attn.qkv_proj.qweight" in load_file(str(int_dir / "model.safetensors"))
    for rank, size in ((0, 1), (0, 2), (1, 2)):
        got, want = loaded(int_dir, rank, size), loaded(ref, rank, size)
        assert all(torch.equal(got[name], want[name]) for name in want)


def edges(n: int) -> list[tuple[int, int]]:
    """Two ranks' halves, and a slice whose edges fall inside a group and inside a packed word."""
    return [(0, n // 2), (n // 2, n), (3, n - 5)]


@pytest.mark.parametrize("dim", [0, 1])
def test_a_slice_of_an_int_weight_is_the_slice_of_the_dequantized_weight(folders, dim):
    """A rank's rows (column-parallel: gate) or columns (row-parallel: down), an expert's in the MoE."""
    int_dir, ref, *_ = folders
    files = weight_files(int_dir)
    handles = {f: safe_open(str(f), "pt") for f in set(files.values())}
    whole = load_file(str(ref / "model.safetensors"))
    part = "gate_proj" if dim == 0 else "down_proj"
    name = next(n for n in whole if n.endswith(f"{part}.weight") and "shared" not in n)
    ints = read_model_config(int_dir).int_weights
    for start, stop in edges(whole[name].shape[dim]):
        got = _read_dequantized(handles, files, Piece(name, dim, start, stop), None, ints)
        assert torch.equal(got, whole[name].float().narrow(dim, start, stop - start)), (start, stop)


@pytest.mark.parametrize("quant,says", [
    (gptq_config(3, 128, False, True, "gptq"), "gptq with bits 3"),
    (gptq_config(2, 128, False, True, "gptq"), "gptq with bits 2"),
    (gptq_config(4, 128, False, True, "marlin"), "gptq in checkpoint_format 'marlin'"),
    (gptq_config(4, 128, False, True, "gptq") | {"dynamic": {"-:.*down_proj": {}}}, "dynamic"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv", "zero_point": True},
     "awq version 'gemv'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "backend": "llm-awq"}, "'llm-awq'"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128, "version": "gemm"}, "awq with bits 8"),
    (gptq_config(4, 128, False, True, "gptq") | {"is_marlin_format": True}, "checkpoint_format 'marlin'"),
    (compressed_config(4, "tensor", None, True, None), "4-bit int weights by tensor"),
    (compressed_config(4, "group", 128, True, None) | {"sparsity_config": {"format": "sparse-24-bitmask"}},
     "sparsity_config format 'sparse-24-bitmask'"),
    (compressed_config(4, "group", 0, True, None), "group_size 0"),
    (compressed_config(4, "group", 128, True, None) | {"config_groups": {
        "a": {"weights": {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128}},
        "b": {"weights": {"type": "int", "num_bits": 8, "strategy": "group", "group_size": 128}}}},
     "quantized alike"),
])
def test_what_the_loader_cannot_dequantize_is_refused_by_name(folders, tmp_path, quant, says):
    int_dir, *_ = folders
    shutil.copytree(int_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    with pytest.raises(ValueError, match=says):
        read_model_config(tmp_path / "m")


def damaged(folder, tmp_path, change) -> object:
    shutil.copytree(folder, tmp_path / "m")
    weights = load_file(str(tmp_path / "m" / "model.safetensors"))
    change(weights)
    save_file(weights, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    return tmp_path / "m"


def test_a_wrong_shaped_or_missing_int_tensor_is_refused_by_name(folders, tmp_path):
    int_dir, _, _, scheme = folders
    fmt, act_order = SCHEMES[scheme][1], SCHEMES[scheme][5]
    prefix = "model.layers.0.self_attn.o_proj"
    if fmt.startswith(("gptq", "awq")):
        zeros = f"{prefix}.qzeros"
        folder = damaged(int_dir, tmp_path, lambda w: w.update({zeros: w[zeros][:, :-1].contiguous()}))
        message = rf"{zeros} is \[\d+, \d+\]: .* needs \[\d+, \d+\]"
    else:
        scale = f"{prefix}.weight_scale"
        folder = damaged(int_dir, tmp_path, lambda w: w.update({scale: w[scale][:-1].contiguous()}))
        message = rf"{scale} is \[\d+, \d+\]: .* needs \[\d+, \d+\]"
    with pytest.raises(ValueError, match=message):
        tokens(LLM(folder).generate([[5, 6, 7]], GREEDY))
    if act_order:
        g_idx = f"{prefix}.g_idx" if fmt == "gptq" else f"{prefix}.weight_g_idx"
        folder = damaged(int_dir, tmp_path / "no-g-idx", lambda w: w.pop(g_idx))
        with pytest.raises(ValueError, match=rf"{g_idx} is missing"):
            tokens(LLM(folder).generate([[5, 6, 7]], GREEDY))
