"""Tasks that run DVC stages and check the config."""

from __future__ import annotations

from pathlib import Path

from prefect import task

from exitplan.config import Params, load_params
from exitplan.pipeline import ReproResult, push, repro, stage_graph


@task(name="check-config")
def check_config(params_path: Path) -> Params:
    """Validate params.yaml (and the models it names against the catalog) before any stage runs."""
    return load_params(params_path)




@task(name="stage-graph")
def list_stage_graph(root: Path) -> dict[str, list[str]]:
    """Every stage (one per ``foreach`` item) with the stages it depends on, in dvc.yaml's order."""
    return stage_graph(root)


@task(name="dvc-repro")
def repro_stage(target: str, root: Path, threads: int | None = None, single: bool = False) -> ReproResult:
    """``dvc repro <target>``: runs the stage (and its stale upstream stages, unless ``single``) only if DVC finds
    it stale (a model stage with ``threads`` torch threads, when given). No retries: a stage that failed fails the
    same way again (and a concurrent run of the checkout waits on its lock instead of failing)."""
    return repro(target, root, threads, single)


@task(name="summarize")
def summarize(params: Params) -> str:
    """Where the outputs are, and the promoted plan (printed at the end of the flow)."""
    from exitplan.summary import outputs

    return outputs(params)


@task(name="dvc-push", retries=2, retry_delay_seconds=10)
def push_outputs(root: Path) -> str:
    """``dvc push`` of every pipeline output to the default remote (a network remote may drop a connection)."""
    return push(root)
