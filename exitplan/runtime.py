"""How a stage that runs the real models uses this machine: its torch threads, and its memory allocator.

Nothing here is a pipeline input: the thread count and the allocator change how fast a stage runs, not what it
computes (beyond the order of floating-point sums), so no stage lists them as a DVC parameter.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from exitplan.config import Params

MODEL_STAGES = frozenset({"train_exits", "exit_profile", "label_quality", "online_profile", "gate"})
"""Stages that run the real models, and so take ``runtime.model_threads`` torch threads."""


TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
"""Debian's tcmalloc (package libtcmalloc-minimal4): preloaded into the model stages and vLLM's replicas, where
present."""


def preload_tcmalloc(params: Params, stage: str) -> None:
    """Re-execute this process with :data:`TCMALLOC` preloaded (``LD_PRELOAD``) if ``stage`` runs the real models,
    ``runtime.preload_tcmalloc`` is on, the library is installed and not loaded yet; otherwise return. The same
    command line runs again (``sys.orig_argv``), so only a stage's entry point calls this, before any work (the
    console script for ``exitplan stage ...``), never code run in process."""
    preloaded = os.environ.get("LD_PRELOAD", "")
    if (stage not in MODEL_STAGES or not params.runtime.preload_tcmalloc or not TCMALLOC.is_file()
            or str(TCMALLOC) in preloaded.split(":")):
        return
    env = {**os.environ, "LD_PRELOAD": ":".join(p for p in (str(TCMALLOC), preloaded) if p)}
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def use_model_threads(params: Params, stage: str) -> int:
    """Give ``stage`` its torch threads: ``runtime.model_threads`` for a model stage, else leave them alone.

    Returns:
        The torch threads in use afterwards.
    """
    import torch

    if stage in MODEL_STAGES and torch.get_num_threads() != params.runtime.model_threads:
        torch.set_num_threads(params.runtime.model_threads)
    return torch.get_num_threads()

