"""The coordinator process: ``python -m serving.coordinator_server --fleet fleet.json --port 8000``.

``fleet.json`` is written by ``exitplan deploy``: the plan's models and fractions, the replicas with their weights,
the routing model (``router.json``) and the embedder's checkpoint. Requests to the coordinator carry the replicas'
API key onward when one is set.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def build(fleet: dict[str, Any], api_key: str | None = None) -> Any:
    """The coordinator app for a fleet description."""
    from exitplan.errors import ExitplanError
    from serving.coordinator import Coordinator, Replica, ReplicaSet, ThresholdRouter, create_coordinator_app
    from exitplan.routing.router_file import load_router
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
    coordinator = Coordinator(fleet["models"], router, sets, scorer, fleet["fleet_name"], fleet["max_in_flight"],
                              fleet["request_timeout_s"], fleet["cooldown_s"])
    if api_key:
        coordinator.client.headers["authorization"] = f"Bearer {api_key}"
    return create_coordinator_app(coordinator, api_key)


def main() -> None:
    """Parse arguments, build the app, serve it."""
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fleet", type=Path, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args()
    app = build(json.loads(args.fleet.read_text()), args.api_key)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=30)


if __name__ == "__main__":
    main()
