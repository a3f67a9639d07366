"""Flow ``plan_fleet``: the planning pipeline, stage by stage through DVC.

Validate params -> fetch the embedded models -> prepare the workloads -> import the labels of models that cannot
run here (AlpacaEval annotations, when present) -> build the perf DB (simulation) -> train
exit heads -> exit profile -> device profile -> candidate selection -> quality labels -> co-optimised plan (MLflow
alias ``challenger``) -> the truncated checkpoints of partial vLLM replicas -> HELIOS online profiling (the PHT) ->
gates -> promotion (alias ``champion``). The stages are dvc.yaml's, in its order (``exitplan.pipeline.stage_names``);
each runs only if DVC finds it stale, so a re-run after a failure does only what is missing.
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow, get_run_logger

from exitplan.pipeline import ReproResult
from tasks.pipeline import check_config, list_stages, push_outputs, repro_stage, summarize
from tasks.reprofile import promote_plan


@flow(name="plan_fleet", log_prints=True)
def plan_fleet(params_path: str = "params.yaml", stages: list[str] | None = None,
               push: bool = True) -> list[ReproResult]:
    """Run the pipeline's stages through ``dvc repro`` (each only if stale), promote the plan if its gates passed
    (raises, naming every failed expectation, if not), push the outputs to the DVC remote (``push``), and report
    where outputs are."""
    params = check_config(Path(params_path))
    logger, started = get_run_logger(), time.perf_counter()
    names = stages or list_stages(params.root)
    results = []
    for i, stage in enumerate(names, 1):  # a progress line per stage as it ends, with its time and the total so far
        results.append(repro_stage(stage, params.root))
        logger.info("[%d/%d] %s: %s in %.1f min (%.1f min so far)", i, len(names), stage,
                    ", ".join(results[-1].ran) or "up to date", results[-1].seconds / 60,
                    (time.perf_counter() - started) / 60)
    if "gate" in [r.target for r in results] and params.tracking.enabled:
        logger.info("promotion: %s", promote_plan(params))
    if push:
        logger.info("dvc push: %s", push_outputs(params.root))
    print(summarize(params))
    return results


if __name__ == "__main__":
    plan_fleet()
