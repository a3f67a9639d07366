"""Data parallelism: dispatch, and the load split that minimises the largest replica latency."""

from __future__ import annotations

import numpy as np
import pytest

from exitplan.catalog import Catalog
from exitplan.errors import SimulationError
from exitplan.simulator.cluster import dispatch, simulate_cluster
from exitplan.simulator.cost_model import ReplicaSpec
from exitplan.simulator.curve import LatencyCurve, best_split
from exitplan.simulator.metrics import summarize
from exitplan.simulator.perf_db import build_perf_db, curve_of
from exitplan.simulator.replica import ReplicaSimulator
from exitplan.simulator.requests import generate_requests

LLAMA7 = "meta-llama/Llama-2-7b-hf"


def test_round_robin_and_weighted_dispatch() -> None:
    assert dispatch(7, 3).tolist() == [0, 1, 2, 0, 1, 2, 0]
    picks = dispatch(1000, 3, [0.5, 0.3, 0.2])
    assert np.bincount(picks).tolist() == [500, 300, 200]
    assert np.bincount(picks[:10]).tolist() == [5, 3, 2]  # smooth: every prefix follows the weights
    with pytest.raises(SimulationError, match="non-negative"):
        dispatch(10, 2, [1.0, -1.0])


def test_a_skewed_split_is_worse_than_the_even_split_on_equal_replicas(catalog: Catalog) -> None:
    spec = ReplicaSpec(catalog.model(LLAMA7), catalog.gpu("a100-80g"))
    replicas = [ReplicaSimulator(spec), ReplicaSimulator(spec)]
    requests = generate_requests(3000, 14.0, 400, 150, seed=1)
    even = summarize(simulate_cluster(requests, replicas))
    skewed = summarize(simulate_cluster(requests, replicas, weights=[0.75, 0.25]))
    assert even["completed"] == skewed["completed"] == 3000
    assert skewed["e2e_s"]["p95"] > 1.2 * even["e2e_s"]["p95"]


def test_curve_is_monotone_and_invertible() -> None:
    curve = LatencyCurve.from_points(np.array([2.0, 4.0, 6.0, 8.0]), np.array([1.0, 0.9, 2.0, 9.0]),
                                     np.array([False, False, False, True]))
    assert curve.capacity == 6.0
    grid = np.linspace(0, 6, 61)
    assert np.all(np.diff(curve(grid)) >= 0)
    assert np.isinf(curve(7.0))
    assert curve.max_load(1.5) == pytest.approx(5.0)
    assert curve(curve.max_load(1.5)) == pytest.approx(1.5)
    assert curve.max_load(0.5) == 0.0


def test_best_split_balances_heterogeneous_replicas(catalog: Catalog) -> None:
    lengths = (np.array([300, 500, 800]), np.array([100, 200, 150]))
    db = build_perf_db(catalog, [LLAMA7], ["h100-sxm", "a100-80g"], engine=ReplicaSimulator(
        ReplicaSpec(catalog.model(LLAMA7), catalog.gpu("h100-sxm"))).engine, qps_grid=list(range(4, 61, 4)),
        lengths=lengths, num_requests=300, max_gpus_per_replica=1)
    fast = curve_of(db, LLAMA7, "h100-sxm", 1, 1)
    slow = curve_of(db, LLAMA7, "a100-80g", 1, 1)
    assert fast.capacity > slow.capacity
    total = 0.8 * (fast.capacity + slow.capacity)
    loads, latency = best_split(total, [fast, slow])
    assert loads.sum() == pytest.approx(total)
    assert loads[0] > loads[1]  # the faster GPU takes more of the load
    even = max(float(fast(total / 2)), float(slow(total / 2)))
    assert latency <= even
    for skew in (0.6, 0.9):
        assert latency <= max(float(fast(total * skew)), float(slow(total * (1 - skew))))
    loads, latency = best_split(10 * (fast.capacity + slow.capacity), [fast, slow])
    assert np.isinf(latency)
