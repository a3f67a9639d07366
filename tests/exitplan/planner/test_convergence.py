"""BOUTE's convergence rule: the solution unchanged for 20 evaluations in a row."""

from __future__ import annotations

from exitplan.planner.convergence import PATIENCE, convergence
from exitplan.planner.problem import Plan


def _plan(latency: float, quality: float, cost: float = 1.0) -> Plan:
    return Plan((0.5, 0.5), (0, 0), latency, quality, cost)


def test_the_search_stops_twenty_evaluations_after_its_last_improvement() -> None:
    plans = [_plan(5.0, 0.8), _plan(4.0, 0.8), *[_plan(6.0, 0.9)] * 3, _plan(3.0, 0.8), *[_plan(9.0, 0.8)] * 25]
    found = convergence(plans, min_quality=0.75)
    assert PATIENCE == 20
    assert found.found_at == 6 and found.stop_at == 26 and found.converged


def test_plans_below_the_floor_or_unable_to_carry_the_load_never_count() -> None:
    plans = [_plan(4.0, 0.8), _plan(1.0, 0.7), _plan(float("inf"), 0.95), *[_plan(5.0, 0.8)] * 20]
    assert convergence(plans, min_quality=0.75).found_at == 1
    assert convergence(plans, min_quality=0.75).stop_at == 21


def test_a_cheaper_plan_of_the_same_p95_is_a_change_and_a_dearer_one_is_not() -> None:
    plans = [_plan(2.0, 0.8, cost=3.0), _plan(2.0, 0.8, cost=4.0), _plan(2.0, 0.8, cost=2.0), *[_plan(3.0, 0.8)] * 20]
    assert convergence(plans, min_quality=0.0).found_at == 3


def test_a_search_that_hits_its_cap_first_has_not_converged() -> None:
    plans = [_plan(5.0, 0.8), *[_plan(6.0, 0.8)] * 10, _plan(4.0, 0.8), *[_plan(6.0, 0.8)] * 19]
    found = convergence(plans, min_quality=0.5)
    assert found.found_at == 12 and found.stop_at is None and not found.converged
    assert convergence([_plan(1.0, 0.1)] * 30, min_quality=0.5).found_at is None
