"""Running DVC stages from code: ``dvc repro <stage>``, so that ``dvc.lock`` stays the one truth of what is current.

The flows call these through tasks; nothing here imports Prefect.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from exitplan.errors import PipelineError


@dataclass(frozen=True)
class ReproResult:
    """What one ``dvc repro`` did.

    Attributes:
        target: The stage (or stage group) asked for.
        ran: Stages DVC actually ran (empty when all were up to date).
        output: DVC's console output.
        seconds: Wall time of the ``dvc repro``.
        started: When it started (seconds since the epoch).
    """

    target: str
    ran: list[str]
    output: str
    seconds: float = 0.0
    started: float = 0.0


def stage_names(root: Path) -> list[str]:
    """The stages of ``root``'s ``dvc.yaml`` in the order written there (a ``foreach`` stage by its name, which
    ``dvc repro`` runs for every item): the pipeline's one list of its stages.

    Raises:
        PipelineError: if dvc.yaml is missing, not YAML, or has no stages.
    """
    import yaml

    path = root / "dvc.yaml"
    if not path.is_file():
        raise PipelineError(f"no dvc.yaml in {root}")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise PipelineError(f"{path} is not valid YAML: {exc}") from None
    stages = (tree.get("stages") if isinstance(tree, dict) else None) or {}
    if not isinstance(stages, dict) or not stages:
        raise PipelineError(f"{path} defines no stages")
    return list(stages)


def stage_graph(root: Path) -> dict[str, list[str]]:
    """Every stage of ``root``'s pipeline, one per ``foreach`` item (``train_exits@<model>``), in dvc.yaml's order,
    with the stages whose outputs it depends on: DVC's own DAG (its index), so it matches what ``dvc repro`` does.

    Raises:
        PipelineError: if DVC cannot read the pipeline (naming its message).
    """
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    stage_names(root)  # the missing or empty dvc.yaml, by name
    try:
        with Repo(str(root)) as repo:
            graph = repo.index.graph
            return {_address(stage, root): sorted(_address(dep, root) for dep in graph.successors(stage))
                    for stage in repo.index.stages}
    except DvcException as exc:
        raise PipelineError(f"dvc cannot read the pipeline in {root}: {exc}") from exc


def _address(stage: Any, root: Path) -> str:
    """How ``dvc repro`` run in ``root`` names a DVC stage: its name in ``root``'s dvc.yaml, else ``<file>:<name>``
    (or the ``.dvc`` file's path). DVC's own ``addressing`` is relative to the working directory instead."""
    relative = os.path.relpath(stage.path, root)
    name = getattr(stage, "name", None)
    if not name:
        return relative
    return name if relative == "dvc.yaml" else f"{relative}:{name}"


def dvc_executable() -> str:
    """The ``dvc`` of this environment (beside the running Python), else the one on PATH."""
    beside = Path(sys.executable).with_name("dvc")
    return str(beside) if beside.exists() else (shutil.which("dvc") or "dvc")


LOCK_FILE = Path(".dvc") / "tmp" / "exitplan-repro.lock"
"""The lock that serialises ``dvc repro`` runs of one checkout (relative to its root)."""

LOCK_WAIT_S = 4 * 3600.0
"""How long a repro waits for another one on the same checkout (a full ``make run`` takes under an hour)."""


_holders: dict[Path, list[Any]] = {}
"""The checkout locks this process holds: lock file -> [open handle, how many of its threads are inside]."""

_holders_guard = threading.Lock()


@contextmanager
def checkout_lock(root: Path, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
    """Hold the checkout's repro lock: a second run (a scheduled flow while ``make run`` works, say) waits for the
    first instead of failing on DVC's own lock ("... is busy"). Threads of one process share it: the flow's stages
    that run side by side (each its own ``dvc repro``, which DVC allows) all hold it, and the last one out lets go.

    Raises:
        PipelineError: if the lock is still held after ``wait_s`` (naming the process that holds it).
    """
    path = (root / LOCK_FILE).resolve()
    with _holders_guard:
        if path in _holders:
            _holders[path][1] += 1
        else:
            _holders[path] = [_acquire(path, wait_s), 1]
    try:
        yield
    finally:
        with _holders_guard:
            _holders[path][1] -= 1
            if _holders[path][1] == 0:
                handle = _holders.pop(path)[0]
                fcntl.flock(handle, fcntl.LOCK_UN)
                handle.close()


def _acquire(path: Path, wait_s: float) -> IO[str]:
    """Open and ``flock`` the lock file at ``path`` (waiting up to ``wait_s``), writing this process's id in it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = path.open("a+")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                handle.seek(0)
                holder = handle.read().strip() or "?"
                handle.close()
                raise PipelineError(f"another run (pid {holder}) has held {path} for {wait_s:.0f} s: wait for it "
                                    "to finish, or stop it") from None
            time.sleep(1.0)
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def dvc(args: list[str], root: Path, env: dict[str, str] | None = None) -> str:
    """Run ``dvc <args>`` in ``root`` (holding :func:`checkout_lock`) with this environment's programs on PATH (and
    ``env`` added to its environment). DVC waits for its own repo lock (``--wait-for-lock``): stages that run side
    by side each take it for a moment before and after their command.

    Returns:
        DVC's console output.

    Raises:
        PipelineError: with DVC's last lines when it fails.
    """
    # Stage commands (`exitplan stage ...`) must run in this same environment, activated or not.
    bin_dir = str(Path(sys.executable).parent)
    full_env = {**os.environ, **(env or {}), "DVC_NO_ANALYTICS": "1",
                "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")])}
    with checkout_lock(root):
        result = subprocess.run([dvc_executable(), "--wait-for-lock", *args], cwd=root, env=full_env,
                                capture_output=True, text=True, check=False)
    output = result.stdout + result.stderr
    if result.returncode != 0:
        tail = "\n".join(output.strip().splitlines()[-15:])
        raise PipelineError(f"dvc {' '.join(args)} failed (exit {result.returncode}):\n{tail}")
    return output


def repro(target: str, root: Path, threads: int | None = None, single: bool = False) -> ReproResult:
    """Run ``dvc repro <target>`` in ``root`` and report which stages ran; ``threads``: the torch threads of a model
    stage in place of ``runtime.model_threads`` (``exitplan.runtime.THREADS_ENV``); ``single``: that stage alone
    (``--single-item``), not its stale upstream stages too - for a caller that ran those first, and runs stages
    side by side (DVC's per-file locks do not wait: a stage that re-checked its upstream stages' outputs while
    another stage read them failed with "... is busy").

    Raises:
        PipelineError: with DVC's last lines when the stage fails.
    """
    from exitplan.runtime import THREADS_ENV

    started, wall = time.perf_counter(), time.time()
    output = dvc(["repro", *(["--single-item"] if single else []), target], root,
                 {THREADS_ENV: str(threads)} if threads else None)
    ran = [line.split("'")[1] for line in output.splitlines() if line.startswith("Running stage '")]
    return ReproResult(target, ran, output, time.perf_counter() - started, wall)


def push(root: Path) -> str:
    """``dvc push``: every output of ``dvc.lock`` to the default remote (``.dvc/config``; a machine of its own may
    point it elsewhere with ``dvc remote modify --local``), so that another clone's ``dvc pull`` finds every stage
    current.

    Returns:
        DVC's summary line (how many files were pushed).

    Raises:
        PipelineError: if the remote cannot be reached or written (naming it, with DVC's message).
    """
    output = dvc(["push"], root)
    lines = [line for line in output.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "nothing to push"
