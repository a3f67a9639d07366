"""Baseline searches on a :class:`PlanProblem`: exhaustive over the candidate set (the true front), random."""

from __future__ import annotations

import itertools

import numpy as np

from exitplan.planner.problem import Plan, PlanProblem


def fraction_grid(models: int, steps: int) -> list[np.ndarray]:
    """Every fraction vector on a grid of ``1/steps`` that sums to 1."""
    out = []
    for parts in itertools.product(range(steps + 1), repeat=models - 1):
        if sum(parts) <= steps:
            out.append(np.asarray([*parts, steps - sum(parts)], float) / steps)
    return out


def exhaustive(problem: PlanProblem, steps: int = 20) -> list[Plan]:
    """Every feasible (fractions on the grid, candidate per model) plan."""
    plans = []
    for fractions in fraction_grid(len(problem.models), steps):
        for choice in itertools.product(*[range(len(problem.candidates[m])) for m in problem.models]):
            if problem.feasible(fractions, choice):
                plans.append(problem.evaluate_plan(fractions, choice))
    return plans


def random_search(problem: PlanProblem, evaluations: int, seed: int = 0) -> list[Plan]:
    """``evaluations`` plans from uniform points of the unit cube (repaired to feasibility)."""
    rng = np.random.default_rng(seed)
    plans = []
    while len(plans) < evaluations:
        plan = problem.evaluate(rng.uniform(size=problem.dim))
        if plan is not None:
            plans.append(plan)
    return plans
