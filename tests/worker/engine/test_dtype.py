"""`--dtype auto` on CPU: fp32 unless the CPU has native bf16, the checkpoint is 16-bit and bf16
measures faster here; the choice falls back to fp32 cleanly on a CPU without the flags."""
import pytest
import torch

from worker.engine.dtype import choose_dtype, native_bf16_flags

CPU = torch.device("cpu")


@pytest.mark.parametrize("line, expected", [
    ("flags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 amx_tile amx_bf16 amx_int8",
     {"avx512_bf16", "amx_bf16"}),  # Intel Xeon Sapphire Rapids
    ("flags\t\t: fpu sse2 avx avx2 fma sha_ni vaes", set()),  # AMD EPYC Zen 3: emulated bf16
    ("Features\t: fp asimd sve bf16 i8mm", {"bf16"}),  # Arm Neoverse V1
])
def test_native_bf16_is_read_from_the_cpu_flags(tmp_path, line, expected):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: Some CPU\n{line}\n\n")
    assert native_bf16_flags(cpuinfo) == expected
    assert native_bf16_flags(tmp_path / "missing") == set()  # not Linux: no flags, so fp32


def test_auto_is_fp32_without_native_bf16_or_a_16_bit_checkpoint_and_an_explicit_dtype_wins():
    dtype, why = choose_dtype("auto", CPU, "bfloat16", 64, 128, flags=set())
    assert dtype == torch.float32 and "bf16 is emulated" in why
    dtype, why = choose_dtype("auto", CPU, "float32", 64, 128, flags={"amx_bf16"})
    assert dtype == torch.float32 and "checkpoint's precision" in why
    assert choose_dtype("bfloat16", CPU, "float32", 64, 128, flags=set()) == (torch.bfloat16, "--dtype")


def test_with_native_bf16_the_choice_follows_a_measurement_on_this_cpu():
    """On a CPU whose bf16 is emulated the measurement finds it slower and keeps fp32; with AMX it
    finds it faster: either way the reason gives the measured ratio."""
    dtype, why = choose_dtype("auto", CPU, "bfloat16", 1024, 3072, flags={"amx_bf16"})
    ratio = float(why.split("bf16 GEMMs ")[1].split("x")[0])
    if ratio < 1:
        assert dtype == torch.float32, why
    elif ratio > 1.2:  # clear of the 1/0.9 margin, where rounding in the message could mislead
        assert dtype == torch.bfloat16, why


def test_this_machine_decides_by_its_own_flags():
    dtype, why = choose_dtype("auto", CPU, "bfloat16", 64, 128)
    assert (dtype == torch.float32) or native_bf16_flags(), why
