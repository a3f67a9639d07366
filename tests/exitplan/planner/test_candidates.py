"""Deployment candidates: the knapsack never breaks budget or availability and equals brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from exitplan.planner.candidates import Candidate, Group, groups_per_gpu, knapsack, mixed_candidates, skim
from exitplan.simulator.curve import LatencyCurve

PRICES = {"big": 2.7, "mid": 1.8, "small": 0.6}


def _curves() -> dict:
    q = np.arange(1.0, 41.0)
    curves = {}
    for gpu, speed in (("big", 3.0), ("mid", 1.6), ("small", 0.7)):
        for tp in (1, 2, 4):
            cap = speed * tp * 4
            lat = 1.0 / (speed * tp ** 0.8) + 0.5 * (q / cap) ** 3
            curves[(gpu, tp, 1, 32)] = LatencyCurve.from_points(q, lat, q > cap)
    return curves


def test_skim_keeps_the_pareto_front() -> None:
    front = skim([(5.0, 1.0, "a"), (4.0, 2.0, "b"), (6.0, 3.0, "c"), (1.0, 4.0, "d")])
    assert [p[2] for p in front] == ["a", "b", "d"]


def test_knapsack_equals_brute_force_and_respects_budget_and_availability() -> None:
    rng = np.random.default_rng(0)
    available = {"big": 4, "mid": 8, "small": 8}
    options = groups_per_gpu(_curves(), PRICES, 10.0, available)
    value = {g: float(rng.uniform(1, 10)) for gs in options.values() for g in gs}
    for budget in (3.0, 7.5, 12.0, 30.0):
        chosen = knapsack(options, value, budget)
        assert sum(g.cost for g in chosen) <= budget + 1e-9
        assert len({g.gpu for g in chosen}) == len(chosen)
        assert all(Candidate(chosen).gpus(t) <= available[t] for t in available)
        best = 0.0
        for combo in itertools.product(*[[None, *gs] for gs in options.values()]):
            picked = [g for g in combo if g is not None]
            if sum(g.cost for g in picked) <= budget:
                best = max(best, sum(value[g] for g in picked))
        assert sum(value[g] for g in chosen) == pytest.approx(best)


def test_mixed_candidates_trade_cost_for_latency() -> None:
    curves = _curves()
    found = mixed_candidates(curves, PRICES, 20.0, {"big": 4, "mid": 8, "small": 8}, [5, 10, 15, 20, 30], 1.0)
    costs = [c.cost for c in found]
    latencies = [c.latency(20.0, curves) for c in found]
    assert costs == sorted(costs) and all(b < a for a, b in zip(latencies, latencies[1:], strict=False))
    assert any(len({g.gpu for g in c.groups}) > 1 for c in found) or len(found) >= 2
    assert Group("big", 2, 1, 3, 32, 2.7).cost == pytest.approx(16.2)


def test_candidates_at_a_share_of_the_load_keep_layouts_too_small_for_all_of_it() -> None:
    curves = _curves()
    available, budgets = {"big": 4, "mid": 8, "small": 8}, [3, 6, 9]
    whole = mixed_candidates(curves, PRICES, 20.0, available, budgets, 1.0)
    both = mixed_candidates(curves, PRICES, 20.0, available, budgets, 1.0, shares=(0.5, 1.0))
    assert {c.groups for c in whole} <= {c.groups for c in both}
    one_big = Candidate((Group("big", 1, 1, 1, 32, 2.7),))
    assert one_big.latency(20.0, curves) == float("inf")  # one "big" GPU cannot carry the whole load ...
    assert one_big.groups not in {c.groups for c in whole}
    assert one_big.groups in {c.groups for c in both}  # ... but is the fastest for half of it within $3/h
    half = [c for c in both if c.cost <= 3.0]
    assert min(half, key=lambda c: c.latency(10.0, curves)).groups == one_big.groups
