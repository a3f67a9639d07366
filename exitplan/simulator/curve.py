"""Latency as a function of load, interpolated monotonically between the perf DB's grid points."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from exitplan.errors import SimulationError

INF = float("inf")


@dataclass(frozen=True)
class LatencyCurve:
    """Latency vs offered load of one deployment, up to its capacity.

    Values are made non-decreasing (a running maximum removes simulation noise) and interpolated linearly, so
    the curve is monotone between grid points; below the first grid point it is flat, above ``capacity`` it is
    infinite (the deployment is saturated).

    Attributes:
        qps: Grid loads, increasing; shape ``k``.
        latency: Latency at each grid load; shape ``k``.
        capacity: Highest load the deployment sustains (the last unsaturated grid point).
        busy: Share of the time the replica is in iterations at each grid load (none: not recorded).
        batch: Mean running batch while busy at each grid load (none: not recorded).
    """

    qps: np.ndarray
    latency: np.ndarray
    capacity: float
    busy: np.ndarray | None = None
    batch: np.ndarray | None = None

    @classmethod
    def from_points(cls, qps: np.ndarray, latency: np.ndarray, saturated: np.ndarray | None = None,
                    busy: np.ndarray | None = None, batch: np.ndarray | None = None) -> LatencyCurve:
        """Build from grid points; the curve ends before the first saturated (or non-finite) point."""
        order = np.argsort(qps)
        qps, latency = np.asarray(qps, float)[order], np.asarray(latency, float)[order]
        bad = ~np.isfinite(latency)
        if saturated is not None:
            bad |= np.asarray(saturated, bool)[order]
        stop = int(np.argmax(bad)) if bad.any() else len(qps)
        if busy is not None:
            busy = np.asarray(busy, float)[order][:stop]
            busy = None if not np.all(np.isfinite(busy)) else np.maximum.accumulate(np.clip(busy, 0.0, 1.0))
        if batch is not None:
            batch = np.asarray(batch, float)[order][:stop]
            batch = None if not np.all(np.isfinite(batch)) else np.maximum(batch, 1.0)
        if stop == 0:
            return cls(qps[:0], latency[:0], 0.0, busy, batch)
        kept_q, kept_l = qps[:stop], np.maximum.accumulate(latency[:stop])
        return cls(kept_q, kept_l, float(kept_q[-1]), busy, batch)

    def blend(self, other: LatencyCurve, weight: float) -> LatencyCurve:
        """``1 - weight`` of this curve and ``weight`` of ``other``, point by point on the grid loads both hold up to
        the smaller capacity (latency, busy share and batch alike; a field either lacks is dropped).

        Raises:
            SimulationError: when the two curves were not taken on the same grid of loads.
        """
        n = min(len(self.qps), len(other.qps))
        if not np.allclose(self.qps[:n], other.qps[:n]):
            raise SimulationError("cannot blend latency curves taken on different grids of loads")

        def mix(a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray | None:
            return None if a is None or b is None else (1 - weight) * a[:n] + weight * b[:n]

        latency = (1 - weight) * self.latency[:n] + weight * other.latency[:n]
        return LatencyCurve(self.qps[:n], latency, float(self.qps[n - 1]) if n else 0.0,
                            mix(self.busy, other.busy), mix(self.batch, other.batch))

    def busy_at(self, load: float) -> float:
        """Share of the time the replica is busy at ``load``: linear from 0 at no load to the first grid point, then
        interpolated; 1 beyond capacity, and 1 everywhere when the busy shares were not recorded (a neighbour taken
        as always busy: the cautious reading)."""
        if self.busy is None or self.capacity <= 0 or load > self.capacity * (1 + 1e-9):
            return 1.0 if load > 0 else 0.0
        return float(np.interp(load, np.concatenate([[0.0], self.qps]), np.concatenate([[0.0], self.busy])))

    def batch_at(self, load: float) -> float | None:
        """Mean running batch while busy at ``load``: interpolated, the first grid point's below it and the last's
        beyond capacity; ``None`` when not recorded."""
        if self.batch is None or not len(self.batch):
            return None
        return float(np.interp(load, self.qps, self.batch))

    def __call__(self, load: float | np.ndarray) -> np.ndarray:
        """Latency at ``load`` (inf beyond capacity)."""
        load = np.asarray(load, float)
        if self.capacity <= 0:
            return np.full(load.shape, INF)
        value = np.interp(load, self.qps, self.latency)
        return np.where(load > self.capacity * (1 + 1e-9), INF, value)

    def max_load(self, latency: float) -> float:
        """Highest load whose latency stays within ``latency`` (0 if even the lightest load exceeds it)."""
        if self.capacity <= 0 or latency < self.latency[0]:
            return 0.0
        if latency >= self.latency[-1]:
            return self.capacity
        # first grid index whose latency exceeds the bound; interpolate inside that segment
        j = int(np.searchsorted(self.latency, latency, side="right"))
        l0, l1, q0, q1 = self.latency[j - 1], self.latency[j], self.qps[j - 1], self.qps[j]
        return float(q0 + (q1 - q0) * (latency - l0) / (l1 - l0)) if l1 > l0 else float(q1)


def best_split(total_qps: float, curves: list[LatencyCurve], tolerance: float = 1e-6) -> tuple[np.ndarray, float]:
    """The load split over replicas that minimises the largest replica latency (BOUTE section 5.1).

    Bisects on the latency bound T: each replica takes the most load it can within T, and the smallest T whose
    loads add up to ``total_qps`` wins. Every evaluation is a curve look-up, so this is cheap.

    Returns:
        ``(loads, latency)``: load per replica (summing to ``total_qps``) and the largest replica latency; the
        latency is inf when the replicas together cannot carry the load (loads then follow capacities).

    Raises:
        SimulationError: for a non-positive load or no replicas.
    """
    if total_qps <= 0 or not curves:
        raise SimulationError("best_split needs a positive load and at least one replica")
    capacities = np.asarray([c.capacity for c in curves])
    if capacities.sum() < total_qps:
        share = capacities / capacities.sum() if capacities.sum() > 0 else np.full(len(curves), 1 / len(curves))
        return share * total_qps, INF
    lo = min(float(c.latency[0]) for c in curves if c.capacity > 0)
    hi = max(float(c.latency[-1]) for c in curves if c.capacity > 0)
    for _ in range(200):
        if hi - lo <= tolerance * max(hi, 1e-12):
            break
        mid = 0.5 * (lo + hi)
        if sum(c.max_load(mid) for c in curves) >= total_qps:
            hi = mid
        else:
            lo = mid
    loads = np.asarray([c.max_load(hi) for c in curves])
    loads *= total_qps / loads.sum()
    return loads, float(max(c(q) for c, q in zip(curves, loads, strict=True) if q > 0))
