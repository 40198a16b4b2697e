"""Compile every Triton kernel for Hopper (sm_90) without a GPU and report registers and spills.

The interpreter that the CPU tests use accepts code the GPU compiler rejects; Triton's compiler and
the ptxas it ships run on any machine, so this catches type and codegen errors before a GPU does.
Must run with TRITON_INTERPRET unset or 0. Exit status 1 on a compile error, a spill in a 16-bit
kernel, or shared memory over the limit.

    python ops/gpu/compile_check.py [--quick]
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

HOPPER = GPUTarget("cuda", 90, 32)
SMEM_LIMIT = 227 * 1024
INDEX = {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
         "slot_mapping_ptr": "*i64", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "sinks_ptr": "*fp32"}
DATA = ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "key_ptr", "value_ptr")


def extend_block_q(kv_group: int, max_query_len: int) -> int:
    return _kernel("extend_attention", "extend_block_q")(kv_group, max_query_len)


def _kernel(module: str, name: str):
    return getattr(importlib.import_module(f"worker.kernels.{module}"), name)


def compile_kernel(kernel, dtype: str, constexprs: dict, **options):
    """Compile as a launch specialises it: pointers and strides 16-byte aligned."""
    pointers = {**INDEX, **{n: f"*{dtype}" for n in DATA}}
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        signature[name] = pointers.get(name, "fp32" if name == "qk_scale" else "i32")
        if name in pointers or (name.startswith("stride") and name != "stride_bt"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=HOPPER,
                          options=options)


def ptxas_usage(ptx: str) -> tuple[int, int]:
    """(registers, spill-store bytes) as ptxas reports them."""
    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        err = subprocess.run([str(ptxas), "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", err)
    spills = re.search(r"(\d+) bytes spill stores", err)
    return int(regs.group(1)) if regs else 0, int(spills.group(1)) if spills else 0


def configs(quick: bool):
    """(label, module, kernel, constexprs, options) for the shapes launches use."""
    groups = [4, 7] if quick else [1, 2, 4, 7, 8]
    dims = [128] if quick else [64, 128]
    for d in dims:
        shape = {"PAGE_SIZE": 16, "HEAD_DIM": d, "BLOCK_D": d}
        dot = {"DOT_PRECISION": "tf32"}
        yield f"write_kv D={d}", "kv_write", "_write_kv_kernel", shape, {"num_warps": 1}
        for splits in (1, 3):
            for sinks in (False, True):  # gpt-oss's sinks: counted in the merge
                yield (f"decode_merge S={splits} D={d}{' sinks' if sinks else ''}", "decode_attention",
                       "_decode_merge_kernel", {"HEAD_DIM": d, "NUM_SPLITS": splits, "HAS_SINKS": sinks,
                                                "BLOCK_S": triton.next_power_of_2(splits), "BLOCK_D": d},
                       {"num_warps": 4})
        for g in groups:
            gp = triton.next_power_of_2(g)
            yield (f"decode_partial G={g} D={d}", "decode_attention", "_decode_partial_kernel",
                   {**shape, **dot, "KV_GROUP": g, "NUM_SPLITS": 4, "BLOCK_H": max(16, gp),
                    "BLOCK_N": 64}, {"num_warps": 4, "num_stages": 2})
            tiles = {extend_block_q(g, q) for q in ((1, 64) if quick else (1, 2, 4, 8, 16, 32, 64))}
            for bq in sorted(tiles):  # every tile height a step can pick (the smallest and largest)
                for sinks in (False, True) if bq == max(tiles) else (False,):  # sinks: the largest tile too
                    yield (f"extend G={g} BQ={bq} D={d}{' sinks' if sinks else ''}", "extend_attention",
                           "_extend_kernel", {**shape, **dot, "KV_GROUP": g, "GROUP_PAD": gp, "BLOCK_Q": bq,
                                              "BLOCK_N": 64, "HAS_SINKS": sinks},
                           {"num_warps": 4 if bq * gp <= 64 else 8, "num_stages": 2})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few shapes, bf16 and fp16 only")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter replaces the compiler", file=sys.stderr)
        return 2
    failures = 0
    for dtype in ("bf16", "fp16"):
        for label, module, name, constexprs, options in configs(args.quick):
            try:
                compiled = compile_kernel(_kernel(module, name), dtype, constexprs, **options)
                regs, spills = ptxas_usage(compiled.asm["ptx"])
            except Exception as exc:  # report every kernel, not just the first failure
                print(f"FAIL {dtype} {label}: {type(exc).__name__}: {exc}")
                failures += 1
                continue
            shared = compiled.metadata.shared
            bad = spills > 0 or shared > SMEM_LIMIT
            failures += bad
            print(f"{'FAIL' if bad else 'ok  '} {dtype} {label:28s} regs={regs:3d} "
                  f"spill_bytes={spills} shared={shared}")
    print(f"{failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
