"""Plans: exhaustive search equals brute force; every plan is feasible; MOBO is not beaten by random search."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from exitplan.planner.mobo import optimise
from exitplan.planner.problem import best_under, hypervolume, pareto
from exitplan.planner.search import exhaustive, fraction_grid, random_search


def test_exhaustive_equals_brute_force_on_a_tiny_case(problem) -> None:
    plans = exhaustive(problem, steps=4)
    brute = []
    for f in np.linspace(0, 1, 5):
        fractions = np.array([1 - f, f])
        for a, b in itertools.product(range(len(problem.candidates["small"])),
                                      range(len(problem.candidates["large"]))):
            used = [problem.candidates[m][c] for m, c, share in
                    zip(["small", "large"], (a, b), fractions, strict=True) if share >= 1e-3]
            fits = all(sum(c.gpus(t) for c in used) <= n for t, n in problem.available.items())
            if sum(c.cost for c in used) <= problem.budget and fits:
                brute.append(problem.evaluate_plan(fractions, (a, b)))
    def front(found):  # (latency, quality) of the front: ties between equal plans may pick either
        return {(round(p.latency, 9), round(p.quality, 9)) for p in pareto(found)}

    assert front(plans) == front(brute) and len(front(plans)) >= 3
    assert len(fraction_grid(3, 4)) == 15


def test_every_plan_respects_budget_and_availability(problem) -> None:
    for plan in random_search(problem, 200, seed=3):
        assert plan.cost <= problem.budget + 1e-9
        used = [problem.candidates[m][c] for m, c, f in zip(problem.models, plan.choice, plan.fractions,
                                                            strict=True) if f >= 1e-3]
        assert all(sum(c.gpus(t) for c in used) <= n for t, n in problem.available.items())


def test_mobo_front_is_not_dominated_by_random_search_with_the_same_budget(problem) -> None:
    truth = exhaustive(problem, steps=200)  # MOBO's fractions are continuous: compare with a fine grid
    ref_latency = max(p.latency for p in truth if np.isfinite(p.latency)) * 1.1
    ref_quality = min(p.quality for p in truth) - 0.01
    mobo = optimise(problem, evaluations=32, initial=8, q=4, seed=0)
    rand = random_search(problem, 32, seed=0)
    hv = {name: hypervolume(plans, ref_latency, ref_quality) for name, plans in
          (("truth", truth), ("mobo", mobo.plans), ("random", rand))}
    assert hv["mobo"] >= hv["random"] and hv["mobo"] <= hv["truth"] + 1e-9
    best = best_under(mobo.plans, min_quality=0.7)
    assert best is not None and best.quality >= 0.7


def test_baselines_meet_the_floor_and_never_beat_the_full_search(problem) -> None:
    from exitplan.planner.baselines import baselines

    truth = best_under(exhaustive(problem, steps=20), min_quality=0.75)
    found = baselines(problem, min_quality=0.75)
    assert set(found) == {"single-small", "single-small-homo", "single-large", "single-large-homo",
                          "routellm-uniform", "routellm-uniform-budget", "homogeneous"}
    assert found["single-small"] is None  # the small model alone reaches only 0.4
    for name, plan in found.items():
        if plan is not None:
            assert plan.quality >= 0.75 and plan.latency >= truth.latency - 1e-12, name
    homo = found["homogeneous"]
    assert len({g.gpu for m, c in zip(problem.models, homo.choice, strict=True)
                for g in problem.candidates[m][c].groups}) == 1


def test_an_infeasible_slo_names_the_binding_constraint(problem) -> None:
    from exitplan.config import PlanScenario
    from exitplan.planner.scenario import binding_constraint

    truth = exhaustive(problem, steps=10)
    best_q = max(p.quality for p in truth)
    floor = PlanScenario(name="x", models=["a", "b"], gpus={"big": 1}, budget_per_hour=20, load_qps=12,
                         min_quality=best_q + 0.05)
    assert "quality floor binds" in binding_constraint(truth, floor) and f"{best_q:.3f}" in binding_constraint(
        truth, floor)
    cap = PlanScenario(name="x", models=["a", "b"], gpus={"big": 1}, budget_per_hour=20, load_qps=12,
                       min_quality=0.5, max_p95_s=1e-4)
    fastest = best_under(truth, min_quality=0.5)
    message = binding_constraint(truth, cap)
    assert "latency cap binds" in message and f"{fastest.latency:.3f} s" in message


def test_stick_breaking_inverts_for_three_models() -> None:
    from exitplan.planner.problem import PlanProblem

    problem = PlanProblem(["a", "b", "c"], {"a": [], "b": [], "c": []}, {}, 1.0, 1.0, {}, lambda f: 0.0)
    for fractions in ([0.2, 0.3, 0.5], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.5, 0.0, 0.5]):
        theta = np.r_[problem.routing_theta(np.asarray(fractions)), np.zeros(3)]
        assert problem.fractions(theta) == pytest.approx(fractions)


def test_exhaustive_on_three_models_equals_brute_force(problem) -> None:
    from exitplan.planner.problem import PlanProblem

    three = PlanProblem(["small", "mid", "large"], {"small": problem.candidates["small"],
                                                    "mid": problem.candidates["small"],
                                                    "large": problem.candidates["large"]},
                        {"small": problem.curves["small"], "mid": problem.curves["small"],
                         "large": problem.curves["large"]}, problem.load, problem.budget, problem.available,
                        lambda f: 0.4 + 0.3 * f[1] + 0.5 * np.sqrt(f[2]))
    brute = []
    for f in fraction_grid(3, 4):
        for choice in itertools.product(*[range(len(three.candidates[m])) for m in three.models]):
            if three.feasible(f, choice):
                brute.append(three.evaluate_plan(f, choice))
    fast = exhaustive(three, steps=4)
    assert len(fast) == len(fraction_grid(3, 4))  # one fastest plan per fraction vector (all are feasible here)
    assert {(round(p.latency, 9), round(p.quality, 9)) for p in pareto(fast)} == {
        (round(p.latency, 9), round(p.quality, 9)) for p in pareto(brute)}
    for f in fraction_grid(3, 4):
        same = [p for p in brute if np.allclose(p.fractions, f)]
        best = next(p for p in fast if np.allclose(p.fractions, f))
        assert best.latency == min(p.latency for p in same)


def test_census_counts_the_plans_that_cannot_carry_the_load(loaded) -> None:
    from exitplan.planner.search import census

    problem = loaded
    counted = census(problem, steps=10)
    brute = {}  # distinct deployed plans: the candidate of a model without load does not matter
    for f in fraction_grid(2, 10):
        for c in itertools.product(*[range(len(problem.candidates[m])) for m in problem.models]):
            if problem.feasible(f, c):
                key = (tuple(f), tuple(k if share >= 1e-3 else None for k, share in zip(c, f, strict=True)))
                brute[key] = problem.evaluate_plan(f, c)
    brute = list(brute.values())
    assert counted.plans == len(brute) and counted.cannot_carry == sum(not np.isfinite(p.latency) for p in brute)
    assert counted.infeasible_share > 0.5


def test_the_feasibility_model_keeps_mobo_off_plans_that_cannot_carry_the_load(loaded) -> None:
    """Summed over five seeds, so that one machine's floating-point path cannot decide the verdict: a single seed's
    count moved from 7 to 10 of 16 between machines (issue 32), while the five-seed sums measured here were 27 of 80
    (constraint) and 58 of 80 (penalty); the bounds leave 13 and 19 proposals of margin."""
    proposals, seeds = 16, range(5)
    stuck = dict.fromkeys(("constraint", "penalty"), 0)
    for mode in stuck:
        for seed in seeds:
            loaded._cache.clear()
            result = optimise(loaded, evaluations=8 + proposals, initial=8, q=4, seed=seed, feasibility=mode)
            stuck[mode] += sum(not np.isfinite(p.latency) for p in result.plans[8:])
    rand = random_search(loaded, 200, seed=0)
    random_share = np.mean([not np.isfinite(p.latency) for p in rand])
    assert random_share > 0.6  # most plans within the budget cannot carry this load
    total = proposals * len(seeds)
    assert stuck["constraint"] <= 0.5 * total and stuck["penalty"] - stuck["constraint"] >= 0.15 * total, stuck


def test_the_feasible_design_carries_its_load_on_each_models_side_at_least_cost(loaded) -> None:
    from exitplan.planner.mobo import cheapest_carrying, feasible_design

    points = feasible_design(loaded)
    plans = [loaded.evaluate(theta) for theta in points]
    assert all(p is not None and np.isfinite(p.latency) for p in plans)  # random plans: most cannot (test above)
    sides = {tuple(np.round(p.fractions, 3)) for p in plans}
    wanted = {f: cheapest_carrying(loaded, np.array(f)) for f in ((1.0, 0.0), (0.0, 1.0), (0.5, 0.5))}
    assert sides == {f for f, choice in wanted.items() if choice is not None}  # each side that can carry it
    assert len(sides) >= 2 and (1.0, 0.0) in sides  # here the 70B-like model alone cannot, within the budget
    for plan in plans:  # no cheaper candidate of a loaded model carries its share
        for i, (c, f) in enumerate(zip(plan.choice, plan.fractions, strict=True)):
            if f > 0:
                assert all(loaded.model_latency(i, cheaper, f) == np.inf for cheaper in range(c))
    small_alone = next(p for p in plans if p.fractions[0] == 1.0)
    assert small_alone.choice == wanted[(1.0, 0.0)] and small_alone.choice[0] > 0  # its cheapest one cannot
