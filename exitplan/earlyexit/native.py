"""The engine's C++ decode kernels (``kernels.cpp``), compiled on first use with torch's extension builder.

A decode step of 16 sequences spends ~100 ms in the oneDNN matmuls, which equal vLLM's, and 25-30 ms around them
in torch ops (index_select of the context, bmm, softmax, the norms' and rotary's elementwise ops: ~40 calls a
layer) where vLLM's CPU backend runs one hand-written kernel each. These are the same five kernels for bfloat16:
RMS norm, residual add + RMS norm, silu-and-mul, rotary + KV-cache write, and decode attention reading the paged
pool in place. They round where the torch ops round, so outputs equal the torch path's up to float32 summation
order (``tests/exitplan/earlyexit/test_native.py``).

The build takes about a minute once per machine and source version (torch caches it under
``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``), with ``-O3 -march=native``: the vectors are this
CPU's widest. Where it cannot be built (no C++ compiler) the engine runs the torch path and says so once.
"""

from __future__ import annotations

import logging
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SOURCE = Path(__file__).with_name("kernels.cpp")
"""The kernels' source, next to this module."""

FLAGS = ["-O3", "-march=native"]
"""Compiler flags: the widest vectors this CPU has (the build is per machine)."""

log = logging.getLogger(__name__)


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernels run a model of this element type and head width (bfloat16; 16 to 256, a power of two:
    the attention kernel's vectors, one instance per width)."""
    import torch

    return dtype == torch.bfloat16 and head_dim in (16, 32, 64, 128, 256)


@cache
def kernels() -> ModuleType | None:
    """The compiled kernels (built on first use), or ``None`` where they cannot be built (logged once)."""
    try:
        from torch.utils import cpp_extension

        return cpp_extension.load(name="exitplan_kernels", sources=[str(SOURCE)], extra_cflags=FLAGS, verbose=False)
    except (OSError, RuntimeError, ImportError) as error:  # no compiler or ninja: the torch path serves instead
        log.warning("the engine's C++ kernels could not be built (%s); decode runs the torch path, slower",
                    str(error).splitlines()[0] if str(error) else type(error).__name__)
        return None
