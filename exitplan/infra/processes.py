"""Long-running services as detached processes: one pid file and one log each, health checks, stop with children."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from exitplan.atomic import write_atomic
from exitplan.errors import InfraError

STOP_GRACE_S = 15.0
"""How long a stopped service may take to exit on SIGTERM before it (and what it started) is killed."""


def pid_file(state: Path, name: str) -> Path:
    """Where the pid of service ``name`` is kept."""
    return state / "pids" / f"{name}.pid"


def log_file(state: Path, name: str) -> Path:
    """The log of service ``name`` (its stdout and stderr)."""
    return state / "logs" / f"{name}.log"


def running_pid(state: Path, name: str) -> int | None:
    """The pid of service ``name`` if its pid file names a live process, else None (a stale file is removed)."""
    path = pid_file(state, name)
    try:
        pid = int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    if _alive(pid):
        return pid
    path.unlink(missing_ok=True)
    return None


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def start(state: Path, name: str, argv: Sequence[str], env: Mapping[str, str], cwd: Path) -> int:
    """Start ``argv`` detached (its own session, so a Ctrl-C of the caller does not reach it), logging to its log.

    Returns:
        Its pid (recorded in its pid file).
    """
    log = log_file(state, name)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        process = subprocess.Popen(list(argv), cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    write_atomic(pid_file(state, name), lambda tmp: tmp.write_text(f"{process.pid}\n"))
    return process.pid


def family(pid: int) -> list:
    """Process ``pid`` and every process it started (``psutil.Process`` objects; none once it is gone)."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def stop(state: Path, name: str) -> bool:
    """Stop service ``name`` and every process it started (SIGTERM, then SIGKILL after :data:`STOP_GRACE_S`).

    Returns:
        Whether it was running.
    """
    import psutil

    pid = running_pid(state, name)
    if pid is None:
        return False
    members = family(pid)
    for process in members:
        _signal(process, signal.SIGTERM)
    _, left = psutil.wait_procs(members, timeout=STOP_GRACE_S)
    for process in left:
        _signal(process, signal.SIGKILL)
    psutil.wait_procs(left, timeout=5)
    pid_file(state, name).unlink(missing_ok=True)
    return True


def _signal(process: object, sig: int) -> None:
    import contextlib

    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        process.send_signal(sig)  # type: ignore[attr-defined]


def wait_until(check: Callable[[], bool], what: str, timeout_s: float, state: Path, name: str | None = None) -> None:
    """Poll ``check`` until it is true.

    Raises:
        InfraError: after ``timeout_s``, or at once when service ``name`` exited; with the end of its log.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        if name is not None and running_pid(state, name) is None:
            raise InfraError(f"{what}: the process exited\n{log_tail(state, name)}")
        time.sleep(0.5)
    raise InfraError(f"{what}: not ready after {timeout_s:.0f} s\n{log_tail(state, name) if name else ''}")


def log_tail(state: Path, name: str, lines: int = 15) -> str:
    """The last lines of service ``name``'s log (where to look, and what it said)."""
    path = log_file(state, name)
    try:
        text = path.read_text(errors="replace").strip().splitlines()[-lines:]
    except FileNotFoundError:
        return f"(no log at {path})"
    return f"last lines of {path}:\n" + "\n".join(text)


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """Whether ``GET url`` answers 2xx within ``timeout_s``."""
    import httpx

    try:
        return httpx.get(url, timeout=timeout_s).is_success
    except httpx.HTTPError:
        return False


def uid_gid(user: str | None) -> tuple[int, int]:
    """The uid and gid of ``user`` (None: this process's)."""
    if user is None:
        return os.getuid(), os.getgid()
    import pwd

    entry = pwd.getpwnam(user)
    return entry.pw_uid, entry.pw_gid
