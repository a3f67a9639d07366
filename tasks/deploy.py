"""Tasks of deployment: render the champion, start the local fleet, smoke-test it."""

from __future__ import annotations

from typing import Any

from prefect import task

from exitplan.config import Params
from exitplan.deploy import LocalFleet, Rendered


@task(name="render-deployment")
def render_deployment(params: Params) -> Rendered:
    """The champion plan as vLLM launch files per GPU host, ``replicas.json`` and ``fleet.json``."""
    from exitplan.deploy import render_champion

    return render_champion(params)


@task(name="start-local-fleet")
def start_local_fleet(params: Params, rendered: Rendered) -> LocalFleet:
    """Engine servers for the plan models that run here, and the coordinator, healthy."""
    from exitplan.deploy import start_local

    return start_local(params, rendered.plan, rendered.router, params.path(params.deploy.output_dir))


@task(name="smoke-request", retries=2, retry_delay_seconds=5)
def smoke_request(url: str, model: str, api_key: str | None) -> dict[str, Any]:
    """One completion through the coordinator."""
    from exitplan.deploy import smoke

    return smoke(url, model, api_key)
