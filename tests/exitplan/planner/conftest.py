"""A small synthetic co-optimisation problem: two models on three GPU types, with a known quality curve."""

from __future__ import annotations

import numpy as np
import pytest

from exitplan.planner.candidates import mixed_candidates
from exitplan.planner.problem import PlanProblem
from exitplan.simulator.curve import LatencyCurve

PRICES = {"big": 2.7, "mid": 1.8, "small": 0.6}
AVAILABLE = {"big": 4, "mid": 6, "small": 8}


def synthetic_curves(weight: float) -> dict:
    """Latency curves of a model ``weight`` times as heavy as a unit model, per GPU type and TP."""
    q = np.arange(1.0, 41.0)
    curves = {}
    for gpu, speed in (("big", 3.0), ("mid", 1.6), ("small", 0.7)):
        for tp in (1, 2, 4):
            cap = speed * tp * 6 / weight
            lat = weight / (speed * tp ** 0.8) + 0.5 * (q / cap) ** 3
            curves[(gpu, tp, 1, 32)] = LatencyCurve.from_points(q, lat, q > cap)
    return curves


def make_problem(load: float = 12.0, budget: float = 20.0) -> PlanProblem:
    curves = {"small": synthetic_curves(1.0), "large": synthetic_curves(3.0)}
    budgets = list(np.linspace(2, budget, 10))
    cands = {m: mixed_candidates(c, PRICES, load, AVAILABLE, budgets, target=2.0 * (1 if m == "small" else 3))
             for m, c in curves.items()}
    return PlanProblem(["small", "large"], cands, curves, load, budget, AVAILABLE,
                       quality=lambda f: 0.4 + 0.5 * np.sqrt(f[1]))


@pytest.fixture
def problem() -> PlanProblem:
    return make_problem()


@pytest.fixture
def loaded() -> PlanProblem:
    """The synthetic problem at a load most plans within the budget cannot carry."""
    return loaded_problem()


def loaded_problem(load: float = 30.0, budget: float = 20.0) -> PlanProblem:
    """The synthetic problem at a load most plans within the budget cannot carry (candidates at load shares)."""
    curves = {"small": synthetic_curves(1.0), "large": synthetic_curves(3.0)}
    budgets = list(np.linspace(2, budget, 10))
    cands = {m: mixed_candidates(c, PRICES, load, AVAILABLE, budgets, target=2.0 * (1 if m == "small" else 3),
                                 shares=(0.25, 0.5, 0.75, 1.0)) for m, c in curves.items()}
    return PlanProblem(["small", "large"], cands, curves, load, budget, AVAILABLE,
                       quality=lambda f: 0.4 + 0.5 * np.sqrt(f[1]))
