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
    vllm_device_path,
)
from exitplan.atomic import write_json
from exitplan.config import DaskParams, Params, PlanScenario
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
    routing = train_on_labels(params.plan, labels, queries, scenario.models,
                              params.checkpoint_path(params.plan.embedder))
    return routing if scenario.traffic == "labelled" else workload_window(params, routing)


def workload_window(params: Params, routing: TrainedRouter) -> TrainedRouter:
    """``routing`` with its window made of ``plan.workload_sample`` workload queries (those this machine's replicas
    serve, sampled with ``plan.seed``): their scores, and their prompt and answer tokens.

    Raises:
        WorkloadError: no queries file, or no query fits the replicas.
    """
    from dataclasses import replace

    import numpy as np

    from exitplan.routing.scores import embed
    from exitplan.stages.build_perf_db import workload_queries

    queries = workload_queries(params)
    sample = queries.sample(n=min(params.plan.workload_sample, len(queries)), random_state=params.plan.seed)
    scores = routing.scorer.score(embed(params.checkpoint_path(params.plan.embedder), sample["prompt"].tolist()))
    return replace(routing, window=np.asarray(scores, float),
                   window_lengths=sample[["prompt_len", "output_len"]].to_numpy(int))


def routed_perf(params: Params, scenario: PlanScenario, routing: TrainedRouter) -> Any:
    """Perf-DB rows of the scenario's smallest and largest models on this machine's vLLM device, simulated on the
    lengths of the window's queries each is routed at each of ``plan.routed_shares`` (:mod:`exitplan.planner.
    routed`); ``None`` when the window's lengths are not known (``traffic: labelled``) or the scenario does not use
    the vLLM device."""
    from exitplan.planner.routed import routed_db
    from exitplan.stages.build_perf_db import vllm_rows
    from exitplan.vllm.simulate import read_vllm_device

    if not len(routing.window_lengths) or not params.build_perf_db.vllm_device:
        return None
    if read_vllm_device(vllm_device_path(params)).gpu.id not in scenario.gpus:
        return None
    lengths = (routing.window_lengths[:, 0], routing.window_lengths[:, 1])
    here = DaskParams(workers=1)  # a few layouts per share, and the stage runs each scenario on a Dask worker
    return routed_db(routing.window, lengths, scenario.models, params.plan.routed_shares,
                     lambda own: vllm_rows(params, own, scenario.depths, here))


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
                           params.path("reports") / STAGE / scenario.name, agreement=exit_agreement(params, scenario),
                           routed=routed_perf(params, scenario, routing))
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
