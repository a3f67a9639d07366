"""The co-optimisation problem: routing fractions x a deployment candidate per model -> (latency, quality, cost).

A point ``theta`` in the unit cube has ``K - 1`` routing coordinates (stick-breaking into ``K`` load fractions,
smallest model first) and ``K`` deployment coordinates (each picks one of its model's candidates, ordered by cost).
When the problem plans depth (a model's candidates hold replicas of more than one layer count), ``K`` depth
coordinates follow, one ordinal per model (shallowest first): the depth picks the model's candidates of that layer
count and the deployment coordinate picks among them; quality is then Q(f, depths)
(:mod:`exitplan.planner.depth`).
Budget and GPU availability are hard constraints: :meth:`PlanProblem.repair` steps the dearest model down its
candidate list until the plan is feasible, so every evaluated plan is one that could be deployed. A model with no
load is not deployed (costs nothing). Evaluation is a perf-DB look-up: each model's latency at its share of the load
under the best split over its replicas (replicas that share a host slowed by their busy neighbours); the plan's
latency is the worst of the loaded models'; quality is the routing curve Q(f).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from exitplan.planner.candidates import Candidate
from exitplan.planner.routed import curves_at as routed_curves
from exitplan.simulator.colocation import HostSharing, fixed_point, slowdowns, slowed_curve, stolen_shares
from exitplan.simulator.curve import INF, LatencyCurve, best_split

MIN_SHARE = 1e-3
"""A model whose load fraction is below this is not deployed."""


@dataclass(frozen=True)
class Plan:
    """One evaluated plan.

    Attributes:
        fractions: Load fraction per model.
        choice: Candidate index per model.
        latency: Worst P95 latency (s) of the loaded models; inf if one cannot carry its load.
        quality: Q(f) (Q(f, depths) when the problem plans depth).
        cost: US$/h of the deployed models.
        layers: Layers each model's replicas hold (its candidate's).
    """

    fractions: tuple[float, ...]
    choice: tuple[int, ...]
    latency: float
    quality: float
    cost: float
    layers: tuple[int, ...] = ()


@dataclass
class PlanProblem:
    """Everything an evaluation needs.

    Attributes:
        models: Model ids, smallest first.
        candidates: Model -> its deployment candidates, by increasing cost.
        curves: Model -> (gpu, tp, pp, layers) -> latency curve.
        load: Total requests per second.
        budget: US$/h cap.
        available: GPU type -> GPUs available.
        quality: Fractions (``K``) -> mean quality (the routing curve).
        sharing: GPU type -> how its replicas share a host, for the types whose replicas do (a CPU device): the
            plan's replicas on one are slowed by each other's busy shares and, where they fill the host, by the
            coordinator's work (:mod:`exitplan.simulator.colocation`). Empty: every replica owns its GPUs.
        tokens_per_request: Model -> mean output tokens of a request of the perf DB's workload (what the
            coordinator relays per request routed to it).
        depth_quality: Q(f, layers per model), used instead of ``quality`` when given (the problem plans depth).
        routed: Model -> routed share -> (gpu, tp, pp, layers) -> latency curve simulated on the lengths the router
            sends the model at that share (:mod:`exitplan.planner.routed`); a model or layout without them is read
            from ``curves``.
    """

    models: list[str]
    candidates: dict[str, list[Candidate]]
    curves: dict[str, Mapping[tuple, LatencyCurve]]
    load: float
    budget: float
    available: Mapping[str, int]
    quality: Callable[[np.ndarray], float]
    sharing: Mapping[str, HostSharing] = field(default_factory=dict)
    depth_quality: Callable[[np.ndarray, tuple[int, ...]], float] | None = None
    tokens_per_request: Mapping[str, float] = field(default_factory=dict)
    routed: Mapping[str, Mapping[float, Mapping[tuple, LatencyCurve]]] = field(default_factory=dict)
    _cache: dict = field(default_factory=dict, repr=False)

    def curves_at(self, model: int, fraction: float) -> Mapping[tuple, LatencyCurve]:
        """A model's layouts' curves when it is routed ``fraction`` of the load (:func:`~exitplan.planner.routed.
        curves_at`; ``curves`` when the model has no routed curves), cached."""
        m = self.models[model]
        if not self.routed.get(m):
            return self.curves[m]
        key = ("curves", model, round(float(fraction), 6))
        if key not in self._cache:
            self._cache[key] = routed_curves(self.curves[m], self.routed[m], float(fraction))
        return self._cache[key]

    def layers_of(self, model: int, cand: int) -> int:
        """Layers each replica of a model's candidate holds."""
        return self.candidates[self.models[model]][cand].groups[0].layers

    def depths(self, model: int) -> list[int]:
        """The layer counts a model's candidates hold, shallowest first (the last is the deepest: full depth)."""
        key = ("depths", model)
        if key not in self._cache:
            count = len(self.candidates[self.models[model]])
            self._cache[key] = sorted({self.layers_of(model, c) for c in range(count)})
        return self._cache[key]

    def at_depth(self, model: int, layers: int) -> list[int]:
        """A model's candidates holding ``layers`` layers, cheapest first."""
        key = ("at", model, layers)
        if key not in self._cache:
            self._cache[key] = [c for c in range(len(self.candidates[self.models[model]]))
                                if self.layers_of(model, c) == layers]
        return self._cache[key]

    @property
    def plans_depth(self) -> bool:
        """Whether some model may be cut to more than one depth (the ``K`` depth coordinates exist)."""
        return any(len(self.depths(i)) > 1 for i in range(len(self.models)))

    @property
    def dim(self) -> int:
        """Dimensions of ``theta``."""
        return (3 if self.plans_depth else 2) * len(self.models) - 1

    @property
    def routing_dims(self) -> list[int]:
        """Indices of the routing coordinates."""
        return list(range(len(self.models) - 1))

    @property
    def deployment_dims(self) -> list[int]:
        """Indices of the deployment coordinates."""
        k = len(self.models)
        return list(range(k - 1, 2 * k - 1))

    @property
    def depth_dims(self) -> list[int]:
        """Indices of the depth coordinates (none when the problem does not plan depth)."""
        k = len(self.models)
        return list(range(2 * k - 1, 3 * k - 1)) if self.plans_depth else []

    def fractions(self, theta: np.ndarray) -> np.ndarray:
        """Stick-breaking: coordinate ``i`` is the share of the remaining load that goes past model ``i``."""
        f, rest = [], 1.0
        for u in theta[: len(self.models) - 1]:
            f.append(rest * (1 - u))
            rest *= u
        return np.asarray([*f, rest])

    def routing_theta(self, fractions: np.ndarray) -> np.ndarray:
        """The routing coordinates that :meth:`fractions` maps to ``fractions`` (the inverse stick-breaking)."""
        u, rest = [], 1.0
        for f in fractions[:-1]:
            u.append(float(np.clip(1 - f / rest, 0.0, 1.0)) if rest > 1e-12 else 1.0)
            rest -= f
        return np.asarray(u)

    def choice(self, theta: np.ndarray) -> tuple[int, ...]:
        """Candidate index per model from the deployment coordinates (among the candidates of the depth its depth
        coordinate picks, when the problem plans depth)."""
        theta = np.asarray(theta, float)
        out = []
        for i, m in enumerate(self.models):
            options = list(range(len(self.candidates[m])))
            if self.plans_depth:
                depths = self.depths(i)
                options = self.at_depth(i, depths[_index(theta[self.depth_dims[i]], len(depths))])
            out.append(options[_index(theta[self.deployment_dims[i]], len(options))])
        return tuple(out)

    def coordinates(self, model: int, cand: int) -> tuple[float, float | None]:
        """The deployment coordinate (and depth coordinate, ``None`` when the problem does not plan depth) at the
        centre of a model's candidate: the inverse of :meth:`choice`."""
        if not self.plans_depth:
            return (cand + 0.5) / len(self.candidates[self.models[model]]), None
        depths, layers = self.depths(model), self.layers_of(model, cand)
        same = self.at_depth(model, layers)
        return (same.index(cand) + 0.5) / len(same), (depths.index(layers) + 0.5) / len(depths)

    def cost(self, fractions: np.ndarray, choice: Sequence[int]) -> float:
        """US$/h of the loaded models' candidates."""
        return sum(self.candidates[m][c].cost for m, c, f in zip(self.models, choice, fractions, strict=True)
                   if f >= MIN_SHARE)

    def feasible(self, fractions: np.ndarray, choice: Sequence[int]) -> bool:
        """Within the budget and the GPUs available of every type."""
        if self.cost(fractions, choice) > self.budget + 1e-9:
            return False
        used = [self.candidates[m][c] for m, c, f in zip(self.models, choice, fractions, strict=True)
                if f >= MIN_SHARE]
        return all(sum(c.gpus(gpu) for c in used) <= n for gpu, n in self.available.items())

    def cheaper(self, model: int, cand: int) -> int | None:
        """The next cheaper candidate of a model at the same depth (``None``: ``cand`` is its depth's cheapest)."""
        same = self.at_depth(model, self.layers_of(model, cand))
        at = same.index(cand)
        return same[at - 1] if at > 0 else None

    def repair(self, fractions: np.ndarray, choice: Sequence[int]) -> tuple[int, ...] | None:
        """Step the dearest loaded model down its candidates (at its depth) until the plan is feasible (``None``:
        impossible)."""
        choice = list(choice)
        while not self.feasible(fractions, choice):
            loaded = [i for i, f in enumerate(fractions) if f >= MIN_SHARE and self.cheaper(i, choice[i]) is not None]
            if not loaded:
                return None
            dearest = max(loaded, key=lambda i: self.candidates[self.models[i]][choice[i]].cost)
            choice[dearest] = cast(int, self.cheaper(dearest, choice[dearest]))
        return tuple(choice)

    def evaluate(self, theta: np.ndarray) -> Plan | None:
        """The plan ``theta`` decodes to, repaired and evaluated (``None`` if no feasible plan is near)."""
        fractions = self.fractions(np.asarray(theta, float))
        choice = self.repair(fractions, self.choice(np.asarray(theta, float)))
        if choice is None:
            return None
        return self.evaluate_plan(fractions, choice)

    def model_latency(self, model: int, cand: int, fraction: float) -> float:
        """P95 of one model's candidate at ``fraction`` of the load (0 when not loaded), cached."""
        if fraction < MIN_SHARE:
            return 0.0
        key = (model, cand, round(float(fraction), 6))
        if key not in self._cache:
            m = self.models[model]
            curves = self.curves_at(model, fraction)
            self._cache[key] = float(self.candidates[m][cand].latency(fraction * self.load, curves))
        return self._cache[key]

    def headroom(self, fractions: np.ndarray, choice: Sequence[int]) -> float:
        """``log`` of the smallest ratio, over the loaded models, of a candidate's capacity (its replicas'
        summed sustainable load) to the load routed to it: ``>= 0`` when the plan can carry its load. A smooth
        measure of feasibility, for the optimiser's feasibility model."""
        ratios = [sum(c.capacity for c in self.candidates[m][k].replica_curves(self.curves_at(i, f))) / (f * self.load)
                  for i, (m, k, f) in enumerate(zip(self.models, choice, fractions, strict=True)) if f >= MIN_SHARE]
        return float(np.log(max(min(ratios, default=1.0), 1e-6)))

    def evaluate_plan(self, fractions: np.ndarray, choice: Sequence[int]) -> Plan:
        """Latency, quality and cost of given fractions and candidate choices (no repair)."""
        key = (tuple(np.round(fractions, 6)), tuple(choice))
        if key not in self._cache:
            shared = self.colocated_latencies(fractions, choice)
            latency = max(shared) if shared is not None else max(
                self.model_latency(i, c, f) for i, (c, f) in enumerate(zip(choice, fractions, strict=True)))
            layers = tuple(self.layers_of(i, c) for i, c in enumerate(choice))
            quality = self.quality(fractions) if self.depth_quality is None else self.depth_quality(fractions, layers)
            self._cache[key] = Plan(tuple(float(x) for x in fractions), tuple(choice), float(latency),
                                    float(quality), float(self.cost(fractions, choice)), layers)
        return self._cache[key]

    def colocated_latencies(self, fractions: np.ndarray, choice: Sequence[int]) -> list[float] | None:
        """Each loaded model's P95 with the replicas that share a host slowed by their neighbours (the mean field
        of :mod:`exitplan.simulator.colocation` over the perf DB's curves and busy shares); ``None`` when no shared
        GPU type holds two or more of the plan's replicas (then the plain look-up is exact)."""
        shared = self._colocated(fractions, choice)
        if shared is None:
            return None
        loaded, slowed = shared
        return [best_split(load, slowed_replicas(curves, s))[1]
                for (load, curves, _, _), s in zip(loaded, slowed, strict=True)]

    def colocated_slowdowns(self, fractions: np.ndarray, choice: Sequence[int]) -> list[np.ndarray] | None:
        """Each loaded model's replicas' step-time multipliers where they share a host with the plan's other
        replicas (the fixed point of :func:`~exitplan.simulator.colocation.slowdowns` over the perf DB's busy
        shares and batches); ``None`` when no shared GPU type holds two or more of the plan's replicas."""
        shared = self._colocated(fractions, choice)
        return None if shared is None else shared[1]

    def _colocated(self, fractions: np.ndarray,
                   choice: Sequence[int]) -> tuple[list[_Loaded], list[np.ndarray]] | None:
        """The loaded models (:meth:`_loaded`) and their replicas' multipliers (:meth:`colocated_slowdowns`)."""
        if not self.sharing:  # every GPU type owns its replicas' devices: skip on the evaluation path
            return None
        loaded = self._loaded(fractions, choice)
        curves = [cs for _, cs, _, _ in loaded]
        gpus = np.asarray([g.gpu for _, _, _, cand in loaded for g in cand.groups for _ in range(g.dp)])
        names = [m for _, cs, m, _ in loaded for _ in cs]
        tokens = np.asarray([self.tokens_per_request.get(m, 0.0) for m in names])
        hosts = {g: self.sharing[g] for g in set(gpus.tolist()) if g in self.sharing
                 and self.sharing[g].slows(int(np.sum(gpus == g)))}
        if not hosts:
            return None
        own = {g: [n for n, at in zip(names, gpus, strict=True) if at == g] for g in hosts}  # models on each
        flat, edges = [c for cs in curves for c in cs], np.cumsum([0, *map(len, curves)])

        def update(s: np.ndarray) -> np.ndarray:
            loads = np.concatenate([best_split(load, slowed_replicas(cs, s[a:b]))[0]
                                    for (load, cs, _, _), a, b in zip(loaded, edges[:-1], edges[1:], strict=True)])
            busy = np.asarray([c.busy_at(x * q) for c, x, q in zip(flat, s, loads, strict=True)])
            batch = [c.batch_at(x * q) for c, x, q in zip(flat, s, loads, strict=True)]
            new = np.ones(len(s))
            for g, host in hosts.items():
                mine = gpus == g
                known = [b for b, m in zip(batch, mine, strict=True) if m]
                pairs = host.pairwise(own[g], None if None in known else np.asarray(known, float))
                stolen = stolen_shares(busy[mine], loads[mine] * tokens[mine], self.load, host)
                new[mine] = slowdowns(busy[mine], pairs, stolen)
            return new

        s = fixed_point(update, len(gpus))
        return loaded, [s[a:b] for a, b in zip(edges[:-1], edges[1:], strict=True)]

    def _loaded(self, fractions: np.ndarray, choice: Sequence[int]) -> list[_Loaded]:
        """Each model the plan loads (its fraction at least :data:`MIN_SHARE`): its share of the load, its
        candidate's replicas' latency curves at that share, the model and the candidate."""
        return [(f * self.load, self.candidates[m][k].replica_curves(self.curves_at(i, f)), m, self.candidates[m][k])
                for i, (m, k, f) in enumerate(zip(self.models, choice, fractions, strict=True)) if f >= MIN_SHARE]


_Loaded = tuple[float, list[LatencyCurve], str, Candidate]
"""A loaded model: its load (req/s), its replicas' latency curves, its id and its deployment candidate."""


def slowed_replicas(curves: Sequence[LatencyCurve],
                    slowdown: Sequence[float] | np.ndarray | None) -> list[LatencyCurve]:
    """Replicas' latency curves with each one's steps ``slowdown`` times as long (``None``: as they are)."""
    if slowdown is None:
        return list(curves)
    return [slowed_curve(c, float(x)) for c, x in zip(curves, slowdown, strict=True)]


def _index(u: float, n: int) -> int:
    """The cell of ``n`` equal cells of [0, 1] that ``u`` falls in (1.0 in the last)."""
    return min(max(int(u * n), 0), n - 1)


def pareto(plans: Sequence[Plan]) -> list[Plan]:
    """Plans not dominated in (latency down, quality up) among those with finite latency, by latency."""
    finite = sorted((p for p in plans if p.latency < INF), key=lambda p: (p.latency, -p.quality))
    front, best = [], -np.inf
    for plan in finite:
        if plan.quality > best + 1e-12:
            front.append(plan)
            best = plan.quality
    return front


def hypervolume(plans: Sequence[Plan], ref_latency: float, ref_quality: float) -> float:
    """Area dominated by ``plans`` in (log latency, quality) up to the reference point (latency <= ref, quality >=
    ref)."""
    area, prev_q = 0.0, ref_quality
    for plan in pareto(plans):
        if plan.latency >= ref_latency or plan.quality <= prev_q:
            continue
        area += (np.log(ref_latency) - np.log(plan.latency)) * (plan.quality - prev_q)
        prev_q = plan.quality
    return float(area)


def best_under(plans: Sequence[Plan], max_latency: float = INF, min_quality: float = -INF) -> Plan | None:
    """The lowest-latency plan that carries its load and meets the quality floor (and latency cap), cheapest on
    ties."""
    ok = [p for p in plans if p.quality >= min_quality and p.latency <= max_latency and p.latency < INF]
    return min(ok, key=lambda p: (p.latency, p.cost), default=None)
