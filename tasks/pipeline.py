"""Tasks that run DVC stages and check the config."""

from __future__ import annotations

from pathlib import Path

from prefect import task

from exitplan.config import Params, load_params
from exitplan.pipeline import ReproResult, push, repro, stage_names


@task(name="check-config")
def check_config(params_path: Path) -> Params:
    """Validate params.yaml (and the models it names against the catalog) before any stage runs."""
    return load_params(params_path)


@task(name="list-stages")
def list_stages(root: Path) -> list[str]:
    """The stages of dvc.yaml, in its order (the flow runs each through ``dvc repro``)."""
    return stage_names(root)


@task(name="dvc-repro")
def repro_stage(target: str, root: Path) -> ReproResult:
    """``dvc repro <target>``: runs the stage only if DVC finds it stale. No retries: a stage that failed fails the
    same way again (and a concurrent run of the checkout waits on its lock instead of failing)."""
    return repro(target, root)


@task(name="summarize")
def summarize(params: Params) -> str:
    """Where the outputs are, and the promoted plan (printed at the end of the flow)."""
    from exitplan.summary import outputs

    return outputs(params)


@task(name="dvc-push", retries=2, retry_delay_seconds=10)
def push_outputs(root: Path) -> str:
    """``dvc push`` of every pipeline output to the default remote (a network remote may drop a connection)."""
    return push(root)
