"""MLflow through a server: a server that does not answer fails within seconds, naming its URI; local stores keep
their artifact folder."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from exitplan.config import TrackingParams
from exitplan.errors import TrackingError
from exitplan.ports import free_port
from exitplan.tracking import is_server, log_stage_run


def test_a_tracking_server_that_is_down_fails_fast_and_is_named(tmp_path: Path) -> None:
    port = free_port()
    settings = TrackingParams(tracking_uri=f"http://127.0.0.1:{port}")
    started = time.monotonic()
    with pytest.raises(TrackingError, match=f"http://127.0.0.1:{port}"):
        log_stage_run("stage", settings, tmp_path, {"a": 1}, {"m": 1.0})
    assert time.monotonic() - started < 10  # MLflow's own retries held a stage about 250 s


def test_a_local_store_keeps_artifacts_beside_it(tmp_path: Path) -> None:
    import mlflow

    report = tmp_path / "report.json"
    report.write_text("{}")
    settings = TrackingParams(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = log_stage_run("stage", settings, tmp_path, {"a": 1}, {"m": 1.0}, [report])
    run = mlflow.MlflowClient(tracking_uri=settings.tracking_uri).get_run(run_id)
    assert run.info.artifact_uri.startswith((tmp_path / "mlartifacts").as_uri())
    assert not is_server(settings.tracking_uri) and is_server("https://mlflow.example")


def test_wall_times_are_logged_apart_from_the_metrics(tmp_path: Path) -> None:
    """A stage's wall times reach MLflow as ``wall.<name>`` (its DVC metrics file never holds them)."""
    import mlflow

    settings = TrackingParams(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = log_stage_run("stage", settings, tmp_path, {"a": 1}, {"m": 1.0, "per": {"x": 2}},
                           wall_s={"seconds": 2.5, "fetch_s": 1.0})
    run = mlflow.MlflowClient(tracking_uri=settings.tracking_uri).get_run(run_id)
    assert run.data.metrics == {"m": 1.0, "per.x": 2.0, "wall.seconds": 2.5, "wall.fetch_s": 1.0}
