"""Replicas that share one host: each neighbour busy beside a replica slows its steps by its model's neighbour
slowdown on the device (``c_rj``: its ``slowdown_grids`` entry at the two replicas' mean batches, else its
``model_slowdowns`` figure, else the device's ``neighbour_slowdown``), and where the replicas fill the host's cores
(``host_slots`` of them), the fleet's coordinator takes its CPU from theirs while they are all busy.

Mean field: replica ``r``'s steps take ``s_r = (1 + sum_{j != r} c_rj u_j) / (1 - t_r)`` times as long, ``u_j`` being
the share of the time replica ``j`` is busy and ``t_r`` the share of ``r``'s busy time the coordinator takes
(:func:`stolen_shares`: its relaying of ``j``'s tokens finds no idle core when every other replica is busy too,
probability ``prod_{k != j} u_k``; its scoring of a prompt when all are, ``prod_k u_k``; what it takes is spread
evenly over the busy cores). A replica whose every step takes ``s`` times as long, serving arrivals ``a``, runs
exactly as the replica at full speed serving ``a / s``, its clock stretched by ``s``: so a slowed replica is simulated
(or looked up in the perf DB) at ``s`` times its load, and its latencies are ``s`` times those found there; its busy
share is the same either way (and so is its mean batch while busy). The busy shares and batches depend on the
slowdowns (a slowed replica is busy longer), so the two are iterated to a fixed point, half a step at a time. A
device whose replicas do not share a host (every catalog GPU) has ``c = 0``, and nothing here changes its figures.

A simulation of given requests may go on from there (``timed``): each replica run again with its steps slowed only
while each neighbour is busy (its iterations in the latest run of it, :class:`StepPace`), replica after replica until
the finish times settle - at light load the mean field gives every request ``c u``, where a request that overlaps a
neighbour's loses ``c`` and one that does not loses nothing (the 2026-12-07 fleet at 0.1 req/s: the 0.5B's requests
that overlapped a 1.5B request decoded at 1.23x the mean field's prediction, median, those that did not at 1.10x). On
three sweeps' requests it was no closer than the mean field, so it is a term the fleet check prints, not the default.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from exitplan.catalog import Gpu, SlowdownGrid
from exitplan.simulator.curve import LatencyCurve
from exitplan.simulator.replica import ReplicaResult, ReplicaSimulator, RequestSet

ROUNDS = 30
"""Most fixed-point rounds (the slowdowns settle in a handful at the slowdowns measured here)."""

TOLERANCE = 1e-4
"""The fixed point is reached when no slowdown moves by more than this in a round."""


TIMED_ROUNDS = 8
"""Most rounds of replicas slowed only while their neighbours are busy (:func:`timed_rounds`)."""

MAX_STOLEN = 0.9
"""Largest share of a replica's busy time the coordinator is taken to use (beyond it the host is overloaded and the
mean field means nothing)."""


@dataclass(frozen=True)
class HostSharing:
    """How the replicas of one device that share a host slow each other (the catalog entry's fields).

    Attributes:
        neighbour_slowdown: ``c``: step-time share lost per busy neighbour.
        host_slots: Replicas that fill the host's cores (0: the coordinator has CPUs of its own).
        relay_cpu_s: Coordinator CPU seconds per streamed token.
        score_cpu_s: Coordinator CPU seconds per routed request.
        model_slowdowns: ``(model, c)`` of the models measured apart (others take ``neighbour_slowdown``).
        grids: ``(model, grid)`` of the models measured by batch (their ``c`` at the replicas' mean batches).
    """

    neighbour_slowdown: float = 0.0
    host_slots: int = 0
    relay_cpu_s: float = 0.0
    score_cpu_s: float = 0.0
    model_slowdowns: tuple[tuple[str, float], ...] = ()
    grids: tuple[tuple[str, SlowdownGrid], ...] = ()

    @classmethod
    def of(cls, gpu: Gpu) -> HostSharing:
        """The device's sharing as the catalog entry records it."""
        return cls(gpu.neighbour_slowdown, gpu.host_slots, gpu.relay_cpu_s, gpu.score_cpu_s,
                   tuple(sorted(gpu.model_slowdowns.items())), tuple(sorted(gpu.slowdown_grids.items())))

    def slowdown_of(self, models: Sequence[str | None]) -> np.ndarray:
        """``c`` of each replica, by its model (``None``: not known, the device's figure); a grid's mean."""
        own: dict[str | None, float] = {**dict(self.model_slowdowns), **{m: g.mean for m, g in self.grids}}
        return np.asarray([own.get(m, self.neighbour_slowdown) for m in models], float)

    def pairwise(self, models: Sequence[str | None], batches: Sequence[float] | np.ndarray | None) -> np.ndarray:
        """``c_rj`` of every pair of replicas (row ``r`` slowed by busy ``j``; 0 on the diagonal): a model with a
        grid reads it at the two mean batches while busy (``batches``; none known: its mean), the others their
        :meth:`slowdown_of` figure."""
        flat = self.slowdown_of(models)
        table = np.repeat(flat[:, None], len(flat), axis=1)
        grids = dict(self.grids)
        for r, model in enumerate(models):
            grid = grids.get(model) if model is not None else None
            if grid is not None and batches is not None:
                table[r] = [grid.at(batches[r], b) for b in batches]
        np.fill_diagonal(table, 0.0)
        return table

    @property
    def shared(self) -> bool:
        """Whether replicas of this device can slow each other at all (at two replicas, or as many as fill the
        host)."""
        return self.slows(max(2, self.host_slots))

    def slows(self, replicas: int) -> bool:
        """Whether ``replicas`` of this device on one host slow one another (neighbours, or the coordinator)."""
        neighbours = (self.neighbour_slowdown > 0 or any(c > 0 for _, c in self.model_slowdowns)
                      or any(g.mean > 0 for _, g in self.grids))
        return (neighbours and replicas >= 2) or (
            self.fills(replicas) and self.relay_cpu_s + self.score_cpu_s > 0)

    def fills(self, replicas: int) -> bool:
        """Whether ``replicas`` of this device on one host leave the coordinator no core of its own."""
        return self.host_slots > 0 and replicas >= self.host_slots


def stolen_shares(busy: Sequence[float] | np.ndarray, token_rate: Sequence[float] | np.ndarray, request_rate: float,
                  sharing: HostSharing) -> np.ndarray:
    """Share of each replica's busy time the coordinator takes (none unless the replicas fill the host).

    Args:
        busy: Share of the time each replica of one host is busy (0 to 1).
        token_rate: Tokens each replica streams per second of the whole span (the coordinator relays each).
        request_rate: Requests the coordinator routes per second (all replicas').
        sharing: The device's coordinator costs and slots.
    """
    u = np.clip(np.asarray(busy, float), 0.0, 1.0)
    if not sharing.fills(len(u)):
        return np.zeros(len(u))
    others = np.asarray([np.prod(np.delete(u, i)) for i in range(len(u))])
    taken = (sharing.relay_cpu_s * float(np.sum(np.asarray(token_rate, float) * others))
             + sharing.score_cpu_s * request_rate * float(np.prod(u))) / len(u)
    return np.minimum(taken / np.maximum(u, 1e-9), MAX_STOLEN)


def slowdowns(busy: Sequence[float] | np.ndarray, neighbour_slowdown: Sequence[float] | np.ndarray | float,
              stolen: Sequence[float] | np.ndarray | float = 0.0) -> np.ndarray:
    """Each replica's step-time multiplier, ``(1 + sum_{j != r} c_rj u_j) / (1 - t_r)``.

    Args:
        busy: Share of the time each replica of one host is busy (0 to 1).
        neighbour_slowdown: ``c`` of the device: one for all, one per replica (``c_r``), or a matrix ``c_rj``
            (:meth:`HostSharing.pairwise`; its diagonal is ignored).
        stolen: ``t_r``: share of each replica's busy time the coordinator takes (:func:`stolen_shares`).
    """
    u = np.clip(np.asarray(busy, float), 0.0, 1.0)
    c = np.asarray(neighbour_slowdown, float)
    lost = (c - np.diag(np.diag(c))) @ u if c.ndim == 2 else c * (u.sum() - u)
    return (1.0 + lost) / (1.0 - np.asarray(stolen, float))


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
                   busy_s=fast.busy_s * slowdown, busy_intervals=fast.busy_intervals * slowdown)


@dataclass(frozen=True)
class StepPace:
    """A replica's step-time multiplier over time, ``base (1 + sum_j c_j)`` over the neighbours ``j`` busy at that
    time (a :class:`~exitplan.simulator.replica.Pace`).

    Attributes:
        edges: The times the multiplier changes, increasing.
        values: The multiplier before ``edges[0]``, then after each edge (one more than ``edges``).
    """

    edges: np.ndarray
    values: np.ndarray

    @classmethod
    def of(cls, base: float, neighbours: Sequence[tuple[float, np.ndarray]]) -> StepPace:
        """The pace of a replica whose steps take ``base`` times as long always, and ``c`` more of that while each
        neighbour is busy (``(c, busy intervals k x 2)`` per neighbour)."""
        times = np.concatenate([np.zeros(0), *(iv.reshape(-1, 2).T.ravel() for _, iv in neighbours)])
        deltas = np.concatenate([np.zeros(0), *(np.repeat([c, -c], len(iv.reshape(-1, 2))) for c, iv in neighbours)])
        edges, counts = np.unique(times, return_counts=True)  # sorted, as the events' cumulative sum below
        level = np.cumsum(deltas[np.argsort(times, kind="stable")])[np.cumsum(counts) - 1]
        return cls(edges, base * (1.0 + np.concatenate([[0.0], np.maximum(level, 0.0)])))

    def at(self, t: float) -> float:
        """The multiplier of an iteration that starts at ``t``."""
        return float(self.values[int(np.searchsorted(self.edges, t, side="right"))])

    def next_change(self, t: float) -> float:
        """The first edge after ``t`` (inf: none)."""
        i = int(np.searchsorted(self.edges, t, side="right"))
        return float(self.edges[i]) if i < len(self.edges) else float("inf")


def simulate_colocated(sims: Sequence[ReplicaSimulator], requests: Sequence[RequestSet], sharing: HostSharing,
                       models: Sequence[str | None] | None = None,
                       timed: bool = False) -> tuple[list[ReplicaResult], np.ndarray]:
    """Replicas of one host, each serving its own requests, slowed by their neighbours and the coordinator's work
    over the whole run (first arrival to last finish of any): the mean field.

    Args:
        sims: Each replica's simulator.
        requests: The requests each serves.
        sharing: How the device's replicas share the host.
        models: Each replica's model (its own neighbour slowdown); none: the device's for all.
        timed: Then run :func:`timed_rounds` from the mean field's ``c_rj`` and coordinator shares: each replica's
            steps slowed only while each neighbour is busy. Off by default: on three fleet sweeps' requests it
            was no closer (`docs/measurements.md`, 2026-12-07 fourteenth session), so the fleet check prints it as
            one of its terms.

    Returns:
        Each replica's result and its mean-field slowdown.
    """
    start = min(float(r.arrival_s[0]) for r in requests)
    request_count = sum(len(r.arrival_s) for r in requests)

    def runs(s: np.ndarray) -> list[ReplicaResult]:
        return [run_slowed(sim, r, float(x)) for sim, r, x in zip(sims, requests, s, strict=True)]

    def terms(results: list[ReplicaResult]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        span = max(max(float(np.nanmax(res.finish_s)) for res in results) - start, 1e-12)
        busy = np.asarray([res.busy_s / span for res in results])
        tokens = np.asarray([float(np.sum(res.requests.output_len[np.isfinite(res.finish_s)])) / span
                             for res in results])
        own = sharing.pairwise(names, [res.mean_batch for res in results])
        return busy, own, stolen_shares(busy, tokens, request_count / span, sharing)

    def update(s: np.ndarray) -> np.ndarray:
        return slowdowns(*terms(runs(s)))

    names = list(models) if models is not None else [None] * len(sims)
    if not sharing.slows(len(sims)):
        return runs(np.ones(len(sims))), np.ones(len(sims))
    s = fixed_point(update, len(sims))
    first = runs(s)
    if not timed:
        return first, s
    _, pairs, stolen = terms(first)
    return timed_rounds(sims, requests, pairs, 1.0 / (1.0 - stolen), first), s


def timed_rounds(sims: Sequence[ReplicaSimulator], requests: Sequence[RequestSet], pairs: np.ndarray,
                 base: np.ndarray, results: list[ReplicaResult]) -> list[ReplicaResult]:
    """Replicas run again, each slowed by ``pairs[r, j]`` only while neighbour ``j`` is busy (its intervals in the
    latest run of it) and by ``base[r]`` always, replica after replica, until no finish time moves by a millisecond
    (at most :data:`TIMED_ROUNDS` rounds)."""
    results = list(results)
    for _ in range(TIMED_ROUNDS):
        before = [res.finish_s for res in results]
        for r, (sim, load) in enumerate(zip(sims, requests, strict=True)):
            others = [(float(pairs[r, j]), results[j].busy_intervals) for j in range(len(sims)) if j != r]
            results[r] = sim.run(load, StepPace.of(float(base[r]), others))
        moved = max(float(np.nanmax(np.abs(res.finish_s - b), initial=0.0)) for res, b in zip(results, before,
                                                                                            strict=True))
        if moved < 1e-3:
            break
    return results


def slowed_curve(curve: LatencyCurve, slowdown: float) -> LatencyCurve:
    """The latency curve of the deployment with every step ``slowdown`` times as long: at load ``q`` it reads the
    curve at ``slowdown * q``, times ``slowdown``."""
    if slowdown == 1.0:
        return curve
    return LatencyCurve(curve.qps / slowdown, curve.latency * slowdown, curve.capacity / slowdown,
                        curve.busy, curve.batch)
