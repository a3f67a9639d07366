"""The coordinator process: ``python -m serving.coordinator_server --fleet fleet.json --port 8000``.

``fleet.json`` is written by ``exitplan deploy``: the plan's models and fractions, the replicas with their weights,
the routing model (``router.json``) and the embedder's checkpoint. The API key (from ``$EXITPLAN_API_KEY``, the
variable ``--api-key-env`` names, or ``--api-key-file``; never argv) guards the coordinator's routes and is sent
on to the replicas. SIGTERM drains (:mod:`serving.lifecycle`). A missing or corrupt fleet file, router or key file
is one line naming it and exit 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def build(fleet: dict[str, Any], api_key: str | None = None) -> Any:
    """The coordinator app for a fleet description."""
    from exitplan.errors import ExitplanError
    from exitplan.routing.router_file import load_router
    from serving.coordinator import Coordinator, Replica, ReplicaSet, ThresholdRouter, create_coordinator_app
    from serving.scorer import BatchingScorer, score_function

    if not fleet.get("router") or not Path(fleet["router"]).is_file():
        raise ExitplanError(f"the fleet has no routing model ({fleet.get('router')}): re-run the plan stage")
    routing = load_router(Path(fleet["router"]).read_bytes(), fleet["router"])
    if [m for m in routing.models if m in fleet["models"]] != fleet["models"]:
        raise ExitplanError(f"the routing model orders {routing.models}; the fleet has {fleet['models']}")
    sets = {}
    for model in fleet["models"]:
        mine = [Replica(model, r["url"], r["weight"]) for r in fleet["replicas"] if r["model"] == model]
        if not mine:
            raise ExitplanError(f"no replica serves {model}")
        sets[model] = ReplicaSet(mine)
    router = ThresholdRouter(fleet["fractions"], routing.window, fleet.get("routing_window", 512))
    scorer = BatchingScorer(score_function(routing, Path(fleet["embedder"])))
    # knobs an older fleet file lacks keep the coordinator's own defaults
    knobs = {k: fleet[k] for k in ("max_attempts", "failure_threshold", "health_interval_s") if k in fleet}
    coordinator = Coordinator(fleet["models"], router, sets, scorer, fleet["fleet_name"], fleet["max_in_flight"],
                              fleet["request_timeout_s"], fleet["cooldown_s"], api_key=api_key, **knobs)
    return create_coordinator_app(coordinator, api_key,
                                  **{k: fleet[k] for k in ("drain_s", "max_body_bytes") if k in fleet})


def read_fleet(path: Path) -> dict[str, Any]:
    """The fleet file ``exitplan deploy`` wrote.

    Raises:
        ExitplanError: naming the file when it is missing, unreadable, not JSON or lacks a key.
    """
    from exitplan.errors import ExitplanError
    from exitplan.files import read_json

    fleet = read_json(path, "fleet file", hint="run `exitplan deploy`")
    needed = ("models", "fractions", "replicas", "router", "embedder", "fleet_name", "max_in_flight",
              "request_timeout_s", "cooldown_s")
    missing = [k for k in needed if not isinstance(fleet, dict) or k not in fleet]
    if missing:
        raise ExitplanError(f"fleet file {path} lacks {missing}; run `exitplan deploy`")
    return fleet


def main() -> None:
    """Parse arguments, build the app, serve it until SIGTERM (draining first)."""
    from exitplan.config import DeployParams
    from exitplan.errors import ExitplanError
    from serving.guard import read_api_key
    from serving.lifecycle import serve_forever
    from serving.process import PORT, arguments, fail

    defaults = DeployParams()  # the deploy section's defaults: one declaration of each knob
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fleet", type=Path, required=True)
    parser.add_argument("--host", default=defaults.host, help="Address (default: deploy.host's default).")
    parser.add_argument("--port", type=PORT, default=defaults.coordinator_port,
                        help="Port (default: deploy.coordinator_port's default).")
    parser.add_argument("--api-key-env", default=defaults.api_key_env, help="Variable holding the API key.")
    parser.add_argument("--api-key-file", type=Path, default=None, help="File holding the API key.")
    args = arguments(parser)
    try:
        app = build(read_fleet(args.fleet), read_api_key(args.api_key_env, args.api_key_file))
    except (ExitplanError, KeyError, TypeError, ValueError) as exc:
        fail(exc if isinstance(exc, ExitplanError) else ExitplanError(f"fleet file {args.fleet}: {exc!r}"))
    serve_forever(app, app.state.drain, args.host, args.port)


if __name__ == "__main__":
    main()
