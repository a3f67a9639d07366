"""The production profile: bring it up, deploy onto it, say what runs, bring it down.

Order up: PostgreSQL -> its databases -> Prefect server -> MLflow server -> work pool -> worker; down in reverse.
Each step is a no-op when its service already runs, so ``up`` after a partial failure starts only what is missing.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from exitplan.config import Params
from exitplan.errors import InfraError
from exitplan.infra import postgres
from exitplan.infra.processes import http_ok, running_pid, start, stop, wait_until
from exitplan.ports import port_is_free

PREFECT_SERVER, MLFLOW_SERVER, WORKER = "prefect-server", "mlflow-server", "worker"
"""The services started as processes (PostgreSQL is started by ``pg_ctl``, which keeps its own pid file)."""

QUIET = {"DO_NOT_TRACK": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
         "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "DVC_NO_ANALYTICS": "1", "HF_HUB_OFFLINE": "1",
         "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "GX_ANALYTICS_ENABLED": "false",
         "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
"""The offline, no-telemetry environment of every service and flow run (STACK.md)."""


@dataclass(frozen=True)
class ServiceState:
    """One line of ``infra status``.

    Attributes:
        name: The service.
        running: Whether its process runs.
        healthy: Whether its health check passes.
        address: Where it listens (or what it serves).
        pid: Its process id, when running.
    """

    name: str
    running: bool
    healthy: bool
    address: str
    pid: int | None = None


def state_dir(params: Params) -> Path:
    """The profile's folder (``infra.dir``)."""
    return params.path(params.infra.dir)


def prefect_api(params: Params) -> str:
    """The Prefect server's API URL."""
    return f"http://127.0.0.1:{params.infra.prefect_port}/api"


def mlflow_uri(params: Params) -> str:
    """The MLflow tracking server's URI."""
    return f"http://127.0.0.1:{params.infra.mlflow_port}"


def client_env(params: Params) -> dict[str, str]:
    """What a client of the profile sets: the servers' URLs and the checkout root (``infra env`` prints it)."""
    return {"PREFECT_API_URL": prefect_api(params), "MLFLOW_TRACKING_URI": mlflow_uri(params),
            "EXITPLAN_ROOT": str(params.root)}


def _env(params: Params, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    bin_dir = str(Path(sys.executable).parent)
    return {**env, **QUIET, "PATH": os.pathsep.join([bin_dir, env.get("PATH", "")]), **extra}


def _program(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def _require_free(port: int, what: str, knob: str) -> None:
    if not port_is_free(port):
        raise InfraError(f"port {port} on 127.0.0.1 is taken, so the {what} cannot listen there: stop what holds "
                         f"it or set infra.{knob}")


def up(params: Params) -> list[ServiceState]:
    """Bring the whole profile up, each service healthy before the next starts.

    Raises:
        InfraError: naming the service that failed, with the end of its log.
    """
    state, settings = state_dir(params), params.infra
    if not postgres.running(state, settings):
        _require_free(settings.postgres_port, "PostgreSQL cluster", "postgres_port")
    postgres.create(state, settings)
    postgres.start(state, settings)
    postgres.ensure_databases(state, settings)
    _start_prefect(params, state)
    _start_mlflow(params, state)
    _create_pool(params)
    _start_worker(params, state)
    return status(params)


def _start_prefect(params: Params, state: Path) -> None:
    health = f"{prefect_api(params)}/health"
    if running_pid(state, PREFECT_SERVER) is None:
        _require_free(params.infra.prefect_port, "Prefect server", "prefect_port")
        env = _env(params, PREFECT_HOME=str(state / "prefect"),
                   PREFECT_API_DATABASE_CONNECTION_URL=postgres.url(state, params.infra, "prefect", "asyncpg"))
        start(state, PREFECT_SERVER, [_program("prefect"), "server", "start", "--host", "127.0.0.1", "--port",
                                      str(params.infra.prefect_port)], env, params.root)
    wait_until(lambda: http_ok(health), f"Prefect server at {health}", params.infra.startup_timeout_s, state,
               PREFECT_SERVER)


def artifacts_destination(params: Params) -> str:
    """Where the MLflow server stores artifacts (``infra.artifacts_destination``, else ``<dir>/mlartifacts``)."""
    return params.infra.artifacts_destination or (state_dir(params) / "mlartifacts").as_uri()


def _start_mlflow(params: Params, state: Path) -> None:
    health = f"{mlflow_uri(params)}/health"
    if running_pid(state, MLFLOW_SERVER) is None:
        _require_free(params.infra.mlflow_port, "MLflow server", "mlflow_port")
        # the store URI holds the password: it goes in the environment, never on the command line
        env = _env(params, MLFLOW_BACKEND_STORE_URI=postgres.url(state, params.infra, "mlflow", "psycopg2"))
        start(state, MLFLOW_SERVER, [_program("mlflow"), "server", "--host", "127.0.0.1", "--port",
                                     str(params.infra.mlflow_port), "--workers", "1", "--serve-artifacts",
                                     "--artifacts-destination", artifacts_destination(params)], env, params.root)
    wait_until(lambda: http_ok(health), f"MLflow server at {health}", params.infra.startup_timeout_s, state,
               MLFLOW_SERVER)


def _prefect_cli(params: Params, *args: str) -> str:
    result = subprocess.run([_program("prefect"), *args], cwd=params.root, capture_output=True, text=True,
                            check=False, env=_env(params, **client_env(params)))
    if result.returncode != 0:
        raise InfraError(f"prefect {' '.join(args)} failed (exit {result.returncode}):\n"
                         f"{(result.stdout + result.stderr).strip()[-2000:]}")
    return result.stdout


def _create_pool(params: Params) -> None:
    pool = params.infra.work_pool
    _prefect_cli(params, "work-pool", "create", pool, "--type", "process", "--overwrite")
    _prefect_cli(params, "work-pool", "set-concurrency-limit", pool, str(params.infra.pool_concurrency))


def _worker_online(params: Params) -> bool:
    import httpx

    try:
        answer = httpx.post(f"{prefect_api(params)}/work_pools/{params.infra.work_pool}/workers/filter", json={},
                            timeout=5)
    except httpx.HTTPError:
        return False
    return answer.is_success and any(w.get("status") == "ONLINE" for w in answer.json())


def _start_worker(params: Params, state: Path) -> None:
    if running_pid(state, WORKER) is None:
        env = _env(params, PREFECT_HOME=str(state / "worker"), **client_env(params))
        start(state, WORKER, [_program("prefect"), "worker", "start", "--pool", params.infra.work_pool, "--type",
                              "process", "--name", f"exitplan-{socket.gethostname()}"], env, params.root)
    wait_until(lambda: _worker_online(params), f"worker of pool {params.infra.work_pool}",
               params.infra.startup_timeout_s, state, WORKER)


def deploy(params: Params) -> str:
    """``prefect deploy --all`` from the checkout onto the profile's server, with the checkout root, the tracking
    URI and the offline environment as job variables (prefect.yaml reads them from this environment).

    Returns:
        Prefect's output.
    """
    if not http_ok(f"{prefect_api(params)}/health"):
        raise InfraError(f"no Prefect server at {prefect_api(params)}: run `exitplan infra up` first")
    return _prefect_cli(params, "--no-prompt", "deploy", "--all")


def down(params: Params) -> list[str]:
    """Stop every service of the profile, the worker's flow runs included; the data stays for the next ``up``.

    Returns:
        The services that were running.
    """
    state, stopped = state_dir(params), []
    for name in (WORKER, MLFLOW_SERVER, PREFECT_SERVER):
        if stop(state, name):
            stopped.append(name)
    if postgres.running(state, params.infra) and postgres.stop(state, params.infra):
        stopped.append("postgres")
    return stopped


def status(params: Params) -> list[ServiceState]:
    """What runs: each service's process and health check."""
    state, settings = state_dir(params), params.infra
    pg = postgres.running(state, settings)
    rows = [ServiceState("postgres", pg, pg, f"127.0.0.1:{settings.postgres_port}")]
    checks = {PREFECT_SERVER: (prefect_api(params), lambda: http_ok(f"{prefect_api(params)}/health")),
              MLFLOW_SERVER: (mlflow_uri(params), lambda: http_ok(f"{mlflow_uri(params)}/health")),
              WORKER: (f"pool {settings.work_pool}", lambda: _worker_online(params))}
    for name, (address, check) in checks.items():
        pid = running_pid(state, name)
        rows.append(ServiceState(name, pid is not None, pid is not None and check(), address, pid))
    return rows

