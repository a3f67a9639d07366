"""Replicas that share one host: each neighbour busy beside a replica slows its steps by the device's
``neighbour_slowdown`` (``c``).

Mean field: replica ``r``'s steps take ``s_r = 1 + c * sum_{j != r} u_j`` times as long, ``u_j`` being the share of
the time neighbour ``j`` is busy. A replica whose every step takes ``s`` times as long, serving arrivals ``a``, runs
exactly as the replica at full speed serving ``a / s``, its clock stretched by ``s``: so a slowed replica is simulated
(or looked up in the perf DB) at ``s`` times its load, and its latencies are ``s`` times those found there; its busy
share is the same either way. The busy shares depend on the slowdowns (a slowed replica is busy longer), so the two
are iterated to a fixed point, half a step at a time. A device whose replicas do not share a host (every catalog
GPU) has ``c = 0``, and nothing here changes its figures.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from exitplan.simulator.curve import LatencyCurve
from exitplan.simulator.replica import ReplicaResult, ReplicaSimulator, RequestSet

ROUNDS = 30
"""Most fixed-point rounds (the slowdowns settle in a handful at the slowdowns measured here)."""

TOLERANCE = 1e-4
"""The fixed point is reached when no slowdown moves by more than this in a round."""


def slowdowns(busy: Sequence[float] | np.ndarray,
              neighbour_slowdown: Sequence[float] | np.ndarray | float) -> np.ndarray:
    """Each replica's step-time multiplier, ``1 + c_r * (sum of the others' busy shares)``.

    Args:
        busy: Share of the time each replica of one host is busy (0 to 1).
        neighbour_slowdown: ``c`` of the device, one for all or one per replica.
    """
    u = np.clip(np.asarray(busy, float), 0.0, 1.0)
    return 1.0 + np.asarray(neighbour_slowdown, float) * (u.sum() - u)


def fixed_point(update: Callable[[np.ndarray], np.ndarray], count: int) -> np.ndarray:
    """The slowdowns ``s`` with ``s = update(s)`` (``update``: the slowdowns the busy shares under ``s`` give), from
    ``s = 1``, damped by half a step a round."""
    s = np.ones(count)
    for _ in range(ROUNDS):
        new = 0.5 * (s + update(s))
        if np.max(np.abs(new - s)) <= TOLERANCE:
            return new
        s = new
    return s


def run_slowed(sim: ReplicaSimulator, requests: RequestSet, slowdown: float) -> ReplicaResult:
    """``sim`` serving ``requests`` with every step ``slowdown`` times as long (the time-rescaled run)."""
    if slowdown == 1.0:
        return sim.run(requests)
    fast = sim.run(RequestSet(requests.arrival_s / slowdown, requests.prompt_len, requests.output_len))
    return replace(fast, requests=requests, first_token_s=fast.first_token_s * slowdown,
                   finish_s=fast.finish_s * slowdown, scheduled_s=fast.scheduled_s * slowdown,
                   busy_s=fast.busy_s * slowdown)


def simulate_colocated(sims: Sequence[ReplicaSimulator], requests: Sequence[RequestSet],
                       neighbour_slowdown: float) -> tuple[list[ReplicaResult], np.ndarray]:
    """Replicas of one host, each serving its own requests, slowed by their neighbours' busy shares over the whole
    run (first arrival to last finish of any).

    Returns:
        Each replica's result and its slowdown.
    """
    start = min(float(r.arrival_s[0]) for r in requests)

    def runs(s: np.ndarray) -> list[ReplicaResult]:
        return [run_slowed(sim, r, float(x)) for sim, r, x in zip(sims, requests, s, strict=True)]

    def busy_of(s: np.ndarray) -> np.ndarray:
        results = runs(s)
        end = max(float(np.nanmax(res.finish_s)) for res in results)
        return np.asarray([res.busy_s / max(end - start, 1e-12) for res in results])

    s = np.ones(len(sims))
    if neighbour_slowdown > 0 and len(sims) >= 2:
        s = fixed_point(lambda x: slowdowns(busy_of(x), neighbour_slowdown), len(sims))
    return runs(s), s


def slowed_curve(curve: LatencyCurve, slowdown: float) -> LatencyCurve:
    """The latency curve of the deployment with every step ``slowdown`` times as long: at load ``q`` it reads the
    curve at ``slowdown * q``, times ``slowdown``."""
    if slowdown == 1.0:
        return curve
    return LatencyCurve(curve.qps / slowdown, curve.latency * slowdown, curve.capacity / slowdown,
                        curve.busy)
