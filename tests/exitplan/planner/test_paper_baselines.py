"""BOUTE's baselines on a problem small enough to solve by hand.

Two GPU types: one ``fast`` ($2/h, 1 available), two ``slow`` ($1/h). Linear latency curves ``base + slope x qps``
up to a capacity. Load 4 req/s, budget $6/h, quality ``0.5 + 0.4 x f_large``: the floor 0.7 needs half the load on
the large model (fraction grid in halves). Candidates of each model: 1 slow, 2 slow, 1 fast, 1 fast + 1 slow.
"""

from __future__ import annotations

import numpy as np
import pytest

from exitplan.planner.baselines import paper_baselines
from exitplan.planner.candidates import Candidate, Group
from exitplan.planner.problem import PlanProblem
from exitplan.simulator.curve import LatencyCurve

PRICES = {"fast": 2.0, "slow": 1.0}
LINES = {"small": {"fast": (0.5, 0.1, 8.0), "slow": (1.0, 0.2, 4.0)},
         "large": {"fast": (2.0, 0.5, 4.0), "slow": (2.5, 1.0, 3.0)}}  # (base s, slope s per req/s, capacity)


def _problem() -> PlanProblem:
    q = np.arange(0.25, 8.01, 0.25)
    curves = {m: {(g, 1, 1, 32): LatencyCurve.from_points(q, base + slope * q, q > cap)
                  for g, (base, slope, cap) in lines.items()} for m, lines in LINES.items()}

    def cand(*dp: tuple[str, int]) -> Candidate:
        return Candidate(tuple(Group(g, 1, 1, n, 32, PRICES[g]) for g, n in dp))

    options = [cand(("slow", 1)), cand(("slow", 2)), cand(("fast", 1)), cand(("fast", 1), ("slow", 1))]
    return PlanProblem(["small", "large"], {m: sorted(options, key=lambda c: c.cost) for m in LINES}, curves,
                       load=4.0, budget=6.0, available={"fast": 1, "slow": 2},
                       quality=lambda f: 0.5 + 0.4 * f[1])


def test_each_baseline_is_its_hand_computed_best_plan() -> None:
    found = paper_baselines(_problem(), min_quality=0.7, homo_gpu="fast", steps=2)
    # the large model alone on the one fast GPU: 2 + 0.5 x 4
    assert found["stand-alone-homo"].latency == pytest.approx(4.0)
    # alone on any GPUs: fast + slow, split where 2 + 0.5 x = 2.5 + (4 - x): x = 3, 3.5 s
    assert found["stand-alone-hetero"].latency == pytest.approx(3.5)
    assert found["stand-alone-hetero"].fractions == (0.0, 1.0)
    # equal GPU count: each model at most 1 // 2 = 0 fast and 2 // 2 = 1 slow; the 70B's 4 req/s overflow one slow
    # GPU (capacity 3), so half the load each: the large one at 2 req/s on a slow GPU, 2.5 + 2
    count = found["routellm-count"]
    assert count.latency == pytest.approx(4.5) and count.fractions == (0.5, 0.5)
    # equal budget: each model within $3/h; half each, the large one on fast + slow at 2 req/s:
    # 2 + 0.5 x = 2.5 + (2 - x) -> x = 5/3, 8.5 / 3 s; the small one on the other slow GPU (1 + 0.2 x 2 = 1.4 s)
    budget = found["routellm-budget"]
    assert budget.latency == pytest.approx(8.5 / 3, rel=1e-4) and budget.fractions == (0.5, 0.5)
    assert budget.cost == pytest.approx(4.0)
    # fast GPUs only: one of them, so one model: the large one alone, as stand-alone-homo
    assert found["boute-homo"].latency == pytest.approx(4.0) and found["boute-homo"].fractions == (0.0, 1.0)


def test_a_baseline_that_cannot_meet_the_floor_is_none() -> None:
    found = paper_baselines(_problem(), min_quality=0.95, homo_gpu="fast", steps=2)
    assert all(plan is None for plan in found.values())
