"""Stage ``plan``: BOUTE's co-optimisation per scenario - Pareto front, baselines and the chosen plan."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from exitplan.artifacts import (
    LABELS_FILE,
    QUERIES_FILE,
    exit_curves_path,
    imported_path,
    labels_path,
    perf_db_path,
    plan_dir,
    queries_path,
)
from exitplan.atomic import write_json
from exitplan.config import Params, PlanScenario
from exitplan.errors import LabelsNotFound
from exitplan.tracking import register_plan

if TYPE_CHECKING:
    from exitplan.routing.trainer import TrainedRouter

STAGE = "plan"


def router(params: Params, scenario: PlanScenario) -> TrainedRouter:
    """The scenario's router, trained on its models' labelled queries (see :mod:`exitplan.routing.trainer`).

    Raises:
        ExitplanError: a labels or queries table is missing (naming the stage to run).
    """
    from exitplan.planner.build import read_tables
    from exitplan.planner.scenario import train_on_labels

    labels = read_tables([(labels_path(params), "label_quality"),
                          (imported_path(params, LABELS_FILE), "import_labels")])
    queries = read_tables([(queries_path(params), "prepare_workload"),
                           (imported_path(params, QUERIES_FILE), "import_labels")])
    return train_on_labels(params.plan, labels, queries, scenario.models,
                           params.checkpoint_path(params.plan.embedder))


def exit_agreement(params: Params, scenario: PlanScenario) -> dict[str, dict[int, float]]:
    """The exit profile's agreement by exit per model, when the scenario plans the depth of a model that has no
    published table (``depth_agreement``); empty otherwise (the exit profile is not needed then).

    Raises:
        ExitplanError: the exit profile is missing (naming the stage to run).
    """
    from exitplan.planner.depth import read_agreement

    if not scenario.depths or all(m in scenario.depth_agreement for m in scenario.models):
        return {}
    return read_agreement(exit_curves_path(params))


def run_scenario(params: Params, scenario: PlanScenario) -> dict[str, Any]:
    """Optimise one scenario on the pipeline's perf DB and labels; write its front, plot and plan; returns its
    summary (see :func:`exitplan.planner.scenario.plan_scenario`)."""
    import pandas as pd

    from exitplan.planner.scenario import plan_scenario
    from exitplan.vllm.simulate import planning_catalog

    started = time.perf_counter()
    routing = router(params, scenario)
    db = pd.read_parquet(perf_db_path(params))
    catalog = planning_catalog(params)  # the catalog's GPUs and this machine's vLLM device
    result = plan_scenario(params.plan, scenario, db, catalog, routing, plan_dir(params, scenario.name),
                           params.path("reports") / STAGE / scenario.name, agreement=exit_agreement(params, scenario))
    result["times"]["seconds"] = time.perf_counter() - started
    return result


def skip_reason(params: Params, exc: LabelsNotFound) -> str:
    """Why an optional scenario was skipped, naming the annotation folder when it is the one missing."""
    source = params.path(params.import_labels.source_dir)
    if not source.is_dir():
        return (f"{exc}; the AlpacaEval annotation folder {source} is absent: put the annotation files there (or "
                f"set import_labels.source_dir), then run `dvc repro plan`")
    return str(exc)


def scenario_job(job: tuple[Params, PlanScenario]) -> dict[str, Any]:
    """:func:`run_scenario` of one ``(params, scenario)`` job (module level: Dask workers import it); an optional
    scenario without labels comes back as ``{"name": ..., "skipped": why}``."""
    params, scenario = job
    try:
        return run_scenario(params, scenario)
    except LabelsNotFound as exc:
        if scenario.required:
            raise
        return {"name": scenario.name, "skipped": skip_reason(params, exc)}


def main(params: Params) -> dict[str, Any]:
    """Every scenario (an optional one without labels is skipped with what to supply), optimised side by side on
    the ``dask`` workers (each scenario writes only its own folders; the results come back in the scenarios'
    order), then each registered in MLflow with alias ``challenger``: the first (the promoted one) as
    ``plan.registered_model``, the others as ``<registered_model>-<scenario>``."""
    from exitplan.fanout import sweep

    outcomes = sweep(scenario_job, [(params, scenario) for scenario in params.plan.scenarios], params.dask)
    results = [o for o in outcomes if "skipped" not in o]
    skipped = {o["name"]: o["skipped"] for o in outcomes if "skipped" in o}
    first = results[0]
    metrics = {f"{r['name']}.{k}": getattr(r["plan"], k) for r in results
               for k in ("predicted_p95_s", "predicted_quality", "cost_per_hour")}
    report = write_json(params.path("reports") / STAGE / "metrics.json", {**metrics, "skipped": skipped})
    wall = {f"{r['name']}.{k}": v for r in results for k, v in r["times"].items()}
    versions = {r["name"]: register_plan(params.tracking, params.root, STAGE, r["plan_path"],
                                         params.plan.registered_name(r["name"]), params.plan.model_dump(), metrics,
                                         [report, r["png"], r["front"]], router_path=r["router"], wall_s=wall)
                for r in results}
    return {"plans": {r["name"]: r["plan"] for r in results}, "times": {r["name"]: r["times"] for r in results},
            "skipped": skipped, "version": versions[first["name"]],
            "versions": versions}
