"""Builds a model from a local Hugging Face folder: the module from its config (worker/models/config.py),
the weights from its safetensors files — or, in a folder that has none, its PyTorch `.bin` files
(older checkpoints), read with `weights_only=True` (tensors only: a pickle cannot run code here)
and memory-mapped, so a rank's slice reads only its own bytes there too. gpt-oss's MXFP4 experts
(`<name>_blocks` and `<name>_scales` where the parameter's name is missing) are dequantized into
their parameter an expert at a time; FP8 weights (a float8 tensor with its scales, config.py's
`Fp8Scales`) and int4 and int8 ones (GPTQ's, AWQ's, compressed-tensors' packed: worker/models/int_weights.py)
into the serving dtype, a piece at a time — the memory of the unquantized model."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from worker.models.config import Fp8Scales, IntWeights, ModelConfig
from worker.models.int_weights import packed_weights, read_int_weight
from worker.models.llama import CausalLM
from worker.models.parallel import SINGLE, Piece, Shard


def weight_files(model_dir: str | Path) -> dict[str, Path]:
    """Tensor name -> checkpoint file, from the shard index when there is one."""
    model_dir = Path(model_dir)
    for index in (model_dir / "model.safetensors.index.json", model_dir / "pytorch_model.bin.index.json"):
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: model_dir / file for name, file in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("pytorch_model*.bin"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors (nor pytorch_model*.bin) in {model_dir}")
    names = {}
    for file in files:
        names.update({name: file for name in _open(file).keys()})
    return names


class _TorchFile:
    """A `.bin` checkpoint behind safetensors' reading interface (get_tensor, get_slice, keys)."""

    def __init__(self, path: Path):
        self._tensors = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)

    def keys(self):
        return self._tensors.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    get_slice = get_tensor  # a memory-mapped tensor is sliced without reading the rest


def _open(file: Path):
    if file.suffix == ".bin":
        return _TorchFile(file)
    from safetensors import safe_open

    return safe_open(str(file), "pt")


def load_weights(model: torch.nn.Module, model_dir: str | Path) -> None:
    """Copy every parameter from the checkpoint: the concatenation of its pieces (fused parts, or
    under tensor parallelism this rank's slices, read alone by get_slice). A piece shorter than its
    parameter (the vocabulary's padding rows) leaves the rest zero. An int-packed linear's weight is
    asked for by its `.weight` name, as a plain one is."""
    files = weight_files(model_dir)
    handles = {file: _open(file) for file in set(files.values())}
    names = set(files) | packed_weights(files, model.cfg.int_weights)
    missing = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            wanted = model.checkpoint_pieces(name)
            packed = [p for p in wanted if p.name not in files and f"{p.name}_blocks" in files]
            if packed:
                [piece] = packed  # an expert tensor is one checkpoint tensor (or this rank's slice of it)
                _dequantize_into(param, handles[files[f"{piece.name}_blocks"]], handles[files[f"{piece.name}_scales"]],
                                 piece)
                continue
            pieces = [p if p.name in names
                      else _from_fused(p, model.cfg, names) or replace(p, name=_fallback(p.name, names))
                      for p in wanted]
            if any(p.name not in names for p in pieces):
                missing.append(name)
                continue
            tensors = [_read_dequantized(handles, files, p, model.cfg.fp8, model.cfg.int_weights) for p in pieces]
            _fill(param, tensors, pieces[0].dim if pieces else 0)
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks weights for {missing[:5]}")


def _read(handle, piece: Piece) -> torch.Tensor:
    if piece.start is None and piece.expert is None:
        return handle.get_tensor(piece.name)
    expert = () if piece.expert is None else (piece.expert,)
    return handle.get_slice(piece.name)[expert + (slice(None),) * piece.dim + (slice(piece.start, piece.stop),)]


FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _read_dequantized(handles: dict, files: dict[str, Path], piece: Piece, fp8: Fp8Scales | None,
                      ints: IntWeights | None = None):
    """The piece as stored, an int-packed weight's piece dequantized (in fp32: int_weights.py), or an
    FP8 weight's piece x its scales (in fp32): one a block, one an output row, or one for the tensor
    (config.py's `Fp8Scales`)."""
    if piece.name not in files and ints is not None:
        return read_int_weight(handles, files, piece, ints)
    tensor = _read(handles[files[piece.name]], piece)
    if tensor.dtype not in FP8:
        return tensor
    scale_name = f"{piece.name}{fp8.suffix}" if fp8 is not None else None
    if scale_name not in files:
        raise ValueError(f"{piece.name} is stored in {tensor.dtype} without "
                         f"{scale_name or 'an FP8 quantization_config in config.json'}: the loader cannot tell "
                         "its scale")
    stored = handles[files[piece.name]].get_slice(piece.name)
    shape = list(stored.get_shape() if hasattr(stored, "get_shape") else stored.shape)
    scales = handles[files[scale_name]].get_slice(scale_name)
    scales = scales[piece.expert] if piece.expert is not None else scales[:]
    shape = shape[1:] if piece.expert is not None else shape
    block = fp8.block
    if block is None and len(shape) == 2 and scales.numel() in (1, shape[0]):  # per tensor, or per row
        block = (shape[0], shape[1]) if scales.numel() == 1 else (1, shape[1])
        scales = scales.reshape(-1, 1)
    blocks = [-(-size // b) for size, b in zip(shape, block or shape)]
    if len(shape) != 2 or block is None or list(scales.shape) != blocks:
        raise ValueError(f"{scale_name} is {list(scales.shape)}: a {shape} weight "
                         + (f"in blocks of {list(block)} has {blocks} scales" if block else
                            "has one scale, or one an output row"))
    for dim in (0, 1):  # each scale over its block, cut to the piece (a block may straddle its edge)
        lo, hi = (0, shape[dim]) if piece.start is None or piece.dim != dim else (piece.start, piece.stop)
        first = lo // block[dim]
        scales = scales.narrow(dim, first, -(-hi // block[dim]) - first)
        if scales.shape[dim] > 1:  # (one scale across the piece is broadcast, not repeated)
            scales = scales.repeat_interleave(block[dim], dim).narrow(dim, lo - first * block[dim], hi - lo)
    return tensor.float().mul_(scales.float())


# an FP4 (E2M1) code's value: sign bit, two exponent bits, one mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 to fp32: blocks [..., out, groups, 16] of bytes, two FP4 codes each (the low nibble
    first), and scales [..., out, groups], each group's 32 values' power of two biased by 127 (E8M0)
    -> [..., groups x 32, out] (in, out: the layout gpt-oss's expert parameters hold)."""
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()  # [..., out, groups, 32]
    values = torch.tensor(FP4_VALUES)[codes]
    values = torch.ldexp(values, scales.to(torch.int32).sub(127).unsqueeze(-1).float())
    return values.flatten(-2).transpose(-1, -2)


def _dequantize_into(param: torch.Tensor, blocks_file, scales_file, piece: Piece) -> None:
    """Fill an [experts, in, out] parameter from its MXFP4 checkpoint tensors, one expert at a time
    (a whole layer's experts in fp32 would be several GB), cut to the piece's slice where it has one."""
    blocks, scales = blocks_file.get_slice(f"{piece.name}_blocks"), scales_file.get_slice(f"{piece.name}_scales")
    shapes = [list(t.get_shape() if hasattr(t, "get_shape") else t.shape) for t in (blocks, scales)]
    if len(shapes[0]) != 4 or shapes[0][:3] != shapes[1] or shapes[0][0] != param.shape[0]:
        raise ValueError(f"{piece.name}_blocks {shapes[0]} and _scales {shapes[1]}: MXFP4 experts need blocks "
                         f"[{param.shape[0]} experts, out, groups, 16] and scales [{param.shape[0]}, out, groups]")
    for e in range(param.shape[0]):
        weight = dequantize_mxfp4(blocks[e:e + 1], scales[e:e + 1])[0]
        if piece.start is not None:  # the piece's dim counts the experts' dim first
            weight = weight.narrow(piece.dim - 1, piece.start, piece.stop - piece.start)
        if weight.shape != param.shape[1:]:
            raise ValueError(f"{piece.name}_blocks/_scales dequantize to {tuple(weight.shape)} an expert where the "
                             f"config's model holds {tuple(param.shape[1:])}")
        param[e].copy_(weight)


def _fill(param: torch.Tensor, tensors: list[torch.Tensor], dim: int) -> None:
    if len(tensors) == 1 and tensors[0].shape == param.shape:
        param.copy_(tensors[0])
        return
    data = torch.cat(tensors, dim=dim) if tensors else param.new_zeros(0, *param.shape[1:])
    if data.shape[dim] < param.shape[dim]:
        param.zero_()
    param.narrow(dim, 0, data.shape[dim]).copy_(data)


def _from_fused(piece: Piece, cfg: ModelConfig, names: set[str]) -> Piece | None:
    """Phi-3 stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` (GLM gate/up): the
    piece's rows there (all of the part's, or under tensor parallelism this rank's slice of them)."""
    module, _, param = piece.name.rpartition(".")
    base, _, part = module.rpartition(".")
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    where = {"q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, kv), "v_proj": ("qkv_proj", q + kv, kv),
             "gate_proj": ("gate_up_proj", 0, inter), "up_proj": ("gate_up_proj", inter, inter)}.get(part)
    if where is None or piece.dim != 0 or f"{base}.{where[0]}.{param}" not in names:
        return None
    fused, offset, size = where
    start, stop = (0, size) if piece.start is None else (piece.start, piece.stop)
    return Piece(f"{base}.{fused}.{param}", 0, offset + start, offset + stop)


def _fallback(name: str, names: set[str]) -> str:
    """Where a checkpoint keeps `name` under another name: a multimodal folder's text model (Gemma 3
    4B and up: `language_model.model.…` as saved, `model.language_model.…` as transformers 5 names
    its modules), a bare base model's (embedding folders saved without the causal LM around it:
    `layers.…`, `embed_tokens.…`), and the embeddings for a head some tied checkpoints store no
    lm_head for (even when their config says tie_word_embeddings false; a bare one never has one)."""
    for wanted in [name] + (["model.embed_tokens.weight"] if name == "lm_head.weight" else []):
        for spelled in (wanted, f"language_model.{wanted}", wanted.replace("model.", "model.language_model.", 1),
                        wanted.removeprefix("model.")):
            if spelled in names:
                return spelled
    return name


def load_model(model_dir: str | Path, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
               attention, shard: Shard = SINGLE):
    """Build on the meta device (no init cost), materialise on `device`, then fill from safetensors
    (under tensor parallelism: this rank's slices only); GLM's and Cohere's q and k rows then
    reordered for our rotary layout (llama.py's rotate_pairs_as_halves; DeepSeek's rotated rows too). A
    checkpoint's tensors no parameter asks for (GLM-4.5's and DeepSeek-V3's MTP layers past num_hidden_layers)
    are never read."""
    if cfg.arch in ("gemma", "gemma2", "gemma3"):
        from worker.models.gemma import GemmaCausalLM as model_class
    elif cfg.arch == "gpt_oss":
        from worker.models.gpt_oss import GptOssCausalLM as model_class
    elif cfg.arch == "olmo":
        from worker.models.olmo import Olmo1CausalLM as model_class
    elif cfg.arch in ("cohere", "cohere2"):
        from worker.models.cohere import CohereCausalLM as model_class
    elif cfg.arch == "phimoe":
        from worker.models.phimoe import PhimoeCausalLM as model_class
    elif cfg.mla is not None:
        from worker.models.deepseek import DeepseekCausalLM as model_class
    elif cfg.arch == "starcoder2":
        from worker.models.starcoder2 import Starcoder2CausalLM as model_class
    elif cfg.arch == "arcee":
        from worker.models.arcee import ArceeCausalLM as model_class
    elif cfg.arch == "exaone4":
        from worker.models.olmo import Exaone4CausalLM as model_class
    elif cfg.arch == "stablelm":
        from worker.models.stablelm import StableLmCausalLM as model_class
    elif cfg.arch == "hunyuan_v1_dense":
        from worker.models.hunyuan import HunyuanCausalLM as model_class
    elif cfg.arch == "apertus":
        from worker.models.apertus import ApertusCausalLM as model_class
    elif cfg.post_norm:
        from worker.models.olmo import OlmoCausalLM as model_class
    else:
        model_class = CausalLM
    with torch.device("meta"):
        model = model_class(cfg, attention, shard).to(dtype)
        for module in model.modules():
            if getattr(module, "keeps_fp32", False):  # GLM-4.5's router, in fp32 as transformers keeps it
                module.float()
    model.to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty made two tensors of the one tied parameter
        model.lm_head.weight = model.model.embed_tokens.weight
    load_weights(model, model_dir)
    if cfg.rope_interleaved:
        for layer in model.model.layers:
            layer.self_attn.rotate_pairs_as_halves(cfg.rotary_dim)
    model.init_rope(device)
    return model.eval()
