"""Depth as a decision of the plan: the quality-by-depth rule, Q(f, depths), the depth coordinate, the searches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import AVAILABLE, PRICES

from exitplan.errors import ExitplanError
from exitplan.planner.candidates import mixed_candidates
from exitplan.planner.depth import build_depth_quality, check_depths, depth_quality_rule, read_agreement
from exitplan.planner.mobo import _kernel, optimise
from exitplan.planner.problem import PlanProblem, hypervolume, pareto
from exitplan.planner.search import exhaustive
from exitplan.simulator.curve import LatencyCurve

GRID = np.asarray([[1.0, 0.0], [0.5, 0.5], [0.0, 1.0]])
SCORES = np.asarray([0.0, 1.0, 2.0, 3.0])
QUALITIES = np.asarray([[0.2, 1.0], [0.4, 1.0], [0.6, 1.0], [0.8, 1.0]])


def test_the_rule_keeps_the_agreeing_share_of_the_quality_above_the_floor() -> None:
    got = depth_quality_rule(np.asarray([1.0, 0.0, 0.5]), agreement=0.8, floor=0.1)
    assert got == pytest.approx([0.82, 0.02, 0.42])  # 0.1 + 0.8 * (q - 0.1)


def test_the_rule_rejects_an_agreement_outside_the_unit_interval() -> None:
    for bad in (1.2, -0.1, float("nan")):
        with pytest.raises(ExitplanError, match="agreement"):
            depth_quality_rule(np.ones(2), bad, 0.0)


def _hand_quality(agreement: float = 0.5):
    return build_depth_quality(["s", "l"], SCORES, QUALITIES, GRID, {"s": [2, 4], "l": [4]}, {"s": {2: agreement}},
                               {"s": "table"}, floor=0.0)


def test_depth_quality_on_a_hand_computed_case() -> None:
    q = _hand_quality()
    # half the load on each: queries 0 and 1 (the lowest scores) on the small model, 2 and 3 on the large.
    assert q(np.asarray([0.5, 0.5]), (4, 4)) == pytest.approx((0.2 + 0.4 + 1 + 1) / 4)
    assert q(np.asarray([0.5, 0.5]), (2, 4)) == pytest.approx((0.5 * 0.2 + 0.5 * 0.4 + 1 + 1) / 4)
    assert q(np.asarray([1.0, 0.0]), (2, 4)) == pytest.approx(0.5 * (0.2 + 0.4 + 0.6 + 0.8) / 4)
    assert q(np.asarray([0.0, 1.0]), (2, 4)) == pytest.approx(1.0)  # no load on the cut model: no loss
    assert q(np.asarray([0.75, 0.25]), (2, 4)) == pytest.approx(0.5 * (0.25 + 0.575))  # linear between grid points
    assert q.sources == {"s": "table", "l": "labels (full depth)"}


def test_labels_measured_at_a_depth_are_taken_per_query_before_the_rule() -> None:
    at_two = np.asarray([0.0, 0.0, 0.6, 0.6])  # labelled at 2 layers: the cut fails on the easy queries only
    q = build_depth_quality(["s", "l"], SCORES, QUALITIES, GRID, {"s": [2, 4], "l": [4]}, {"s": {2: 0.5}}, {}, 0.0,
                            measured={"s": {2: at_two}})
    assert q(np.asarray([0.5, 0.5]), (2, 4)) == pytest.approx((0 + 0 + 1 + 1) / 4)  # not the rule's 0.575
    assert q(np.asarray([1.0, 0.0]), (2, 4)) == pytest.approx(1.2 / 4)


def test_a_depth_without_a_quality_figure_is_rejected_by_name() -> None:
    with pytest.raises(ExitplanError, match=r"s: no quality is known at 3 layers"):
        build_depth_quality(["s", "l"], SCORES, QUALITIES, GRID, {"s": [3, 4], "l": [4]}, {"s": {2: 0.5}}, {}, 0.0)


def test_a_perf_db_depth_the_exit_profile_never_measured_is_rejected_by_name() -> None:
    with pytest.raises(ExitplanError, match=r"Qwen/x: depth 18 of 24 layers .* never measured .*\[12, 16\]"):
        check_depths("Qwen/x", [12, 18, 24], 24, {12: 0.5, 16: 0.7})
    assert check_depths("Qwen/x", [12, 24], 24, {12: 0.5, 16: 0.7}) == [12, 24]


def test_agreement_is_read_from_the_exit_profiles_identity_exits(tmp_path: Path) -> None:
    rows = [{"model": "m", "kind": kind, "dataset": ds, "exit_layer": layer, "agreement": a}
            for kind, ds, layer, a in [("identity", "all", 4, 0.3), ("identity", "all", 8, 0.6),
                                       ("block", "all", 4, 0.9), ("identity", "gsm8k", 4, 0.1)]]
    path = tmp_path / "curves.parquet"
    pd.DataFrame(rows).to_parquet(path)
    assert read_agreement(path) == {"m": {4: 0.3, 8: 0.6}}
    with pytest.raises(ExitplanError, match="run the exit_profile stage"):
        read_agreement(tmp_path / "absent.parquet")


def _curves(weight: float, layers: int) -> dict:
    q = np.arange(1.0, 41.0)
    curves = {}
    for gpu, speed in (("big", 3.0), ("mid", 1.6), ("small", 0.7)):
        for tp in (1, 2):
            cap = speed * tp * 6 / weight
            lat = weight / (speed * tp ** 0.8) + 0.5 * (q / cap) ** 3
            curves[(gpu, tp, 1, layers)] = LatencyCurve.from_points(q, lat, q > cap)
    return curves


def depth_problem(agreement: float, load: float = 12.0, budget: float = 12.0) -> PlanProblem:
    """The synthetic pair where the small model may also run at half depth (half the work per token)."""
    curves = {"small": {**_curves(1.0, 32), **_curves(0.5, 16)}, "large": _curves(3.0, 32)}
    budgets = list(np.linspace(2, budget, 8))
    cands = {}
    for m, by in curves.items():
        found = []
        for layers in sorted({k[3] for k in by}):
            at = {k: c for k, c in by.items() if k[3] == layers}
            found += mixed_candidates(at, PRICES, load, AVAILABLE, budgets, target=2.0 * (1 if m == "small" else 3))
        cands[m] = sorted(found, key=lambda c: c.cost)
    rng = np.random.default_rng(0)
    scores = rng.normal(size=200)
    qualities = np.stack([0.3 + 0.1 * (scores < 0), np.full(200, 0.8)], axis=1)
    grid = np.asarray([[1 - x, x] for x in np.linspace(0, 1, 11)])
    quality = build_depth_quality(["small", "large"], scores, qualities, grid, {"small": [16, 32], "large": [32]},
                                  {"small": {16: agreement}}, {}, floor=0.0)
    return PlanProblem(["small", "large"], cands, curves, load, budget, AVAILABLE,
                       quality=lambda f: quality(f, (32, 32)), depth_quality=quality)


def test_the_depth_coordinate_is_ordinal_and_round_trips_every_candidate() -> None:
    problem = depth_problem(0.9)
    assert problem.plans_depth and problem.dim == 5 and problem.depth_dims == [3, 4]
    theta = np.asarray([0.5, 0.5, 0.5, 0.2, 0.9])
    assert problem.layers_of(0, problem.choice(theta)[0]) == 16  # the shallower cell first
    theta[3] = 0.8
    assert problem.layers_of(0, problem.choice(theta)[0]) == 32
    for i, m in enumerate(problem.models):
        for c in range(len(problem.candidates[m])):
            point = np.full(problem.dim, 0.5)
            deployment, depth = problem.coordinates(i, c)
            point[problem.deployment_dims[i]] = deployment
            point[problem.depth_dims[i]] = depth
            assert problem.choice(point)[i] == c


def test_repair_keeps_each_models_depth() -> None:
    problem = depth_problem(0.9, budget=8.0)
    dearest = [problem.at_depth(i, problem.depths(i)[0])[-1] for i in range(2)]
    fixed = problem.repair(np.asarray([0.5, 0.5]), dearest)
    assert fixed is not None and problem.feasible(np.asarray([0.5, 0.5]), fixed)
    assert [problem.layers_of(i, c) for i, c in enumerate(fixed)] == [16, 32]


def test_a_lossless_exit_makes_the_depth_front_dominate_and_a_useless_one_leaves_full_depth_on_top() -> None:
    lossless, useless = depth_problem(1.0), depth_problem(0.0)
    front = pareto(exhaustive(lossless, 10))
    assert any(p.layers[0] == 16 and p.fractions[0] > 0 for p in front)
    full_only = [p for p in exhaustive(lossless, 10) if p.layers[0] == 32 or p.fractions[0] < 1e-3]
    ref = (2 * max(p.latency for p in front), 0.0)
    assert hypervolume(front, *ref) > 1.01 * hypervolume(full_only, *ref)
    top = max(pareto(exhaustive(useless, 10)), key=lambda p: p.quality)
    assert top.layers[0] == 32 or top.fractions[0] < 1e-3


def test_mobo_gives_depth_its_own_ordinal_kernel_and_explores_both_depths() -> None:
    problem = depth_problem(0.9)
    kernel = _kernel(problem, structured=True)
    active = [tuple(k.active_dims.tolist()) for k in kernel.modules()
              if getattr(k, "active_dims", None) is not None]
    assert tuple(problem.depth_dims) in active
    result = optimise(problem, evaluations=16, initial=6, q=2, seed=0, pool_size=128)
    assert {p.layers[0] for p in result.plans if p.fractions[0] > 1e-3} == {16, 32}
    for plan in result.plans:
        assert plan.layers == tuple(problem.layers_of(i, c) for i, c in enumerate(plan.choice))
