"""The threshold encoding (BOUTE's ablation of its load-share encoding) and MOBO's output transforms."""

from __future__ import annotations

import math

import numpy as np
import pytest

from exitplan.errors import ExitplanError
from exitplan.planner.encoding import threshold_problem
from exitplan.planner.mobo import _constraints, _corners, _outcomes, optimise
from exitplan.planner.problem import PlanProblem, best_under
from exitplan.planner.search import exhaustive


def test_a_threshold_coordinate_sends_the_scores_below_it_to_the_smaller_model(problem: PlanProblem) -> None:
    """90 scores in [0, 0.1) and 10 in [0.9, 1): the threshold halfway up the scale sends 90% of the load to the
    small model, where the load-share coordinate 0.5 would send half."""
    scores = np.concatenate([np.linspace(0.0, 0.09, 90), np.linspace(0.9, 0.99, 10)])
    encoded = threshold_problem(problem, scores)
    assert np.allclose(encoded.fractions(np.array([0.5, 0.3, 0.3])), [0.9, 0.1])
    assert np.allclose(encoded.fractions(np.array([0.0, 0.3, 0.3])), [0.0, 1.0])
    assert np.allclose(encoded.fractions(np.array([1.0, 0.3, 0.3])), [1.0, 0.0])
    assert np.allclose(problem.fractions(np.array([0.5, 0.3, 0.3])), [0.5, 0.5])


@pytest.mark.parametrize("fractions", [[0.3, 0.7], [0.0, 1.0], [1.0, 0.0], [0.55, 0.45]])
def test_routing_theta_inverts_the_thresholds_on_the_window(problem: PlanProblem, fractions: list[float]) -> None:
    encoded = threshold_problem(problem, np.random.default_rng(0).beta(2, 5, size=200))
    theta = np.concatenate([encoded.routing_theta(np.array(fractions)), [0.5, 0.5]])
    assert np.all((theta >= 0) & (theta <= 1))
    assert np.allclose(encoded.fractions(theta), fractions)


def test_the_corners_load_one_model_under_either_encoding(problem: PlanProblem) -> None:
    for encoded in (problem, threshold_problem(problem, np.arange(50.0))):
        fractions = [tuple(encoded.fractions(theta)) for theta in _corners(encoded)]
        assert fractions == [(1.0, 0.0), (0.0, 1.0)]


@pytest.mark.parametrize("scores", [np.ones(10), np.array([0.1, np.nan, 0.3]), np.array([0.2])])
def test_scores_that_cannot_be_split_are_rejected_by_name(problem: PlanProblem, scores: np.ndarray) -> None:
    with pytest.raises(ExitplanError, match="two distinct, finite routing scores"):
        threshold_problem(problem, scores)


def test_output_transforms_are_log_latency_and_logit_quality_or_raw_without() -> None:
    assert np.allclose(_outcomes(np.array([2.0]), np.array([0.8])), [[-math.log(2.0), math.log(4.0)]])
    assert np.allclose(_outcomes(np.array([2.0]), np.array([0.8]), transforms=False), [[-2.0, 0.8]])


def test_constraints_bound_the_outcomes_as_they_are_modelled() -> None:
    """A quality floor of 0.8 is logit 0.8 on transformed samples and 0.8 on raw ones; a floor of 0 is a bound
    too (not "no floor")."""
    z = np.array([[-1.0, 1.0, 0.0]])
    (transformed,) = _constraints(None, 0.8, constrained=False)
    (raw,) = _constraints(None, 0.8, constrained=False, transforms=False)
    (zero,) = _constraints(None, 0.0, constrained=False, transforms=False)
    assert transformed(z)[0] == pytest.approx(math.log(4.0) - 1.0)
    assert raw(z)[0] == pytest.approx(0.8 - 1.0) and zero(z)[0] == pytest.approx(-1.0)


def test_mobo_without_any_structure_still_finds_a_plan_meeting_the_floor(problem: PlanProblem) -> None:
    """The ablation's MOBO (thresholds, raw outcomes, no GPU preference, no feasible design) is a working
    search: on the small problem it meets the floor within 5% of the exact optimum."""
    encoded = threshold_problem(problem, np.random.default_rng(1).uniform(size=300))
    floor = 0.75
    exact = best_under(exhaustive(problem, 20), min_quality=floor)
    run = optimise(encoded, evaluations=32, initial=8, q=4, seed=0, beta=0.0, transforms=False,
                   feasible_start=False, min_quality=floor)
    found = best_under(run.plans, min_quality=floor)
    assert exact is not None and found is not None and found.latency <= 1.05 * exact.latency
