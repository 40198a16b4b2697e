"""Int4 and int8 checkpoints (GPTQ, AWQ, compressed-tensors' pack-quantized; config.py's `IntWeights`
says which), dequantized to the serving dtype as they load: there are no int kernels, so the model
takes the memory of its unquantized self. Each format packs a linear's int values into int32s and
scales them by groups of input rows; a piece (a fused part, a tensor-parallel rank's rows or
columns) reads only the packed words, scales and zeros its rows and columns need — a group or a
word may straddle its edge — and comes back [out, in] in fp32, each value (q - zero) x scale of its
group. Only linears whose checkpoint holds the packed tensors are dequantized: those a release left
unquantized (its lm_head, modules_to_not_convert, compressed-tensors' ignore) keep their `.weight`."""
from __future__ import annotations

from pathlib import Path

import torch

from worker.models.config import IntWeights
from worker.models.parallel import Piece

PACKED = {"gptq": ".qweight", "awq": ".qweight", "pack-quantized": ".weight_packed"}  # a quantized linear's tensor
# AutoAWQ's GEMM packing: the eight 4-bit values of an int32, lowest bits first, are these of its 8 columns
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_SHIFTS = torch.tensor([4 * AWQ_ORDER.index(column) for column in range(8)], dtype=torch.int32)


def packed_weights(names, ints: IntWeights | None) -> set[str]:
    """The `<linear>.weight` names a checkpoint holds packed (in no file under that name)."""
    if ints is None:
        return set()
    suffix = PACKED[ints.method]
    return {f"{name.removesuffix(suffix)}.weight" for name in names if name.endswith(suffix)} - set(names)


def read_int_weight(handles: dict, files: dict[str, Path], piece: Piece, ints: IntWeights) -> torch.Tensor:
    """The piece of a packed linear's weight, [out, in] as nn.Linear holds it, in fp32."""
    linear = _Linear(handles, files, piece.name.removesuffix(".weight"))
    if piece.expert is not None:
        raise ValueError(f"{linear.prefix}: experts stored as one tensor cannot be read from {ints.method} int weights")
    read = {"gptq": _gptq, "awq": _awq, "pack-quantized": _pack_quantized}[ints.method]
    q, zeros, scales, groups = read(linear, piece, ints)
    weight = q.float().sub_(zeros.float().index_select(1, groups))
    return weight.mul_(scales.float().index_select(1, groups))


class _Linear:
    """One linear's checkpoint tensors, `<prefix><suffix>`: their shapes, and slices of them read alone."""

    def __init__(self, handles: dict, files: dict[str, Path], prefix: str):
        self.handles, self.files, self.prefix = handles, files, prefix

    def has(self, suffix: str) -> bool:
        return f"{self.prefix}{suffix}" in self.files

    def shape(self, suffix: str) -> list[int]:
        name = f"{self.prefix}{suffix}"
        if name not in self.files:
            raise ValueError(f"{name} is missing: the packed {self.prefix} needs it")
        stored = self.handles[self.files[name]].get_slice(name)
        return list(stored.get_shape() if hasattr(stored, "get_shape") else stored.shape)

    def read(self, suffix: str, *where: slice) -> torch.Tensor:
        name = f"{self.prefix}{suffix}"
        return self.handles[self.files[name]].get_slice(name)[where]

    def check(self, suffix: str, want: list[int], what: str) -> None:
        got = self.shape(suffix)
        if got != want:
            raise ValueError(f"{self.prefix}{suffix} is {got}: {what} needs {want}")

    def check_int32(self, suffix: str) -> None:
        dtype = self.read(suffix, slice(0, 1)).dtype
        if dtype != torch.int32:
            raise ValueError(f"{self.prefix}{suffix} is {dtype}: packed values are read from int32")


def _ranges(piece: Piece, out: int, inputs: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The piece's output rows and input columns of an [out, in] weight."""
    rows, cols = (0, out), (0, inputs)
    if piece.start is None:
        return rows, cols
    if piece.dim not in (0, 1) or not 0 <= piece.start < piece.stop <= (out, inputs)[piece.dim]:
        raise ValueError(f"{piece.name}: dim {piece.dim} [{piece.start}, {piece.stop}) is outside its packed "
                         f"[{out}, {inputs}] weight")
    return ((piece.start, piece.stop), cols) if piece.dim == 0 else (rows, (piece.start, piece.stop))


def _words(span: tuple[int, int], per_word: int) -> slice:
    """The packed words holding values [start, stop)."""
    return slice(span[0] // per_word, -(-span[1] // per_word))


def _unpack(words: torch.Tensor, bits: int, dim: int, span: tuple[int, int], shifts=None) -> torch.Tensor:
    """Values [start, stop) of the int32 words read by `_words(span)`, unpacked along dim: lowest bits
    first, or each of a word's values at its shift (AWQ's order)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32) if shifts is None else shifts
    values = words.movedim(dim, -1).unsqueeze(-1) >> shifts
    values = values.bitwise_and_((1 << bits) - 1).flatten(-2).movedim(-1, dim)
    first = span[0] % (32 // bits)
    return values.narrow(dim, first, span[1] - span[0])


def _check_groups(linear: _Linear, suffix: str, groups: int, inputs: int, group_size: int | None) -> None:
    """Without g_idx, input rows in groups of group_size: the scales' number of groups."""
    want = -(-inputs // (group_size or inputs))
    if groups != want:
        raise ValueError(f"{linear.prefix}{suffix} has {groups} groups: {inputs} input rows in groups of "
                         f"{group_size or inputs} make {want}")


def _groups(linear: _Linear, suffix: str | None, cols: tuple[int, int], group_size: int | None, count: int,
            act_order: bool) -> tuple[torch.Tensor, slice]:
    """Each input column's group (g_idx where the checkpoint has one, else column // group_size),
    counted from the first the columns use; and the groups they use."""
    groups = linear.read(suffix, slice(*cols)).long() if suffix is not None and linear.has(suffix) else None
    if groups is not None and not (groups == -1).any():  # compressed-tensors' -1s: never set, columns in order
        where = f"{linear.prefix}{suffix}"
    elif act_order:
        raise ValueError(f"{linear.prefix}{suffix} is missing or unset: groups in activation order are read from it")
    else:
        groups = torch.arange(*cols) // group_size if group_size else torch.zeros(cols[1] - cols[0], dtype=torch.long)
        where = f"group_size {group_size}"
    if not 0 <= int(groups.min()) <= int(groups.max()) < count:
        raise ValueError(f"{where} puts input rows in groups {int(groups.min())}..{int(groups.max())} of {count}")
    first, last = int(groups.min()), int(groups.max())
    return groups - first, slice(first, last + 1)


def _gptq(linear: _Linear, piece: Piece, ints: IntWeights):
    """qweight [in / pack, out] packed along the input; qzeros [groups, out / pack] along the output;
    scales [groups, out]; g_idx [in], each input row's group."""
    bits, pack = ints.bits, 32 // ints.bits
    words, out = linear.shape(".qweight")
    inputs, groups = words * pack, linear.shape(".scales")[0]
    linear.check(".scales", [groups, out], f"a {bits}-bit qweight [{words}, {out}]")
    linear.check(".qzeros", [groups, -(-out // pack)], f"{groups} groups of {out} {bits}-bit zeros")
    if linear.has(".g_idx"):
        linear.check(".g_idx", [inputs], f"a {bits}-bit qweight of {words} packed rows")
    else:
        _check_groups(linear, ".scales", groups, inputs, ints.group_size)
    for suffix in (".qweight", ".qzeros"):
        linear.check_int32(suffix)
    rows, cols = _ranges(piece, out, inputs)
    q = _unpack(linear.read(".qweight", _words(cols, pack), slice(*rows)), bits, 0, cols).T
    index, used = _groups(linear, ".g_idx", cols, ints.group_size, groups, ints.act_order)
    zeros = _unpack(linear.read(".qzeros", used, _words(rows, pack)), bits, 1, rows).T + ints.zero_offset
    return q, zeros, linear.read(".scales", used, slice(*rows)).T, index


def _awq(linear: _Linear, piece: Piece, ints: IntWeights):
    """qweight [in, out / 8] packed along the output in AutoAWQ's order; qzeros [groups, out / 8] too;
    scales [groups, out]."""
    inputs, words = linear.shape(".qweight")
    out, group = words * 8, ints.group_size or inputs
    groups = -(-inputs // group)
    linear.check(".scales", [groups, out], f"a 4-bit qweight [{inputs}, {words}] in groups of {group}")
    linear.check(".qzeros", [groups, words], f"a 4-bit qweight [{inputs}, {words}] in groups of {group}")
    for suffix in (".qweight", ".qzeros"):
        linear.check_int32(suffix)
    rows, cols = _ranges(piece, out, inputs)
    q = _unpack(linear.read(".qweight", slice(*cols), _words(rows, 8)), 4, 1, rows, AWQ_SHIFTS).T
    index, used = _groups(linear, None, cols, group, groups, False)
    zeros = _unpack(linear.read(".qzeros", used, _words(rows, 8)), 4, 1, rows, AWQ_SHIFTS).T
    return q, zeros, linear.read(".scales", used, slice(*rows)).T, index


def _pack_quantized(linear: _Linear, piece: Piece, ints: IntWeights):
    """weight_packed [out, in / pack] packed along the input, each value stored plus 2^(bits - 1);
    weight_scale [out, groups]; weight_zero_point [out / pack, groups] packed along the output, stored
    alike (older releases: [out, groups], as it is); weight_g_idx [in]; weight_shape [out, in]."""
    bits, pack = ints.bits, 32 // ints.bits
    out, words = linear.shape(".weight_packed")
    if linear.has(".weight_shape"):
        linear.check(".weight_shape", [2], "a 2-d weight's [out, in]")
        out, inputs = linear.read(".weight_shape", slice(None)).tolist()
    else:
        inputs = words * pack
    linear.check(".weight_packed", [out, -(-inputs // pack)], f"a {bits}-bit [{out}, {inputs}] weight")
    groups = linear.shape(".weight_scale")[-1]
    linear.check(".weight_scale", [out, groups], f"a [{out}, {inputs}] weight")
    if linear.has(".weight_g_idx"):
        linear.check(".weight_g_idx", [inputs], f"a [{out}, {inputs}] weight")
    else:
        _check_groups(linear, ".weight_scale", groups, inputs, ints.group_size)
    linear.check_int32(".weight_packed")
    rows, cols = _ranges(piece, out, inputs)
    q = _unpack(linear.read(".weight_packed", slice(*rows), _words(cols, pack)), bits, 1, cols)
    index, used = _groups(linear, ".weight_g_idx", cols, ints.group_size, groups, ints.act_order)
    zeros = _zero_points(linear, ints, rows, used, out, groups)
    return q, zeros, linear.read(".weight_scale", slice(*rows), used), index


def _zero_points(linear: _Linear, ints: IntWeights, rows: tuple[int, int], used: slice, out: int,
                 groups: int) -> torch.Tensor:
    """The piece's rows' zeros, stored as the values are (plus 2^(bits - 1)); without a zero point
    (symmetric), the middle of the range."""
    bits, pack, offset = ints.bits, 32 // ints.bits, 1 << (ints.bits - 1)
    if not linear.has(".weight_zero_point"):
        if not ints.symmetric:
            raise ValueError(f"{linear.prefix}.weight_zero_point is missing: asymmetric weights need it")
        return torch.full((rows[1] - rows[0], used.stop - used.start), offset, dtype=torch.int32)
    shape = linear.shape(".weight_zero_point")
    if shape == [-(-out // pack), groups] and linear.read(".weight_zero_point", slice(0, 1)).dtype == torch.int32:
        return _unpack(linear.read(".weight_zero_point", _words(rows, pack), used), bits, 0, rows)
    if shape == [out, groups]:  # unpacked, signed
        return linear.read(".weight_zero_point", slice(*rows), used).to(torch.int32) + offset
    raise ValueError(f"{linear.prefix}.weight_zero_point is {shape}: a [{out}, ...] weight's {groups} groups of "
                     f"{bits}-bit zeros are [{-(-out // pack)}, {groups}] int32 (packed) or [{out}, {groups}]")
