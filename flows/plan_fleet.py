"""Flow ``plan_fleet``: the planning pipeline, stage by stage through DVC.

Validate params -> fetch the embedded models -> prepare the workloads -> import the labels of models that cannot
run here (AlpacaEval annotations, when present) -> build the perf DB (simulation) -> train
exit heads -> exit profile -> device profile -> candidate selection -> quality labels -> co-optimised plan (MLflow
alias ``challenger``) -> the truncated checkpoints of partial vLLM replicas -> HELIOS online profiling (the PHT) ->
gates -> promotion (alias ``champion``). The stages are dvc.yaml's (``exitplan.pipeline.stage_graph``), two at a
time where its DAG allows; each runs only if DVC finds it stale, so a re-run after a failure does only what is
missing.
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.futures import as_completed, wait

from exitplan.config import Params
from exitplan.pipeline import ReproResult
from exitplan.runtime import SOLO_STAGES
from exitplan.stage_schedule import StageScheduler
from tasks.pipeline import check_config, list_stage_graph, push_outputs, repro_stage, summarize
from tasks.reprofile import promote_plan


@flow(name="plan_fleet", log_prints=True)
def plan_fleet(params_path: str = "params.yaml", stages: list[str] | None = None,
               push: bool = True) -> list[ReproResult]:
    """Run the pipeline's stages through ``dvc repro`` (each only if stale; all of them, side by side where the DAG
    allows, or ``stages`` one after the other), promote the plan if its gates passed (raises, naming every failed
    expectation, if not), push the outputs to the DVC remote (``push``), and report where outputs are."""
    params = check_config(Path(params_path))
    results = run_in_order(stages, params) if stages else run_side_by_side(params)
    logger = get_run_logger()
    if any(r.target == "gate" for r in results) and params.tracking.enabled:
        logger.info("promotion: %s", promote_plan(params))
    if push:
        logger.info("dvc push: %s", push_outputs(params.root))
    print(summarize(params))
    return results


def run_in_order(stages: list[str], params: Params) -> list[ReproResult]:
    """``dvc repro`` of each of ``stages`` in turn (each with whatever upstream stage it finds stale)."""
    started, results = time.perf_counter(), []
    for stage in stages:
        results.append(repro_stage(stage, params.root))
        _report(results, len(stages), started)
    return results


def run_side_by_side(params: Params) -> list[ReproResult]:
    """Every stage of dvc.yaml, each as soon as its upstream stages are done, ``runtime.parallel_stages`` at a time
    (the timing stages alone: ``exitplan.stage_schedule``); returns the results in the order the stages ended.
    A failed stage fails the flow once the stages beside it have ended (their outputs are kept)."""
    schedule = StageScheduler(list_stage_graph(params.root), SOLO_STAGES, params.runtime.parallel_stages)
    started, results, running = time.perf_counter(), [], {}
    while not schedule.finished:
        for name in schedule.startable():
            threads = schedule.threads(name, params.runtime.model_threads)
            future = repro_stage.submit(name, params.root, None if threads == params.runtime.model_threads else threads,
                                        single=True)
            running[future] = name
        future = next(as_completed(list(running)))
        schedule.finish(running.pop(future))
        try:
            results.append(future.result())
        except Exception:
            wait(list(running))  # the stages beside the failed one end, and DVC records their outputs
            raise
        _report(results, len(schedule.needs), started)
    return results


def _report(results: list[ReproResult], total: int, started: float) -> None:
    """A progress line for the stage that just ended: what ran, its time and the total so far."""
    get_run_logger().info("[%d/%d] %s: %s in %.1f min (%.1f min so far)", len(results), total, results[-1].target,
                          ", ".join(results[-1].ran) or "up to date", results[-1].seconds / 60,
                          (time.perf_counter() - started) / 60)


if __name__ == "__main__":
    plan_fleet()
