"""A plan whose replicas share a host: the planner's mean field against the fixed point solved by hand."""

from __future__ import annotations

import numpy as np
import pytest

from exitplan.planner.candidates import Candidate, Group
from exitplan.planner.problem import PlanProblem
from exitplan.simulator.colocation import HostSharing
from exitplan.simulator.curve import LatencyCurve

GRID = np.asarray([0.5, 1.0, 2.0, 4.0])


def _curve(base: float, slope: float, busy_per_qps: float, batch: float | None = None) -> LatencyCurve:
    # latency base + slope * q, busy share busy_per_qps * q: both linear, so the fixed point has a closed form
    return LatencyCurve.from_points(GRID, base + slope * GRID, busy=busy_per_qps * GRID,
                                    batch=None if batch is None else np.full(len(GRID), batch))


def _problem(shared: dict[str, HostSharing], gpu_b: str = "cpu",
             batches: tuple[float | None, float | None] = (None, None)) -> PlanProblem:
    curves = {"a": {("cpu", 1, 1, 10): _curve(1.0, 0.5, 0.2, batches[0])},
              "b": {(gpu_b, 1, 1, 20): _curve(2.0, 1.0, 0.15, batches[1])}}
    candidates = {"a": [Candidate((Group("cpu", 1, 1, 1, 10, 0.1),))],
                  "b": [Candidate((Group(gpu_b, 1, 1, 1, 20, 0.1),))]}
    return PlanProblem(["a", "b"], candidates, curves, load=2.0, budget=10.0, available={"cpu": 2, "gpu": 1},
                       quality=lambda f: float(f[1]), sharing=shared, tokens_per_request={"a": 100.0, "b": 50.0})


def test_replicas_on_one_host_meet_at_the_hand_solved_fixed_point() -> None:
    c, fractions = 0.4, np.asarray([0.5, 0.5])  # 1 req/s each
    # s_a = 1 + c * u_b(s_b * 1), s_b = 1 + c * u_a(s_a * 1) with u_a = 0.2 q, u_b = 0.15 q:
    # s_a = 1 + 0.06 s_b, s_b = 1 + 0.08 s_a, a linear system; the latency at the inflated load, stretched by s
    a, b = c * 0.15, c * 0.2
    s_a, s_b = (1 + a) / (1 - a * b), (1 + b) / (1 - a * b)
    latency_a, latency_b = s_a * (1.0 + 0.5 * s_a), s_b * (2.0 + 1.0 * s_b)
    got = _problem({"cpu": HostSharing(c)}).colocated_latencies(fractions, (0, 0))
    assert got == pytest.approx([latency_a, latency_b], rel=1e-3)
    plan = _problem({"cpu": HostSharing(c)}).evaluate_plan(fractions, (0, 0))
    assert plan.latency == pytest.approx(latency_b, rel=1e-3)
    assert plan.latency > _problem({}).evaluate_plan(fractions, (0, 0)).latency == pytest.approx(3.0)


def test_each_models_own_neighbour_slowdown_enters_its_replicas_fixed_point() -> None:
    c_a, c_b, fractions = 0.4, 0.1, np.asarray([0.5, 0.5])  # a loses 0.4 per busy neighbour, b (measured apart) 0.1
    a, b = c_a * 0.15, c_b * 0.2  # s_a = 1 + c_a u_b(s_b), s_b = 1 + c_b u_a(s_a), as above
    s_a, s_b = (1 + a) / (1 - a * b), (1 + b) / (1 - a * b)
    host = HostSharing(c_a, model_slowdowns=(("b", c_b),))  # "a" not named: the device's figure
    got = _problem({"cpu": host}).colocated_latencies(fractions, (0, 0))
    assert got == pytest.approx([s_a * (1.0 + 0.5 * s_a), s_b * (2.0 + 1.0 * s_b)], rel=1e-3)
    assert got[1] < _problem({"cpu": HostSharing(c_a)}).colocated_latencies(fractions, (0, 0))[1]


def test_a_models_grid_is_read_at_the_batches_the_perf_db_recorded() -> None:
    from exitplan.catalog import SlowdownGrid

    # a decodes alone (batch 1) and loses 0.4 to a neighbour at batch 16; b, at 16, loses nothing to a's batch 1
    grid = SlowdownGrid(batches=[1, 16], values=[[0.1, 0.4], [0.0, 0.0]])
    host = HostSharing(0.9, grids=(("a", grid), ("b", grid)))
    got = _problem({"cpu": host}, batches=(1.0, 16.0)).colocated_latencies(np.asarray([0.5, 0.5]), (0, 0))
    s_a = 1 + 0.4 * 0.15  # b is busy 0.15 of the time at 1 req/s and unslowed
    assert got == pytest.approx([s_a * (1.0 + 0.5 * s_a), 2.0 + 1.0], rel=1e-3)
    # batches not recorded (an older perf DB): each grid's mean for every pair
    mean = _problem({"cpu": host}).colocated_latencies(np.asarray([0.5, 0.5]), (0, 0))
    assert mean is not None and mean[1] > 3.0 * 1.01


def test_replicas_on_separate_devices_are_looked_up_alone() -> None:
    problem = _problem({"cpu": HostSharing(0.4)}, gpu_b="gpu")  # one replica on the shared type: no neighbour
    assert problem.colocated_latencies(np.asarray([0.5, 0.5]), (0, 0)) is None
    assert problem.evaluate_plan(np.asarray([0.5, 0.5]), (0, 0)).latency == pytest.approx(3.0)
    # a model with no load deploys nothing, so it slows no one
    assert _problem({"cpu": HostSharing(0.4)}).colocated_latencies(np.asarray([1.0, 0.0]), (0, 0)) is None


def test_a_coordinator_without_a_core_of_its_own_slows_the_replicas_that_fill_the_host() -> None:
    fractions = np.asarray([0.5, 0.5])  # 1 req/s each: u_a = 0.2 s_a, u_b = 0.15 s_b, 100 and 50 tok/s
    relay, score = 0.001, 0.02
    host = HostSharing(host_slots=2, relay_cpu_s=relay, score_cpu_s=score)
    got = _problem({"cpu": host}).colocated_latencies(fractions, (0, 0))
    assert got is not None
    # the fixed point by plain iteration of the hand-written map
    s = np.ones(2)
    for _ in range(200):
        u = np.asarray([0.2 * s[0], 0.15 * s[1]])
        taken = (relay * (100 * u[1] + 50 * u[0]) + score * 2.0 * u[0] * u[1]) / 2
        s = 1 / (1 - taken / u)
    assert got == pytest.approx([s[0] * (1.0 + 0.5 * s[0]), s[1] * (2.0 + 1.0 * s[1])], rel=1e-3)
    assert s[1] > s[0] > 1.0
    # a host with a third core keeps the coordinator off the replicas' cores
    spare = HostSharing(host_slots=3, relay_cpu_s=relay, score_cpu_s=score)
    assert _problem({"cpu": spare}).colocated_latencies(fractions, (0, 0)) is None


def test_the_slowdowns_behind_the_latencies_are_the_hand_solved_ones() -> None:
    c, fractions = 0.4, np.asarray([0.5, 0.5])  # as in the first test: s_a = 1 + 0.06 s_b, s_b = 1 + 0.08 s_a
    a, b = c * 0.15, c * 0.2
    got = _problem({"cpu": HostSharing(c)}).colocated_slowdowns(fractions, (0, 0))
    assert got is not None and [len(s) for s in got] == [1, 1]
    assert [float(s[0]) for s in got] == pytest.approx([(1 + a) / (1 - a * b), (1 + b) / (1 - a * b)], rel=1e-3)
    assert _problem({"cpu": HostSharing(c)}, gpu_b="gpu").colocated_slowdowns(fractions, (0, 0)) is None


def test_the_plan_file_slows_p99_by_the_same_neighbours_as_p95() -> None:
    import pandas as pd

    from exitplan.planner.scenario import describe

    c, fractions = 0.4, np.asarray([0.5, 0.5])
    a, b = c * 0.15, c * 0.2
    s_a, s_b = (1 + a) / (1 - a * b), (1 + b) / (1 - a * b)
    # the perf DB the P99 is read from: P95 as the problem's curves, P99 1.5x the P95 at every load
    rows = [{"model": m, "gpu": "cpu", "tp": 1, "pp": 1, "layers": layers, "qps": q, "e2e_p95_s": base + slope * q,
             "e2e_p99_s": 1.5 * (base + slope * q), "saturated": False, "busy_fraction": busy * q}
            for m, layers, base, slope, busy in (("a", 10, 1.0, 0.5, 0.2), ("b", 20, 2.0, 1.0, 0.15)) for q in GRID]
    problem = _problem({"cpu": HostSharing(c)})
    plan = describe(problem, problem.evaluate_plan(fractions, (0, 0)), np.linspace(0, 1, 101), pd.DataFrame(rows))
    p95 = [m.predicted_p95_s for m in plan.models]
    p99 = [m.predicted_p99_s for m in plan.models]
    assert p95 == pytest.approx([s_a * (1.0 + 0.5 * s_a), s_b * (2.0 + 1.0 * s_b)], rel=1e-3)
    assert p99 == pytest.approx([1.5 * s_a * (1.0 + 0.5 * s_a), 1.5 * s_b * (2.0 + 1.0 * s_b)], rel=1e-3)
    assert all(hi > lo for hi, lo in zip(p99, p95, strict=True))
