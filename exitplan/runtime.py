"""How a stage that runs the real models uses this machine: its torch threads, and its memory allocator.

Nothing here is a pipeline input: the thread count and the allocator change how fast a stage runs, not what it
computes (beyond the order of floating-point sums), so no stage lists them as a DVC parameter.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from exitplan.config import Params
from exitplan.errors import ConfigError

MODEL_STAGES = frozenset({"train_exits", "exit_profile", "label_quality", "online_profile", "gate"})
"""Stages that run the real models, and so take ``runtime.model_threads`` torch threads."""


SOLO_STAGES = frozenset({"profile_vllm", "build_perf_db", "profile_device", "plan", "online_profile", "gate"})
"""Stages that run with no other stage beside them (:class:`exitplan.stage_schedule.StageScheduler`): the four
that time the engines (a stage beside them would share the cores and the memory bandwidth they measure), and
build_perf_db and plan, whose Dask sweeps already take one worker per core."""

THREADS_ENV = "EXITPLAN_MODEL_THREADS"
"""Set by the pipeline flow for a model stage it runs beside another: that stage's torch threads, in place of
``runtime.model_threads``, so that the stages side by side never ask for more threads than the machine has cores."""


TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
"""Debian's tcmalloc (package libtcmalloc-minimal4): preloaded into the model stages and vLLM's replicas, where
present."""


PRELOADED = MODEL_STAGES | {"serve"}
"""Processes that run with :data:`TCMALLOC` preloaded: the model stages and the engine server (``serve``:
``serving.server``; with glibc's allocator a 16-prompt prefill of Qwen2.5-0.5B spent 31 ms instead of 3 ms in each
layer's silu-times-up product, faulting in fresh pages for every new large tensor)."""


def preload_tcmalloc(params: Params, stage: str) -> None:
    """Re-execute this process with :data:`TCMALLOC` preloaded (``LD_PRELOAD``) if ``stage`` is in :data:`PRELOADED`,
    ``runtime.preload_tcmalloc`` is on, the library is installed and not loaded yet; otherwise return. The same
    command line runs again (``sys.orig_argv``), so only a stage's entry point calls this, before any work (the
    console script for ``exitplan stage ...``), never code run in process."""
    preloaded = os.environ.get("LD_PRELOAD", "")
    if (stage not in PRELOADED or not params.runtime.preload_tcmalloc or not TCMALLOC.is_file()
            or str(TCMALLOC) in preloaded.split(":")):
        return
    env = {**os.environ, "LD_PRELOAD": ":".join(p for p in (str(TCMALLOC), preloaded) if p)}
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def stage_threads(params: Params) -> int:
    """The torch threads a model stage asks for: ``$EXITPLAN_MODEL_THREADS`` if set, else ``runtime.model_threads``.

    Raises:
        ConfigError: if the variable is set to anything but a positive whole number.
    """
    raw = os.environ.get(THREADS_ENV, "").strip()
    if not raw:
        return params.runtime.model_threads
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError("environment", [f"{THREADS_ENV}: must be a positive whole number, got {raw!r}"])
    return int(raw)


def use_model_threads(params: Params, stage: str) -> int:
    """Give ``stage`` its torch threads: ``$EXITPLAN_MODEL_THREADS`` (:data:`THREADS_ENV`) if the flow set it, else
    ``runtime.model_threads``, for a model stage; other stages are left alone.

    Returns:
        The torch threads in use afterwards.
    """
    import torch

    if stage not in MODEL_STAGES:
        return torch.get_num_threads()
    wanted = stage_threads(params)
    if torch.get_num_threads() != wanted:
        torch.set_num_threads(wanted)
    return torch.get_num_threads()

