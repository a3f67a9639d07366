"""Plans: exhaustive search equals brute force; every plan is feasible; MOBO is not beaten by random search."""

from __future__ import annotations

import itertools

import numpy as np

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
    truth = exhaustive(problem, steps=20)
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
                          "routellm-uniform", "homogeneous"}
    assert found["single-small"] is None  # the small model alone reaches only 0.4
    for name, plan in found.items():
        if plan is not None:
            assert plan.quality >= 0.75 and plan.latency >= truth.latency - 1e-12, name
    homo = found["homogeneous"]
    assert len({g.gpu for m, c in zip(problem.models, homo.choice, strict=True)
                for g in problem.candidates[m][c].groups}) == 1


def test_an_infeasible_slo_names_the_binding_constraint(problem) -> None:
    from exitplan.config import PlanScenario
    from exitplan.stages.plan import binding_constraint

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
