"""The production profile for real, on loopback: PostgreSQL, the Prefect and MLflow servers on it, the work pool
and a worker; the deployments registered; the reprofile deployment run by the worker (not by its schedule); its
MLflow run's artifact uploaded through the server; everything stopped, no process left."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import psutil
import pytest
import yaml

from exitplan import REPO_ROOT
from exitplan.config import Params, load_params
from exitplan.infra import postgres
from exitplan.infra.processes import running_pid
from exitplan.infra.profile import (
    MLFLOW_SERVER,
    PREFECT_SERVER,
    WORKER,
    deploy,
    down,
    mlflow_uri,
    prefect_api,
    state_dir,
    status,
    up,
)
from exitplan.ports import free_port, port_is_free

pytestmark = pytest.mark.integration  # minutes: `make test-all` and CI run it, `make test` does not

LIVE = "data/telemetry/live.parquet"


def telemetry(n: int = 24, seed: int = 0) -> pd.DataFrame:
    """``n`` requests of per-request telemetry in the engine's columns."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        tokens = int(rng.integers(8, 20))
        rows.append({"request_id": f"r{i}", "output_tokens": tokens, "prompt": [1, 2, 3], "max_new_tokens": 20,
                     "confidences": rng.beta(8.0, 2.0, tokens).tolist(), "exit_layers": [24] * tokens})
    return pd.DataFrame(rows)


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A checkout of the project's flows and pipeline files, with its own ports and state folder."""
    repo = tmp_path_factory.mktemp("service")
    for name in ("dvc.yaml", "prefect.yaml"):
        shutil.copy(REPO_ROOT / name, repo / name)
    for package in ("flows", "tasks"):
        shutil.copytree(REPO_ROOT / package, repo / package, ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "model_repository").mkdir()
    shutil.copy(REPO_ROOT / "model_repository" / "catalog.yaml", repo / "model_repository" / "catalog.yaml")
    tree = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    # as root, PostgreSQL runs as an unprivileged account, which pytest's private temp folders keep out
    state = Path(tempfile.mkdtemp(prefix="exitplan-infra-"))
    state.chmod(0o711)
    tree["infra"] = {"dir": str(state), "postgres_port": free_port(), "prefect_port": free_port(),
                     "mlflow_port": free_port()}
    tree["reprofile"].update(telemetry=LIVE, min_requests=4)
    (repo / "params.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
    params = load_params(repo / "params.yaml")
    reference = params.path(params.online_profile.reference_telemetry)
    reference.parent.mkdir(parents=True)
    telemetry(seed=0).to_parquet(reference)
    (repo / "data" / "telemetry").mkdir(parents=True)
    telemetry(seed=1).to_parquet(repo / LIVE)
    yield repo
    shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(scope="module")
def profile(checkout: Path):
    """The profile up and the deployments registered; brought down afterwards whatever happened."""
    params = load_params(checkout / "params.yaml")
    try:
        rows = up(params)
        deploy(params)
        yield params, rows
    finally:
        down(params)


def _run(params: Params, name: str):
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: prefect_api(params)}):
        return run_deployment(name, timeout=300, poll_interval=2)


def _task_runs(params: Params, flow_run_id) -> list:
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    async def fetch() -> list:
        async with get_client() as client:
            return await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))

    with temporary_settings({PREFECT_API_URL: prefect_api(params)}):
        return asyncio.run(fetch())


def test_every_service_comes_up_healthy_on_loopback(profile) -> None:
    params, rows = profile
    assert [(r.name, r.healthy) for r in rows] == [("postgres", True), (PREFECT_SERVER, True), (MLFLOW_SERVER, True),
                                                   (WORKER, True)]
    listening = {c.laddr.port: c.laddr.ip for c in psutil.net_connections("tcp") if c.status == "LISTEN"}
    for port in (params.infra.postgres_port, params.infra.prefect_port, params.infra.mlflow_port):
        assert listening[port] == "127.0.0.1"


def test_the_worker_runs_the_reprofile_deployment_and_its_artifact_goes_through_mlflow(profile) -> None:
    import mlflow

    params, _ = profile
    run = _run(params, "reprofile_fleet/reprofile-fleet")
    assert run.state.is_completed(), run.state.message
    client = mlflow.MlflowClient(tracking_uri=mlflow_uri(params))
    (check,) = client.search_runs([client.get_experiment_by_name("exitplan").experiment_id],
                                  "attributes.run_name = 'reprofile'")
    assert check.info.artifact_uri.startswith("mlflow-artifacts:")
    assert [a.path for a in client.list_artifacts(check.info.run_id)] == ["drift.json"]
    stored = list((state_dir(params) / "mlartifacts").rglob("drift.json"))  # written by the server
    assert len(stored) == 1 and b'"drifted": false' in stored[0].read_bytes()
    assert not (params.root / "mlartifacts").exists()  # nothing written client-side


def test_a_missing_input_fails_without_retries_naming_what_to_do(profile) -> None:
    params, _ = profile
    live = params.root / LIVE
    live.rename(live.with_suffix(".bak"))
    try:
        run = _run(params, "reprofile_fleet/reprofile-fleet")
    finally:
        live.with_suffix(".bak").rename(live)
    assert run.state.is_failed()
    tried = {t.name.rsplit("-", 1)[0]: t for t in _task_runs(params, run.id)}
    assert tried["read-telemetry"].run_count == 1  # retries=2, but a missing file is not retried
    assert "no telemetry at" in str(tried["read-telemetry"].state.message)


def test_a_deployment_made_without_the_checkout_root_says_so(profile) -> None:
    import os
    import subprocess
    import sys

    params, _ = profile
    env = {k: v for k, v in os.environ.items() if k not in ("EXITPLAN_ROOT", "MLFLOW_TRACKING_URI")}
    subprocess.run([str(Path(sys.executable).with_name("prefect")), "--no-prompt", "deploy", "--name",
                    "reprofile-fleet"], cwd=params.root, check=True, capture_output=True,
                   env={**env, "PREFECT_API_URL": prefect_api(params)})
    run = _run(params, "reprofile_fleet/reprofile-fleet")
    assert run.state.is_crashed() or run.state.is_failed()
    logs = _logs(params, run.id)
    assert "EXITPLAN_ROOT" in logs and "exitplan infra deploy" in logs, logs[-2000:]


def _logs(params: Params, flow_run_id) -> str:
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    async def fetch() -> list:
        async with get_client() as client:
            return await client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))

    with temporary_settings({PREFECT_API_URL: prefect_api(params)}):
        return "\n".join(log.message for log in asyncio.run(fetch()))


def test_down_leaves_no_process(checkout: Path, profile) -> None:
    params, _ = profile
    state = state_dir(params)
    pids = [running_pid(state, name) for name in (PREFECT_SERVER, MLFLOW_SERVER, WORKER)]
    postmaster = int((postgres.folder(state) / "data" / "postmaster.pid").read_text().split()[0])
    family = [psutil.Process(p) for p in [*pids, postmaster] if p]
    family += [c for p in family for c in p.children(recursive=True)]
    assert len(family) >= 4
    assert set(down(params)) == {WORKER, MLFLOW_SERVER, PREFECT_SERVER, "postgres"}
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in family)
    assert not any(r.running for r in status(params))
    assert all(port_is_free(port) for port in (params.infra.postgres_port, params.infra.prefect_port,
                                        params.infra.mlflow_port))
