"""CPU vLLM replicas started here: the command, how many this machine holds, and their cores."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from exitplan.config import EngineParams, Params
from exitplan.cpu_features import local_dtype
from exitplan.kinds import DTYPE_BYTES, Dtype
from exitplan.vllm.environment import API_SERVER, ensure, process_env, python
from exitplan.vllm.flags import Platform, Replica, block_size, serve_flags

GIB = 2**30


def cpu_engine(params: Params) -> EngineParams:
    """The engine knobs of a CPU replica here: the simulated ones, with the ``vllm`` section's batch limit and max
    model length and the CPU backend's block size."""
    engine = params.simulator.engine
    return engine.model_copy(update={"max_num_seqs": params.vllm.max_num_seqs,
                                     "max_model_len": params.vllm.max_model_len,
                                     "block_size": block_size(Platform.CPU, engine.block_size)})


def replica_dtype(params: Params) -> Dtype:
    """The precision CPU replicas here run in: ``vllm.dtype``, or float32 on a CPU without bfloat16 kernels
    (:func:`exitplan.cpu_features.local_dtype`). Rendered GPU bundles keep ``vllm.dtype``."""
    return local_dtype(params.vllm.dtype)


def cpu_replica(params: Params, name: str, host: str, port: int) -> Replica:
    """A CPU replica here serving ``name`` on ``host:port``, in :func:`replica_dtype` and the ``vllm`` section's max
    model length."""
    return Replica(name, host, port, dtype=replica_dtype(params), max_model_len=params.vllm.max_model_len)


def command(params: Params, checkpoint: Path, replica: Replica) -> list[str]:
    """The CPU replica's command line: the API server module of vLLM's environment on ``checkpoint``."""
    return [str(python(params)), "-m", API_SERVER, "--model", str(checkpoint),
            *serve_flags(Platform.CPU, replica, cpu_engine(params))]


def replica_gib(params: Params, checkpoint: Path) -> float:
    """RAM one CPU replica of ``checkpoint`` holds: its weights in the replica's dtype, its KV cache, the rest."""
    from exitplan.checkpoints import checkpoint_bytes

    stored = checkpoint_bytes(checkpoint)
    dtype_bytes = DTYPE_BYTES[replica_dtype(params)]
    weights = stored * dtype_bytes / _stored_bytes_per_param(checkpoint)
    return weights / GIB + params.vllm.kv_cache_gib + params.vllm.memory_overhead_gib


def _stored_bytes_per_param(checkpoint: Path) -> int:
    from exitplan.files import read_json

    config = read_json(checkpoint / "config.json", f"config of {checkpoint}")
    return 2 if str(config.get("torch_dtype", config.get("dtype", "float32"))) in ("bfloat16", "float16") else 4


def cores(count: int, threads: int) -> list[list[int]]:
    """Disjoint core sets for ``count`` replicas of ``threads`` cores each, from the cores this process may use."""
    usable = sorted(os.sched_getaffinity(0))
    return [usable[i * threads:(i + 1) * threads] for i in range(count)]


def slots(params: Params) -> int:
    """Replicas whose core sets fill the cores this process may use."""
    return len(os.sched_getaffinity(0)) // params.vllm.threads_per_replica


def capacity(params: Params, gib_each: list[float]) -> int:
    """How many of the replicas (in order) this machine holds: one core set each, and their RAM."""
    import psutil

    free = psutil.virtual_memory().available / GIB
    held, used = 0, 0.0
    for gib in gib_each[:slots(params)]:
        if used + gib > free:
            break
        held, used = held + 1, used + gib
    return held


@dataclass
class Started:
    """A replica process started here."""

    process: subprocess.Popen
    url: str
    log: Path


def start(params: Params, checkpoint: Path, replica: Replica, core_set: list[int], log: Path) -> Started:
    """Start one CPU replica (logging to ``log``); the caller waits for its ``/health``.

    Every process of the replica (API server, engine core, model worker) is bound to ``core_set``: the engine
    core polls busily, and unbound it takes a second core from the next replica."""
    venv_python = ensure(params)
    log.parent.mkdir(parents=True, exist_ok=True)
    env = process_env(params.vllm, venv_python.parent.parent, core_set)
    key = os.environ.get(params.deploy.api_key_env)
    if key:
        env["VLLM_API_KEY"] = key  # the coordinator sends its key on; never on a command line
    with log.open("ab") as out:
        argv = ["taskset", "-c", ",".join(map(str, core_set)), *command(params, checkpoint, replica)]
        process = subprocess.Popen(argv, cwd=params.root, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    return Started(process, f"http://{replica.host}:{replica.port}", log)


def wait_ready(replica: Started, timeout_s: float) -> None:
    """Wait for the replica's ``/health``.

    Raises:
        ExitplanError: when it exits or the time runs out, with the end of its log.
    """
    from exitplan.deploy import wait_healthy
    from exitplan.errors import ExitplanError

    try:
        wait_healthy(replica.url, timeout_s, replica.process)
    except ExitplanError as exc:
        raise ExitplanError(f"{exc}\n{log_tail(replica.log)}") from exc


def log_tail(log: Path, lines: int = 12) -> str:
    """The last lines of a replica's log (where to look, and what it said)."""
    try:
        return f"last lines of {log}:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {log})"


def stop(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    """Stop a replica and every process it started (it leads its own session): SIGTERM, then after ``grace_s``
    SIGKILL to whatever of its group is left (a replica whose engine died can hang in its shutdown)."""
    if process.poll() is None:
        process.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace_s)
    kill_group(process.pid)
    process.wait()


def kill_group(group: int) -> None:
    """SIGKILL whatever is left of process group ``group`` (none left: nothing to do)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, signal.SIGKILL)
