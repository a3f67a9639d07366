"""MOBO's design and its late phase on the synthetic problems of conftest.py."""

from __future__ import annotations

import numpy as np

from exitplan.planner.convergence import convergence
from exitplan.planner.mobo import (
    LATE_AFTER,
    PAIR_SPLITS,
    _incumbents,
    cheapest_carrying,
    fastest_within_budget,
    filled_design,
    optimise,
)
from exitplan.planner.problem import Plan, best_under
from exitplan.planner.search import exhaustive


def _slowest_cannot_get_faster(problem, fractions: np.ndarray, choice: tuple[int, ...]) -> bool:
    """No other candidate of the slowest loaded model is faster and keeps the plan within budget and GPUs."""
    loaded = [i for i, f in enumerate(fractions) if f > 0]
    slowest = max(loaded, key=lambda i: problem.model_latency(i, choice[i], fractions[i]))
    now = problem.model_latency(slowest, choice[slowest], fractions[slowest])
    for c in range(len(problem.candidates[problem.models[slowest]])):
        trial = [*choice[:slowest], c, *choice[slowest + 1:]]
        if problem.model_latency(slowest, c, fractions[slowest]) < now and problem.feasible(fractions, trial):
            return False
    return True


def test_the_budget_filling_deployment_is_within_budget_and_no_slower_than_the_cheapest(loaded) -> None:
    checked = 0
    for share in (0.0, 0.25, 0.5, 0.75, 1.0):
        fractions = np.array([share, 1.0 - share])
        cheap = cheapest_carrying(loaded, fractions)
        filled = fastest_within_budget(loaded, fractions)
        assert (cheap is None) == (filled is None)
        if filled is None:
            continue
        checked += 1
        assert loaded.feasible(fractions, filled)
        fast, slow = loaded.evaluate_plan(fractions, filled), loaded.evaluate_plan(fractions, cheap)
        assert np.isfinite(fast.latency) and fast.latency <= slow.latency and fast.cost >= slow.cost
        assert _slowest_cannot_get_faster(loaded, fractions, filled)
        for i, (c, f) in enumerate(zip(filled, fractions, strict=True)):  # none cheaper within the same P95
            for cheaper in range(c if f > 0 else 0):
                trial = [*filled[:i], cheaper, *filled[i + 1:]]
                assert loaded.model_latency(i, cheaper, f) > fast.latency or not loaded.feasible(fractions, trial)
    assert checked >= 3


def test_the_budget_filling_deployment_spends_the_budget_where_the_cheapest_leaves_it(problem) -> None:
    """On the lightly loaded problem the cheapest carrying plan leaves most of the $20/h unspent; filling it buys
    a strictly lower P95."""
    fractions = np.array([0.5, 0.5])
    cheap, filled = cheapest_carrying(problem, fractions), fastest_within_budget(problem, fractions)
    fast, slow = problem.evaluate_plan(fractions, filled), problem.evaluate_plan(fractions, cheap)
    assert fast.latency < 0.9 * slow.latency and slow.cost < fast.cost <= problem.budget


def test_the_filled_design_holds_every_split_that_fits_each_at_its_budget_filling_deployment(loaded) -> None:
    points = filled_design(loaded)
    plans = [loaded.evaluate(theta) for theta in points]
    assert all(p is not None and np.isfinite(p.latency) for p in plans)
    for theta, plan in zip(points, plans, strict=True):
        assert loaded.choice(theta) == plan.choice  # decoded without repair: the point is the plan
        assert plan.choice == fastest_within_budget(loaded, np.asarray(plan.fractions))
    splits = {round(p.fractions[0], 3) for p in plans}
    wanted = {s for s in (0.0, 1.0, *PAIR_SPLITS)
              if fastest_within_budget(loaded, np.array([s, 1.0 - s])) is not None}
    assert splits == wanted and len(wanted) >= 3


def test_incumbents_are_the_front_of_the_plans_meeting_the_floor() -> None:
    plans = [Plan((1.0, 0.0), (0, 0), 1.0, 0.50, 1.0), Plan((0.5, 0.5), (0, 0), 2.0, 0.70, 2.0),
             Plan((0.2, 0.8), (0, 0), 3.0, 0.80, 3.0), Plan((0.2, 0.8), (1, 1), 4.0, 0.75, 4.0)]
    xs = [np.full(3, i) for i in range(4)]
    assert [x[0] for x in _incumbents(xs, plans, None, 0.7)] == [1, 2]
    assert [x[0] for x in _incumbents(xs, plans, 2.5, 0.7)] == [1]
    assert [x[0] for x in _incumbents(xs, plans, None, 0.95)] == [0, 1, 2]  # none meets it: the whole front


def test_with_a_quality_floor_mobo_reaches_the_exact_optimum_on_every_seed(loaded) -> None:
    """The late phase (after :data:`LATE_AFTER` evaluations) refines the best plan meeting the floor: on the loaded
    problem each of three seeds ends at the exhaustive optimum's P95 (within 5%; 24 evaluations, four of them late,
    left seed 2 at 1.10x)."""
    floor = 0.8
    exact = best_under(exhaustive(loaded, 20), min_quality=floor)
    assert exact is not None
    for seed in range(3):
        loaded._cache.clear()
        run = optimise(loaded, evaluations=LATE_AFTER + 16, initial=8, q=4, seed=seed, min_quality=floor)
        found = best_under(run.plans, min_quality=floor)
        assert found is not None and found.latency <= 1.05 * exact.latency, (seed, found, exact)


def test_with_patience_mobo_stops_once_its_solution_has_held_that_long(loaded) -> None:
    """BOUTE's rule as a stopping rule: the run ends in the round where the plan it would pick has been unchanged
    for ``patience`` evaluations, well before its cap."""
    floor, patience, q = 0.7, 8, 4
    run = optimise(loaded, evaluations=80, initial=8, q=q, seed=0, min_quality=floor, patience=patience)
    settled = convergence(run.plans, floor, patience)
    assert settled.converged and len(run.plans) < 80
    assert settled.stop_at <= len(run.plans) < settled.stop_at + q
