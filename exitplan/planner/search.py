"""Searches on a :class:`PlanProblem`: exhaustive over the candidate set (the true front), random.

The exhaustive search uses the problem's structure to stay exact at any size: a plan's quality depends on its
fractions only, and its latency is the worst of its models' latencies, each of which depends on that model's
candidate and share of the load only. So for each fraction vector of the grid it is enough to find the fastest
feasible choice of candidates (cheapest on ties): per model, the latency of every candidate at its share (one
cached look-up each), then every combination of candidates at once as arrays (latency = max, cost = sum, GPUs of
each type = sum) under the budget and the GPUs available. Every other plan on that fraction vector has the same
quality and is no faster, so the Pareto front of these fastest plans is the front of all plans on the grid.
When the problem plans depth, quality also depends on each model's depth, so the same holds per combination of
depths: the fastest plan is found for every fraction vector x depth combination (a few dozen combinations).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from exitplan.planner.problem import MIN_SHARE, Plan, PlanProblem

Allowed = Callable[[int, int], bool]
"""``allowed(model index, candidate index)``: whether a search may use that candidate."""


@dataclass(frozen=True)
class Census:
    """How many plans of the grid there are, and how many cannot carry their load.

    Attributes:
        plans: Plans within the budget and the GPUs available (fractions on the grid x candidate per model).
        cannot_carry: Those of them whose latency is infinite (some model gets more load than it sustains).
    """

    plans: int
    cannot_carry: int

    @property
    def infeasible_share(self) -> float:
        """Share of the plans that cannot carry their load."""
        return self.cannot_carry / self.plans if self.plans else 0.0


def fraction_grid(models: int, steps: int) -> list[np.ndarray]:
    """Every fraction vector on a grid of ``1/steps`` that sums to 1."""
    out = []
    for parts in itertools.product(range(steps + 1), repeat=models - 1):
        if sum(parts) <= steps:
            out.append(np.asarray([*parts, steps - sum(parts)], float) / steps)
    return out


def _combinations(problem: PlanProblem, fractions: np.ndarray, allowed: Allowed | None,
                  share: float | None) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Every feasible choice of candidates at ``fractions``: ``(choices (n x K), latency (n), cost (n))``; a model
    without load keeps one placeholder choice (its first allowed candidate; it is not deployed). ``None`` when no
    combination fits."""
    gpus = sorted(problem.available)
    options, lat, cost, used = [], [], [], []
    for i, m in enumerate(problem.models):
        if fractions[i] < MIN_SHARE:
            first = next((c for c in range(len(problem.candidates[m])) if allowed is None or allowed(i, c)), 0)
            options.append(np.full(1, first))
            lat.append(np.zeros(1))
            cost.append(np.zeros(1))
            used.append(np.zeros((1, len(gpus))))
            continue
        cands = [c for c in range(len(problem.candidates[m])) if (allowed is None or allowed(i, c))
                 and (share is None or problem.candidates[m][c].cost <= share * problem.budget + 1e-9)]
        if not cands:
            return None
        options.append(np.asarray(cands))
        lat.append(np.asarray([problem.model_latency(i, c, fractions[i]) for c in cands]))
        cost.append(np.asarray([problem.candidates[m][c].cost for c in cands]))
        used.append(np.asarray([[problem.candidates[m][c].gpus(g) for g in gpus] for c in cands], float))
    index = np.stack([a.ravel() for a in np.meshgrid(*[np.arange(len(o)) for o in options], indexing="ij")], 1)
    total_cost = cast(np.ndarray, sum(cost[k][index[:, k]] for k in range(len(options))))
    total_used = cast(np.ndarray, sum(used[k][index[:, k]] for k in range(len(options))))
    ok = (total_cost <= problem.budget + 1e-9) & np.all(total_used <= np.asarray([problem.available[g]
                                                                                 for g in gpus]), axis=1)
    if not ok.any():
        return None
    index = index[ok]
    latency = np.max(np.stack([lat[k][index[:, k]] for k in range(len(options))], 1), axis=1)
    choices = np.stack([options[k][index[:, k]] for k in range(len(options))], 1)
    return choices, latency, total_cost[ok]


def depth_combinations(problem: PlanProblem) -> list[tuple[int, ...]]:
    """Every combination of one depth (layers) per model: one (full depth) when the problem does not plan depth."""
    return list(itertools.product(*[problem.depths(i) for i in range(len(problem.models))]))


def at_depths(problem: PlanProblem, layers: Sequence[int], allowed: Allowed | None) -> Allowed:
    """``allowed`` further limited to the candidates holding ``layers[model]`` layers."""
    def ok(model: int, cand: int) -> bool:
        return problem.layers_of(model, cand) == layers[model] and (allowed is None or allowed(model, cand))
    return ok


def fastest(problem: PlanProblem, fractions: Sequence[np.ndarray], allowed: Allowed | None = None,
            share: float | None = None) -> list[Plan]:
    """For each fraction vector (and each combination of depths), its fastest feasible plan (cheapest on ties),
    with candidates limited to ``allowed`` and each model's candidate to ``share`` x the budget when given."""
    plans = []
    combos = depth_combinations(problem)
    for f in fractions:
        for layers in combos:
            limit = at_depths(problem, layers, allowed) if len(combos) > 1 else allowed
            found = _combinations(problem, np.asarray(f, float), limit, share)
            if found is None:
                continue
            choices, latency, cost = found
            best = int(np.lexsort((cost, latency))[0])
            plans.append(problem.evaluate_plan(np.asarray(f, float), tuple(int(c) for c in choices[best])))
    return plans


def exhaustive(problem: PlanProblem, steps: int = 20) -> list[Plan]:
    """The fastest feasible plan of every fraction vector on the ``1/steps`` grid (see the module docstring: their
    front is the front of every plan on the grid)."""
    return fastest(problem, fraction_grid(len(problem.models), steps))


def census(problem: PlanProblem, steps: int = 20) -> Census:
    """Count the grid's plans within the budget and GPUs, and those among them that cannot carry their load."""
    plans = cannot = 0
    for f in fraction_grid(len(problem.models), steps):
        found = _combinations(problem, f, None, None)
        if found is not None:
            plans += len(found[1])
            cannot += int(np.isinf(found[1]).sum())
    return Census(plans, cannot)


def random_search(problem: PlanProblem, evaluations: int, seed: int = 0) -> list[Plan]:
    """``evaluations`` plans from uniform points of the unit cube (repaired to feasibility)."""
    rng = np.random.default_rng(seed)
    plans: list[Plan] = []
    while len(plans) < evaluations:
        plan = problem.evaluate(rng.uniform(size=problem.dim))
        if plan is not None:
            plans.append(plan)
    return plans
