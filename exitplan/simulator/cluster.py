"""Several replicas of one model (data parallelism): dispatch requests, simulate each replica, pool the results.

Replicas share nothing but the arrival stream, so each is simulated on the requests dispatched to it. Replicas may
differ (GPU type, TP, PP, held layers): BOUTE's heterogeneous deployments.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from exitplan.errors import SimulationError
from exitplan.simulator.replica import ReplicaResult, ReplicaSimulator, RequestSet


def dispatch(num_requests: int, num_replicas: int, weights: Sequence[float] | None = None) -> np.ndarray:
    """Replica index of each request, in arrival order; shape ``num_requests``.

    Without weights: round-robin (BOUTE's simulator). With weights: smooth weighted round-robin (nginx's
    algorithm), which interleaves replicas so that every prefix of the stream follows the weights closely.
    """
    if num_replicas < 1:
        raise SimulationError("need at least one replica")
    if weights is None:
        return np.arange(num_requests) % num_replicas
    w = np.asarray(weights, dtype=float)
    if len(w) != num_replicas or np.any(w < 0) or w.sum() <= 0:
        raise SimulationError(f"dispatch weights must be {num_replicas} non-negative numbers with a positive sum")
    w = w / w.sum()
    current = np.zeros(num_replicas)
    out = np.empty(num_requests, dtype=np.int64)
    for i in range(num_requests):
        current += w
        pick = int(np.argmax(current))
        current[pick] -= 1.0
        out[i] = pick
    return out


def simulate_cluster(requests: RequestSet, replicas: Sequence[ReplicaSimulator],
                     weights: Sequence[float] | None = None) -> list[ReplicaResult]:
    """Dispatch ``requests`` over ``replicas`` and simulate each; one result per replica that got requests."""
    assignment = dispatch(len(requests), len(replicas), weights)
    results = []
    for index, replica in enumerate(replicas):
        mine = np.flatnonzero(assignment == index)
        if len(mine):
            results.append(replica.run(requests.subset(mine)))
    return results
