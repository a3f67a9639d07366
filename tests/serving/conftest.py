"""Real engine servers on 127.0.0.1 (uvicorn in a thread) serving SmolLM2-135M at full depth."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import yaml

from exitplan import REPO_ROOT
from exitplan.ports import free_port  # noqa: F401 (the tests' import point)

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


def start_in_thread(app, port: int | None = None, grace_s: int = 20, ready: tuple[int, ...] = (200, 503)):
    """Run ``app`` on 127.0.0.1 in a thread under a :class:`DrainingServer` (``begin_drain()`` is what SIGTERM
    does); returns ``(server, thread, url)`` once ``/health`` answers one of ``ready``."""
    import uvicorn

    from serving.lifecycle import DrainingServer

    port = port or free_port()
    server = DrainingServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=grace_s), app.state.drain)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code in ready:
                return server, thread, url
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"server on {url} did not start")


@contextmanager
def serve(app, port: int | None = None) -> Iterator[str]:
    """Run ``app`` in a thread (:func:`start_in_thread`); yields its base URL; shuts it down gracefully."""
    server, thread, url = start_in_thread(app, port)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def engine_app(checkpoint: Path, name: str = SMOLLM2, max_queue: int = 64, timeout_s: float = 240.0,
               api_key: str | None = None, max_num_seqs: int = 8, telemetry: Path | None = None,
               drain_s: float = 20.0):
    from exitplan.engine.engine import EngineConfig
    from exitplan.engine.served import Candidate
    from exitplan.profiling.pht import PerformanceHistoryTable
    from serving.api import ServerSettings
    from serving.server import make_app

    config = EngineConfig(memory_budget_bytes=2 * 2**30, mode="full", max_num_seqs=max_num_seqs)
    settings = ServerSettings(name, max_context=512, request_timeout_s=timeout_s, api_key=api_key, drain_s=drain_s)
    return make_app(Candidate(name, checkpoint), config, PerformanceHistoryTable(), settings, max_queue, telemetry)


@pytest.fixture(scope="module")
def engine_url(smollm2_checkpoint: Path) -> Iterator[str]:
    with serve(engine_app(smollm2_checkpoint)) as url:
        yield url


def engine_process(checkpoint: Path, tmp: Path, name: str, port: int | None = None,
                   env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """An engine server in its own process (so it can be killed), serving ``checkpoint`` as ``name``."""
    tree = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    tree["catalog"] = str(REPO_ROOT / "model_repository" / "catalog.yaml")
    tree["tracking"]["enabled"] = False
    tree["fetch_models"]["checkpoint_dir"] = str(tmp / "checkpoints")
    (tmp / "checkpoints" / name).parent.mkdir(parents=True, exist_ok=True)
    if not (tmp / "checkpoints" / name).exists():
        (tmp / "checkpoints" / name).symlink_to(checkpoint)
    (tmp / "params.yaml").write_text(yaml.safe_dump(tree))
    port = port or free_port()
    proc = subprocess.Popen([sys.executable, "-m", "serving.server", "--model", name, "--port", str(port),
                             "--params", str(tmp / "params.yaml"), "--memory-gib", "1", "--max-context", "512"],
                            cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("engine process did not start")
