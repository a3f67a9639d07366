"""What the CPU runs fast: bfloat16 kernels from its flags, and the precision a half-precision replica runs in."""

from __future__ import annotations

from pathlib import Path

import torch

from exitplan.cpu_features import bf16_kernels, cpu_flags, local_dtype
from exitplan.earlyexit.packed import can_pack

AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
AVX512_BF16 = AVX512 | {"avx512_bf16"}


def test_flags_decide_bfloat16_and_half_precision_falls_back_to_float32_without_it() -> None:
    assert not bf16_kernels(AVX2) and bf16_kernels(AVX512_BF16) and bf16_kernels(AVX2 | {"avx_ne_convert"})
    assert local_dtype("bfloat16", AVX2) == "float32" and local_dtype("float16", AVX2) == "float32"
    assert local_dtype("bfloat16", AVX512_BF16) == "bfloat16" and local_dtype("float32", AVX2) == "float32"


def test_avx512_without_a_bfloat16_instruction_runs_half_precision_in_float32() -> None:
    """oneDNN emulates bfloat16 there (measured 4.5x slower than float32 at 128 rows): torch's own check says yes,
    the speed says no."""
    assert not bf16_kernels(AVX512) and local_dtype("bfloat16", AVX512) == "float32"
    assert bf16_kernels(AVX512 | {"amx_bf16"})


def test_this_cpu_agrees_with_torchs_own_check(tmp_path: Path) -> None:
    assert cpu_flags() and bf16_kernels() == can_pack(torch.bfloat16)
    (tmp_path / "cpuinfo").write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512bw avx512_bf16 avx512vl\n")
    assert bf16_kernels(cpu_flags(tmp_path / "cpuinfo")) and cpu_flags(tmp_path / "absent") == frozenset()
