"""Flow ``deploy_fleet``: the champion plan -> vLLM launch files for GPU hosts -> a local fleet, smoke-tested.

On this machine it starts our engine servers for the plan models that run here and the coordinator on loopback,
waits for health and sends a smoke request through the coordinator; ``keep_running`` leaves the fleet up (Ctrl-C
stops it, draining in-flight requests). By hand: ``exitplan deploy`` or ``python -m flows.deploy_fleet``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from tasks.deploy import render_deployment, serve_local_fleet
from tasks.pipeline import check_config


@flow(name="deploy_fleet", log_prints=True)
def deploy_fleet(params_path: str = "params.yaml", serve: bool = True, keep_running: bool = False) -> dict[str, Any]:
    """Render the champion's launch files; start, health-check and smoke-test a local fleet."""
    params = check_config(Path(params_path))
    rendered = render_deployment(params)
    logger = get_run_logger()
    for replica in rendered.replicas:
        logger.info("%s on %s GPUs %s: %s", replica.model, replica.host, replica.devices, " ".join(replica.args))
    result: dict[str, Any] = {"version": rendered.version, "files": [str(f) for f in rendered.files],
                              "replicas": len(rendered.replicas)}
    print(f"champion v{rendered.version}: {len(rendered.replicas)} vLLM replicas rendered into "
          f"{params.path(params.deploy.output_dir)}")
    if serve:
        result.update(serve_local_fleet(params, rendered, keep_running))
    return result


if __name__ == "__main__":
    deploy_fleet(keep_running="--keep" in sys.argv)
