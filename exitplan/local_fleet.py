"""A local fleet for the length of one session: start it, smoke-test it through the coordinator, keep it up while
asked (Ctrl-C ends that), stop it. ``exitplan deploy`` and the ``deploy_fleet`` flow both run this one sequence."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from exitplan.config import Params
from exitplan.deploy import LocalFleet, Rendered, smoke, start_local


def serve(params: Params, rendered: Rendered, keep: bool = False,
          on_ready: Callable[[LocalFleet, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Start the local replicas of ``rendered``'s plan and the coordinator, send the smoke request through it (the
    API key from ``deploy.api_key_env``), call ``on_ready(fleet, answer)``, wait while ``keep`` (until Ctrl-C), and
    stop everything, whatever happened.

    Returns:
        ``coordinator`` (its URL), ``local_replicas`` (model -> URLs) and ``smoke`` (the answer, the model that
        served it, the seconds).

    Raises:
        ExitplanError: when no plan model runs here, a server does not come up, or the smoke request fails (the
            fleet is stopped first).
    """
    fleet = start_local(params, rendered.plan, rendered.router, params.path(params.deploy.output_dir))
    try:
        answer = smoke(fleet.coordinator_url, params.deploy.fleet_name, os.environ.get(params.deploy.api_key_env))
        if on_ready is not None:
            on_ready(fleet, answer)
        try:
            while keep:
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    finally:
        fleet.stop()
    return {"coordinator": fleet.coordinator_url, "local_replicas": fleet.replica_urls, "smoke": answer}
