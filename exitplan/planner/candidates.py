"""Deployment candidates of one model: replicas on one GPU type (Pareto-skimmed), and mixed GPU types (knapsack).

A *group* is ``dp`` replicas of one layout (GPU type, TP, PP) from the perf DB. Per GPU type, groups are enumerated
over layouts and DP and skimmed to the Pareto front of (latency at the model's load, $/h). A *candidate* is a set of
groups on different GPU types (at most one per type: a multiple-choice knapsack), chosen for each budget of a grid to
carry the most load within a latency target, under the budget and the GPUs available of each type. The latency of a
candidate at a load is that of the best load split over all its replicas (the simulator's search).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from exitplan.simulator.curve import INF, LatencyCurve, best_split

T = TypeVar("T")
"""What a skimmed point carries."""


@dataclass(frozen=True)
class Group:
    """``dp`` replicas of one layout of a model.

    Attributes:
        gpu: GPU type.
        tp: Tensor-parallel degree.
        pp: Pipeline-parallel degree.
        dp: Replicas.
        layers: Layers held by each replica.
        price_per_gpu: US$/h per GPU.
    """

    gpu: str
    tp: int
    pp: int
    dp: int
    layers: int
    price_per_gpu: float

    @property
    def gpus(self) -> int:
        """GPUs used."""
        return self.tp * self.pp * self.dp

    @property
    def cost(self) -> float:
        """US$/h."""
        return self.gpus * self.price_per_gpu


@dataclass(frozen=True)
class Candidate:
    """A deployment of one model: groups on distinct GPU types."""

    groups: tuple[Group, ...]

    @property
    def cost(self) -> float:
        """US$/h."""
        return sum(g.cost for g in self.groups)

    def gpus(self, gpu: str) -> int:
        """GPUs of type ``gpu`` used."""
        return sum(g.gpus for g in self.groups if g.gpu == gpu)

    def replica_curves(self, curves: Mapping[tuple, LatencyCurve]) -> list[LatencyCurve]:
        """One latency curve per replica."""
        return [curves[(g.gpu, g.tp, g.pp, g.layers)] for g in self.groups for _ in range(g.dp)]

    def latency(self, load: float, curves: Mapping[tuple, LatencyCurve]) -> float:
        """Largest replica latency under the best split of ``load`` (0 load: 0; inf when it cannot carry it)."""
        if load <= 0:
            return 0.0
        if not self.groups:
            return INF
        return best_split(load, self.replica_curves(curves))[1]


def skim(points: Sequence[tuple[float, float, T]]) -> list[tuple[float, float, T]]:
    """The Pareto front of ``(latency, cost, item)`` points (both minimised), by increasing cost."""
    front: list[tuple[float, float, T]] = []
    best = INF
    for latency, cost, item in sorted(points, key=lambda p: (p[1], p[0])):
        if latency < best:
            front.append((latency, cost, item))
            best = latency
    return front


def groups_per_gpu(curves: Mapping[tuple, LatencyCurve], prices: Mapping[str, float], load: float,
                   available: Mapping[str, int]) -> dict[str, list[Group]]:
    """Per GPU type, the Pareto-skimmed groups (latency at ``load`` split evenly over replicas vs $/h)."""
    out: dict[str, list[Group]] = {}
    for gpu in prices:
        points = []
        for (g, tp, pp, layers), curve in curves.items():
            if g != gpu or curve.capacity <= 0:
                continue
            for dp in range(1, available.get(gpu, 0) // (tp * pp) + 1):
                group = Group(gpu, tp, pp, dp, layers, prices[gpu])
                points.append((float(curve(load / dp)), group.cost, group))
        out[gpu] = [p[2] for p in skim(points)]
    return out


def knapsack(options: Mapping[str, list[Group]], value: Mapping[Group, float], budget: float,
             step: float = 0.01) -> tuple[Group, ...]:
    """Multiple-choice knapsack: at most one group per GPU type, total cost within ``budget``, most total value.

    Costs are discretised to ``step`` dollars, rounded up, so the chosen groups never exceed the budget.
    """
    cells = int(np.floor(budget / step + 1e-9))
    best = np.zeros(cells + 1)  # best[c]: most value with cost at most c cells
    takes = []  # per GPU type: the group index taken at each cell (-1: none)
    types = list(options)
    for gpu in types:
        new, take = best.copy(), np.full(cells + 1, -1)
        for index, group in enumerate(options[gpu]):
            weight = int(np.ceil(group.cost / step - 1e-9))
            if weight > cells:
                continue
            shifted = best[: cells + 1 - weight] + value[group]
            better = shifted > new[weight:]
            new[weight:] = np.where(better, shifted, new[weight:])
            take[weight:] = np.where(better, index, take[weight:])
        best = new
        takes.append(take)
    chosen, cell = [], int(np.argmax(best))
    for gpu, take in zip(reversed(types), reversed(takes), strict=True):
        if take[cell] >= 0:
            group = options[gpu][take[cell]]
            chosen.append(group)
            cell -= int(np.ceil(group.cost / step - 1e-9))
    return tuple(reversed(chosen))


def mixed_candidates(curves: Mapping[tuple, LatencyCurve], prices: Mapping[str, float], load: float,
                     available: Mapping[str, int], budgets: Sequence[float], target: float,
                     shares: Sequence[float] = (1.0,)) -> list[Candidate]:
    """Candidates for every share of ``load`` the model may be routed: per share, one per budget of the grid (the
    groups that carry the most load within ``target`` latency; value of a group = its replicas' summed capacity at
    ``target``) and the single groups, Pareto-skimmed on (latency at that load, $/h); the union over the shares.

    A model serves only its routed share of the load, so a layout too small for the whole load (one H100 for half
    of it, say) can be the best deployment of that share; skimming at the whole load alone would drop it.
    """
    kept: dict[tuple[Group, ...], Candidate] = {}
    for share in shares:
        at = share * load
        options = groups_per_gpu(curves, prices, at, available)
        value = {g: g.dp * curves[(g.gpu, g.tp, g.pp, g.layers)].max_load(target)
                 for gs in options.values() for g in gs}
        found = [Candidate(chosen) for chosen in (knapsack(options, value, b) for b in budgets) if chosen]
        singles = [Candidate((g,)) for gs in options.values() for g in gs]
        for _, _, cand in skim([(c.latency(at, curves), c.cost, c) for c in [*found, *singles]]):
            kept.setdefault(cand.groups, cand)
    return list(kept.values())
