"""Running DVC stages from code: ``dvc repro <stage>``, so that ``dvc.lock`` stays the one truth of what is current.

The flows call these through tasks; nothing here imports Prefect.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from exitplan.errors import PipelineError


@dataclass(frozen=True)
class ReproResult:
    """What one ``dvc repro`` did.

    Attributes:
        target: The stage (or stage group) asked for.
        ran: Stages DVC actually ran (empty when all were up to date).
        output: DVC's console output.
        seconds: Wall time of the ``dvc repro``.
    """

    target: str
    ran: list[str]
    output: str
    seconds: float = 0.0


def stage_names(root: Path) -> list[str]:
    """The stages of ``root``'s ``dvc.yaml`` in the order written there (a ``foreach`` stage by its name, which
    ``dvc repro`` runs for every item): the pipeline's one list of its stages.

    Raises:
        PipelineError: if dvc.yaml is missing or has no stages.
    """
    import yaml

    path = root / "dvc.yaml"
    if not path.is_file():
        raise PipelineError(f"no dvc.yaml in {root}")
    stages = (yaml.safe_load(path.read_text()) or {}).get("stages") or {}
    if not isinstance(stages, dict) or not stages:
        raise PipelineError(f"{path} defines no stages")
    return list(stages)


def dvc_executable() -> str:
    """The ``dvc`` of this environment (beside the running Python), else the one on PATH."""
    beside = Path(sys.executable).with_name("dvc")
    return str(beside) if beside.exists() else (shutil.which("dvc") or "dvc")


LOCK_FILE = Path(".dvc") / "tmp" / "exitplan-repro.lock"
"""The lock that serialises ``dvc repro`` runs of one checkout (relative to its root)."""

LOCK_WAIT_S = 4 * 3600.0
"""How long a repro waits for another one on the same checkout (a full ``make run`` takes under an hour)."""


@contextmanager
def checkout_lock(root: Path, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
    """Hold the checkout's repro lock: a second run (a scheduled flow while ``make run`` works, say) waits for the
    first instead of failing on DVC's own lock ("... is busy").

    Raises:
        PipelineError: if the lock is still held after ``wait_s`` (naming the process that holds it).
    """
    path = root / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as handle:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    handle.seek(0)
                    raise PipelineError(f"another run (pid {handle.read().strip() or '?'}) has held {path} for "
                                        f"{wait_s:.0f} s: wait for it to finish, or stop it") from None
                time.sleep(1.0)
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def dvc(args: list[str], root: Path) -> str:
    """Run ``dvc <args>`` in ``root`` (holding :func:`checkout_lock`) with this environment's programs on PATH.

    Returns:
        DVC's console output.

    Raises:
        PipelineError: with DVC's last lines when it fails.
    """
    # Stage commands (`exitplan stage ...`) must run in this same environment, activated or not.
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")])}
    with checkout_lock(root):
        result = subprocess.run([dvc_executable(), *args], cwd=root, env=env, capture_output=True, text=True,
                                check=False)
    output = result.stdout + result.stderr
    if result.returncode != 0:
        tail = "\n".join(output.strip().splitlines()[-15:])
        raise PipelineError(f"dvc {' '.join(args)} failed (exit {result.returncode}):\n{tail}")
    return output


def repro(target: str, root: Path) -> ReproResult:
    """Run ``dvc repro <target>`` in ``root`` and report which stages ran.

    Raises:
        PipelineError: with DVC's last lines when the stage fails.
    """
    started = time.perf_counter()
    output = dvc(["repro", target], root)
    ran = [line.split("'")[1] for line in output.splitlines() if line.startswith("Running stage '")]
    return ReproResult(target, ran, output, time.perf_counter() - started)


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
