"""The one MLflow adapter: every stage run is recorded here, and no other module imports mlflow.

Two modes. Embedded (the default): ``sqlite:///mlflow.db`` beside ``params.yaml`` with artifacts under
``mlartifacts/`` (both git-ignored); browse with ``mlflow ui --backend-store-uri sqlite:///mlflow.db``. Server:
``$MLFLOW_TRACKING_URI`` or ``tracking.tracking_uri`` naming an ``http(s)://`` tracking server (``exitplan infra up``
starts one); artifacts then go through the server (``mlflow-artifacts:``), never to a client-side folder, and a server
that does not answer fails the call within seconds, naming its URI.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from exitplan.artifacts import ROUTER_FILE
from exitplan.config import TrackingParams
from exitplan.errors import TrackingError

MAX_PARAM_CHARS = 6000
"""MLflow rejects longer param values."""


def tracking_uri(settings: TrackingParams, root: Path) -> str:
    """The tracking URI in force: params, then ``$MLFLOW_TRACKING_URI``, then the repo's sqlite file."""
    return settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{root / 'mlflow.db'}"


HEALTH_TIMEOUT_S = 3.0
"""How long a tracking server has to answer its ``/health`` before a call gives up."""

SERVER_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
"""MLflow's HTTP client settings towards a server, unless set already: its defaults (7 retries with back-off,
120 s timeouts) hold a stage about 250 s when the server goes away mid-run."""


def is_server(uri: str) -> bool:
    """Whether ``uri`` is a tracking server (HTTP), not a local store."""
    return uri.startswith(("http://", "https://"))


def connect(settings: TrackingParams, root: Path) -> str:
    """Point MLflow at the tracking URI in force and return it; a server is health-checked first.

    Raises:
        TrackingError: if the tracking server does not answer within :data:`HEALTH_TIMEOUT_S`.
    """
    import httpx
    import mlflow

    uri = tracking_uri(settings, root)
    if is_server(uri):
        for key, value in SERVER_HTTP.items():
            os.environ.setdefault(key, value)
        try:
            httpx.get(f"{uri.rstrip('/')}/health", timeout=HEALTH_TIMEOUT_S).raise_for_status()
        except httpx.HTTPError as err:
            raise TrackingError(f"the MLflow tracking server {uri} does not answer ({err}): start it "
                                f"(`exitplan infra up`), or unset MLFLOW_TRACKING_URI and tracking.tracking_uri to "
                                f"use the embedded store") from err
    mlflow.set_tracking_uri(uri)
    return uri


def use_experiment(settings: TrackingParams, root: Path) -> None:
    """Make ``settings.experiment`` current, creating it if needed: with artifacts under ``root/mlartifacts`` for a
    local store, at the server's own (proxied) artifact root for a server.

    Raises:
        TrackingError: if the server holds the experiment with a client-side ``file:`` artifact location (made by
            an old client): its artifacts would never reach the server.
    """
    import mlflow

    uri = connect(settings, root)
    experiment = mlflow.get_experiment_by_name(settings.experiment)
    if experiment is None:
        location = None if is_server(uri) else (root / "mlartifacts").as_uri()
        mlflow.create_experiment(settings.experiment, artifact_location=location)
    elif is_server(uri) and experiment.artifact_location.startswith("file:"):
        raise TrackingError(f"experiment {settings.experiment!r} on {uri} stores artifacts at "
                            f"{experiment.artifact_location}, on the client's disk, not through the server: set "
                            f"tracking.experiment to a new name (or delete that experiment on the server)")
    mlflow.set_experiment(settings.experiment)


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested mappings to ``a.b.c`` keys (lists are kept as values)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def metric_name(key: str) -> str:
    """A key made acceptable to MLflow (alphanumerics, ``_ - . : /`` and spaces; others become ``_``)."""
    return re.sub(r"[^\w\-.:/ ]", "_", key)


def _numeric(metrics: Mapping[str, Any]) -> dict[str, float]:
    return {metric_name(k): float(v) for k, v in flatten(metrics).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _run_metrics(metrics: Mapping[str, Any], wall_s: Mapping[str, float] | None) -> dict[str, float]:
    """A run's MLflow metrics: the numeric ``metrics`` and the wall times as ``wall.<name>``."""
    return {**_numeric(metrics), **_numeric({"wall": dict(wall_s or {})})}


def log_stage_run(stage: str, settings: TrackingParams, root: Path, params: Mapping[str, Any],
                  metrics: Mapping[str, Any], artifacts: Iterable[Path] = (),
                  wall_s: Mapping[str, float] | None = None) -> str | None:
    """Record one stage run: its params, numeric metrics (nested keys flattened), wall times and small artifacts.

    Wall times are recorded here only, never in a stage's files: a DVC output or metrics file holds what the
    inputs determine, so a fresh run of the same code on the same inputs leaves ``dvc.lock`` as it was.

    Args:
        stage: Stage name, used as the run name and the ``stage`` tag.
        settings: The ``tracking`` section of params.
        root: Repository root (for the default store).
        params: The stage's params section (nested mappings are flattened).
        metrics: Metrics; non-numeric leaves are skipped.
        artifacts: Small files to attach.
        wall_s: Seconds taken, by name (``seconds``, ``fetch_s``, ...); logged as metrics ``wall.<name>``.

    Returns:
        The MLflow run id, or None when tracking is disabled.
    """
    if not settings.enabled:
        return None
    import mlflow

    use_experiment(settings, root)
    with mlflow.start_run(run_name=stage, tags={"stage": stage}) as run:
        mlflow.log_params({k: str(v)[:MAX_PARAM_CHARS] for k, v in flatten(params).items()})
        mlflow.log_metrics(_run_metrics(metrics, wall_s))
        for path in artifacts:
            mlflow.log_artifact(str(path))
        return run.info.run_id


def register_plan(settings: TrackingParams, root: Path, stage: str, plan_path: Path, model_name: str,
                  params: Mapping[str, Any], metrics: Mapping[str, Any], artifacts: Iterable[Path] = (),
                  alias: str = "challenger", router_path: Path | None = None,
                  wall_s: Mapping[str, float] | None = None) -> str | None:
    """Record a plan run and register the plan as a version of ``model_name`` with ``alias`` (never a stage).

    The registered model is a pyfunc whose ``predict`` routes queries: given a frame with a ``score`` column (the
    router's score), it returns the model each query goes to, by the plan's thresholds. The routing model that
    scores queries (``router_path``), when given, travels with it as an artifact; wall times (``wall_s``) are
    logged as :func:`log_stage_run` logs them.

    Returns:
        The model version, or None when tracking is disabled.
    """
    if not settings.enabled:
        return None

    import mlflow
    import mlflow.pyfunc

    class PlanRouter(mlflow.pyfunc.PythonModel):  # type: ignore[name-defined]
        """Routes scored queries by the plan's thresholds."""

        def load_context(self, context: Any) -> None:
            from exitplan.planner.plan_file import read_plan

            self.plan = read_plan(Path(context.artifacts["plan"]))

        def predict(self, context: Any, model_input: Any, params: Any = None) -> list[str]:
            import numpy as np

            cuts = np.asarray(self.plan.thresholds, float)
            models = self.plan.model_ids
            return [models[i] for i in np.searchsorted(cuts, model_input["score"].to_numpy(), side="right")]

    use_experiment(settings, root)
    with mlflow.start_run(run_name=stage, tags={"stage": stage}):
        mlflow.log_params({k: str(v)[:MAX_PARAM_CHARS] for k, v in flatten(params).items()})
        mlflow.log_metrics(_run_metrics(metrics, wall_s))
        for path in artifacts:
            mlflow.log_artifact(str(path))
        files = {"plan": str(plan_path), **({"router": str(router_path)} if router_path else {})}
        info = mlflow.pyfunc.log_model(name="plan", python_model=PlanRouter(), artifacts=files,
                                       pip_requirements=["pandas", "numpy", "scikit-learn"])
    version = mlflow.register_model(info.model_uri, model_name)
    mlflow.MlflowClient().set_registered_model_alias(model_name, alias, version.version)
    return str(version.version)


def _client(settings: TrackingParams, root: Path) -> Any:
    import mlflow

    return mlflow.MlflowClient(tracking_uri=connect(settings, root))


def alias_version(settings: TrackingParams, root: Path, model_name: str, alias: str) -> dict[str, Any] | None:
    """The version ``alias`` points at (``version``, ``run_id``, ``tags``), or None when unset or no such model."""
    from mlflow.exceptions import MlflowException

    try:
        version = _client(settings, root).get_model_version_by_alias(model_name, alias)
    except MlflowException:
        return None
    return {"version": str(version.version), "run_id": version.run_id, "tags": dict(version.tags)}


def versions(settings: TrackingParams, root: Path, model_name: str) -> list[dict[str, Any]]:
    """Every version of ``model_name`` (``version``, ``tags``, ``aliases``), oldest first."""
    found = _client(settings, root).search_model_versions(f"name = '{model_name}'")
    return sorted(({"version": str(v.version), "tags": dict(v.tags), "aliases": list(v.aliases)} for v in found),
                  key=lambda v: int(v["version"]))


def plan_artifact(settings: TrackingParams, root: Path, model_name: str, version: str,
                  file_name: str | None = None) -> bytes:
    """A file a model version was registered with: ``file_name`` (e.g. its routing model, ``router.json``), or by
    default its plan JSON (the JSON artifact that is not the routing model)."""
    import tempfile

    import mlflow

    connect(settings, root)
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{model_name}/{version}", dst_path=tmp))
        found = sorted(p for p in local.rglob(file_name or "*.json") if p.parent.name == "artifacts"
                       and (file_name or p.name != ROUTER_FILE))
        if not found:
            raise FileNotFoundError(f"model version {model_name}/{version} holds no {file_name or 'plan JSON'}")
        return found[0].read_bytes()


def set_alias(settings: TrackingParams, root: Path, model_name: str, alias: str, version: str,
              tags: Mapping[str, str] | None = None) -> None:
    """Record ``tags`` on the version, then point ``alias`` at it."""
    client = _client(settings, root)
    for key, value in (tags or {}).items():
        client.set_model_version_tag(model_name, version, key, str(value)[:MAX_PARAM_CHARS])
    client.set_registered_model_alias(model_name, alias, version)
