"""Tasks of deployment: render the champion; serve the local fleet (start, smoke-test, keep, stop)."""

from __future__ import annotations

from typing import Any

from prefect import task

from exitplan.config import Params
from exitplan.deploy import Rendered


@task(name="render-deployment")
def render_deployment(params: Params) -> Rendered:
    """The champion plan as vLLM launch files per GPU host, ``replicas.json`` and ``fleet.json``."""
    from exitplan.deploy import render_champion

    return render_champion(params)


@task(name="serve-local-fleet")
def serve_local_fleet(params: Params, rendered: Rendered, keep_running: bool = False) -> dict[str, Any]:
    """The plan models that run here and the coordinator: started, smoke-tested through the coordinator, kept up
    while ``keep_running`` (until Ctrl-C), stopped (:func:`exitplan.local_fleet.serve`)."""
    from exitplan.local_fleet import serve

    return serve(params, rendered, keep_running, lambda fleet, answer: print(
        f"local fleet at {fleet.coordinator_url} (replicas {fleet.replica_urls}); smoke request served by "
        f"{answer['served_by']} in {answer['seconds']:.2f} s: {answer['text']!r}"))
