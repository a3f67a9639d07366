"""The checkout a deployed flow runs in: the pull step of prefect.yaml enters it, or says why it cannot.

A worker runs each flow run in a temporary folder unless told otherwise; exitplan's flows need the DVC repository
(dvc.yaml, params.yaml, the cache), so the deployments pass the checkout as ``EXITPLAN_ROOT`` and this step changes
into it. Prefect calls it by its dotted name before it loads the flow; it does not import Prefect.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from exitplan.errors import PipelineError

ROOT_ENV = "EXITPLAN_ROOT"
"""The environment variable (a job variable of the deployments) that names the checkout."""

RUN_ID_ENV = "PREFECT__FLOW_RUN_ID"
"""Where a Prefect worker puts the id of the flow run it started."""

MARKERS = ("dvc.yaml", "params.yaml", "flows")
"""What a checkout holds: without them a flow run cannot do anything."""


def check_checkout(directory: str | None) -> Path:
    """The checkout ``directory`` (else ``$EXITPLAN_ROOT``), checked.

    Raises:
        PipelineError: naming the variable when it is unset, or the folder and what it lacks.
    """
    chosen = (directory or "").strip() or os.environ.get(ROOT_ENV, "").strip()
    if not chosen:
        raise PipelineError(f"{ROOT_ENV} is not set, so the worker does not know which exitplan checkout to run "
                            f"in: deploy with `exitplan infra deploy` (or set {ROOT_ENV} to the checkout before "
                            f"`prefect deploy --all`), or give the worker {ROOT_ENV}")
    root = Path(chosen).expanduser()
    if not root.is_dir():
        raise PipelineError(f"{ROOT_ENV}={chosen} is not a folder on this machine: point it at an exitplan "
                            f"checkout (the folder with dvc.yaml and params.yaml)")
    missing = [m for m in MARKERS if not (root / m).exists()]
    if missing:
        raise PipelineError(f"{ROOT_ENV}={chosen} is not an exitplan checkout: it has no {', '.join(missing)}")
    return root.resolve()


def enter_checkout(directory: str | None = None) -> dict[str, str]:
    """Prefect pull step: change into the checkout (:func:`check_checkout`) and export it as ``EXITPLAN_ROOT``.

    Returns:
        ``{"directory": <the checkout>}`` (later steps may refer to it).
    """
    try:
        root = check_checkout(directory)
    except PipelineError as err:
        # Prefect reports a failed pull step only as a crash; this line reaches the flow run's own logs (its id is
        # in the worker-given environment), so the user reads what to fix where the run failed.
        logging.getLogger("prefect.flow_runs").error(str(err), extra={"flow_run_id": os.environ.get(RUN_ID_ENV)})
        raise
    os.chdir(root)
    os.environ[ROOT_ENV] = str(root)
    return {"directory": str(root)}
