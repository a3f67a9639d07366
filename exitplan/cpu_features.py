"""What this machine's CPU can run fast, read from ``/proc/cpuinfo`` (no torch import).

Machines of the same kind differ here: some EPYCs have AVX512 with BF16, others only AVX2, and some Xeons AVX512
without BF16. Without a bfloat16 instruction (AVX512-BF16, AMX-BF16 or AVX-NE-CONVERT) oneDNN emulates bfloat16
arithmetic, and it loses to float32 wherever a batch has more than a row or two:
- AVX2 only (one core, 4864 x 896 weights): 4.4x slower than float32 at 128 rows, and a vLLM CPU replica of
  Qwen2.5-Coder-1.5B in bfloat16 did not finish its start-up (a 4096-token warm-up batch) within 600 s.
- AVX512 BW+VL+DQ without BF16 (an Intel Xeon, 2026-12-03, the same weights, one core): float32 0.66 / 2.13 / 8.38 ms
  at 1 / 16 / 128 rows, bfloat16 0.73 / 5.29 / 37.9 ms, oneDNN-packed bfloat16 0.39 / 5.33 / 38.1 ms; a fresh
  ``make run`` there in bfloat16 spent 44 min in profile_vllm and did not finish it.
So bfloat16 runs only where the CPU has one of those instructions; elsewhere a half precision runs in float32.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from exitplan.kinds import Dtype

if TYPE_CHECKING:
    import torch

BF16_FLAGS = ("avx512_bf16", "amx_bf16", "avx_ne_convert")
"""Flags of which any one gives oneDNN native bfloat16 kernels (without one it emulates them, several times slower
than float32: see the module's docstring)."""


@cache
def cpu_flags(path: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags (empty where ``/proc/cpuinfo`` is not there)."""
    try:
        text = path.read_text()
    except OSError:
        return frozenset()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def bf16_kernels(flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU has native bfloat16 instructions for oneDNN (``flags``: this CPU's by default)."""
    flags = cpu_flags() if flags is None else flags
    return any(f in flags for f in BF16_FLAGS)


def local_dtype(requested: Dtype, flags: frozenset[str] | None = None) -> Dtype:
    """The precision to run ``requested`` in on this CPU: itself, except a half precision without bfloat16 kernels,
    which runs in float32 (same results up to rounding, twice the bytes, several times faster than emulated)."""
    if requested in ("bfloat16", "float16") and not bf16_kernels(flags):
        return "float32"
    return requested


def torch_dtype(requested: Dtype) -> torch.dtype:
    """The torch dtype a model stage or the engine loads a model in here: :func:`local_dtype` of ``requested``."""
    import torch

    return getattr(torch, local_dtype(requested))
