"""What this machine's CPU can run fast, read from ``/proc/cpuinfo`` (no torch import).

Machines of the same kind differ here: some EPYCs have AVX512 (with BF16), others only AVX2. On an AVX2-only CPU
oneDNN has no bfloat16 matmul, so bfloat16 runs emulated: measured here (one core, 4864 x 896 weights) 4.4x slower
than float32 at 128 rows, and a vLLM CPU replica of Qwen2.5-Coder-1.5B in bfloat16 did not finish its start-up
(a 4096-token warm-up batch) within 600 s.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from exitplan.kinds import Dtype

if TYPE_CHECKING:
    import torch

BF16_FLAGS = ("avx512_bf16", "amx_bf16", "avx_ne_convert")
"""Flags of which any one gives oneDNN bfloat16 kernels."""

AVX512_CORE = frozenset({"avx512bw", "avx512vl", "avx512dq"})
"""Flags that together also do (oneDNN converts bfloat16 in AVX512)."""


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
    """Whether the CPU has oneDNN's bfloat16 kernels (``flags``: this CPU's by default)."""
    flags = cpu_flags() if flags is None else flags
    return any(f in flags for f in BF16_FLAGS) or flags >= AVX512_CORE


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
