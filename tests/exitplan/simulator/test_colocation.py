"""Replicas that share a host: the mean field of ``simulator.colocation``, checked against hand-computed values and
against a device that really is slower."""

from __future__ import annotations

import numpy as np
import pytest

from exitplan.catalog import Catalog, SlowdownGrid
from exitplan.config import EngineParams
from exitplan.simulator.colocation import (
    HostSharing,
    StepPace,
    run_slowed,
    simulate_colocated,
    slowdowns,
    slowed_curve,
    stolen_shares,
)
from exitplan.simulator.cost_model import ReplicaSpec
from exitplan.simulator.curve import LatencyCurve
from exitplan.simulator.replica import ReplicaSimulator, RequestSet
from exitplan.simulator.requests import generate_requests

LLAMA7 = "meta-llama/Llama-2-7b-hf"


def _requests(n: int, qps: float, seed: int) -> RequestSet:
    rng = np.random.default_rng(seed)
    base = generate_requests(n, qps, 1, 1, seed=seed)
    return RequestSet(base.arrival_s, rng.integers(20, 800, n), rng.integers(2, 300, n))


def _mean_field(sims, loads, s) -> list:
    """The runs of the mean field's fixed point (each replica slowed by its ``s`` throughout)."""
    return [run_slowed(sim, load, float(x)) for sim, load, x in zip(sims, loads, s, strict=True)]


def test_each_replica_is_slowed_by_the_others_busy_shares() -> None:
    # 1 + c * (sum of the others): 1 + 0.1 * 0.2, 1 + 0.1 * 0.5; a third idle replica is slowed by both
    assert slowdowns([0.5, 0.2, 0.0], 0.1) == pytest.approx([1.02, 1.05, 1.07])
    assert slowdowns([1.0, 1.0], 0.0) == pytest.approx([1.0, 1.0])


def test_the_coordinator_takes_cpu_only_when_every_core_is_busy() -> None:
    sharing = HostSharing(host_slots=2, relay_cpu_s=0.001, score_cpu_s=0.05)
    # relaying replica 0's 100 tok/s finds replica 1 busy half the time, replica 1's 20 tok/s finds replica 0 busy
    # 0.8 of it; scoring 2 req/s finds both busy 0.4 of it: 0.001 * (100 * 0.5 + 20 * 0.8) + 0.05 * 2 * 0.4 = 0.106
    # core-s/s, half from each core, over each one's busy share
    taken = stolen_shares([0.8, 0.5], [100.0, 20.0], 2.0, sharing)
    assert taken == pytest.approx([0.053 / 0.8, 0.053 / 0.5])
    assert slowdowns([0.8, 0.5], 0.0, taken) == pytest.approx([1 / (1 - 0.06625), 1 / (1 - 0.106)])
    # a host with a core to spare (three slots, two replicas) runs the coordinator there
    spare = HostSharing(host_slots=3, relay_cpu_s=0.001, score_cpu_s=0.05)
    assert stolen_shares([0.8, 0.5], [100.0, 20.0], 2.0, spare) == pytest.approx([0.0, 0.0])
    # one replica that fills its host shares its core with every relay and score
    assert stolen_shares([0.5], [40.0], 1.0, HostSharing(host_slots=1, relay_cpu_s=0.001, score_cpu_s=0.05)) == \
        pytest.approx([(0.04 + 0.05 * 0.5) / 0.5])


def test_a_coordinator_on_a_full_host_slows_both_replicas(catalog: Catalog) -> None:
    gpu, model = catalog.gpu("rtx-4090"), catalog.model(LLAMA7)
    sims = [ReplicaSimulator(ReplicaSpec(model, gpu)), ReplicaSimulator(ReplicaSpec(model, gpu))]
    loads = [_requests(200, 3.0, 3), _requests(200, 3.0, 4)]
    costs = {"relay_cpu_s": 0.002, "score_cpu_s": 0.05}
    _, spare = simulate_colocated(sims, loads, HostSharing(host_slots=3, **costs))
    _, full = simulate_colocated(sims, loads, HostSharing(host_slots=2, **costs))
    assert spare == pytest.approx([1.0, 1.0])
    assert np.all(full > 1.01)


def test_a_slowed_run_is_the_run_of_a_device_that_slow(catalog: Catalog) -> None:
    # every cost of the device halved in speed (compute, bandwidth, the engine's overheads): each step takes twice
    # as long, which is what the time-rescaled run claims without touching the device
    gpu = catalog.gpu("a100-80g")
    slow_gpu = gpu.model_copy(update={"bf16_tflops": gpu.bf16_tflops / 2,
                                      "hbm_bandwidth_gbps": gpu.hbm_bandwidth_gbps / 2})
    engine = EngineParams(step_overhead_s=1e-3, seq_overhead_s=1e-4)
    slow_engine = EngineParams(step_overhead_s=2e-3, seq_overhead_s=2e-4)
    model = catalog.model(LLAMA7)
    requests = _requests(120, 6.0, 0)
    rescaled = run_slowed(ReplicaSimulator(ReplicaSpec(model, gpu), engine), requests, 2.0)
    real = ReplicaSimulator(ReplicaSpec(model, slow_gpu), slow_engine).run(requests)
    np.testing.assert_allclose(rescaled.finish_s, real.finish_s, rtol=1e-9)
    np.testing.assert_allclose(rescaled.first_token_s, real.first_token_s, rtol=1e-9)
    assert rescaled.busy_s == pytest.approx(real.busy_s, rel=1e-9)
    assert np.array_equal(rescaled.requests.arrival_s, requests.arrival_s)


def test_colocated_replicas_settle_where_the_slowdowns_match_the_busy_shares(catalog: Catalog) -> None:
    gpu, model = catalog.gpu("rtx-4090"), catalog.model(LLAMA7)
    sims = [ReplicaSimulator(ReplicaSpec(model, gpu)), ReplicaSimulator(ReplicaSpec(model, gpu))]
    loads = [_requests(300, 3.0, 1), _requests(100, 1.0, 2)]  # one span of time, one replica three times as busy
    alone, s0 = simulate_colocated(sims, loads, HostSharing())
    shared, s = simulate_colocated(sims, loads, HostSharing(neighbour_slowdown=0.3))
    assert np.array_equal(s0, [1.0, 1.0])
    start = min(r.arrival_s[0] for r in loads)
    field = _mean_field(sims, loads, s)
    end = max(float(np.nanmax(r.finish_s)) for r in field)
    busy = [r.busy_s / (end - start) for r in field]
    assert s == pytest.approx(slowdowns(busy, 0.3), abs=1e-3)  # the fixed point
    assert s[1] > s[0] > 1.0  # the lightly loaded replica sits beside the busier one: it is slowed more
    for a, b in zip(alone, shared, strict=True):
        assert np.nanmean(b.finish_s - b.requests.arrival_s) > np.nanmean(a.finish_s - a.requests.arrival_s)


def test_each_replica_is_slowed_by_its_own_models_figure(catalog: Catalog) -> None:
    gpu, model = catalog.gpu("rtx-4090"), catalog.model(LLAMA7)
    sims = [ReplicaSimulator(ReplicaSpec(model, gpu)), ReplicaSimulator(ReplicaSpec(model, gpu))]
    loads = [_requests(300, 3.0, 1), _requests(300, 3.0, 2)]
    host = HostSharing(neighbour_slowdown=0.3, model_slowdowns=(("small", 0.6),))
    _, s = simulate_colocated(sims, loads, host, ["small", "large"])  # "large" takes the device's 0.3
    start = min(r.arrival_s[0] for r in loads)
    field = _mean_field(sims, loads, s)
    end = max(float(np.nanmax(r.finish_s)) for r in field)
    busy = [r.busy_s / (end - start) for r in field]
    assert s == pytest.approx(slowdowns(busy, [0.6, 0.3]), abs=1e-3)
    _, same = simulate_colocated(sims, loads, host)  # no models named: the device's figure for both
    assert s[0] > same[0] > 1.0 and s[1] == pytest.approx(same[1], rel=0.02)  # only the small one's figure moved
    assert HostSharing(model_slowdowns=(("small", 0.2),)).slows(2)  # a model's own figure alone slows


def test_a_pairwise_matrix_slows_each_replica_by_its_own_row() -> None:
    # replica 0 loses 0.4 to busy replica 1 and 0.1 to busy replica 2; 1 loses 0.2 to 0; 2 nothing
    c = np.asarray([[9.0, 0.4, 0.1], [0.2, 9.0, 0.0], [0.0, 0.0, 9.0]])  # the diagonal is ignored
    assert slowdowns([0.5, 1.0, 0.5], c) == pytest.approx([1 + 0.4 + 0.05, 1 + 0.1, 1.0])


def test_a_grid_reads_the_slowdown_at_both_mean_batches() -> None:
    grid = SlowdownGrid(batches=[1, 4, 16], values=[[0.3, 0.5, 0.6], [0.0, 0.3, 0.4], [0.0, 0.0, 0.1]])
    host = HostSharing(neighbour_slowdown=0.2, grids=(("small", grid),))
    pairs = host.pairwise(["small", "large"], [2.0, 16.0])
    # own batch 2 is halfway from 1 to 4 in log batch: between rows 0 and 1 at the neighbour's 16
    assert pairs[0, 1] == pytest.approx((0.6 + 0.4) / 2) and pairs[1, 0] == pytest.approx(0.2)  # large: the device's
    assert pairs[0, 0] == pairs[1, 1] == 0.0
    assert host.pairwise(["small", "large"], None)[0, 1] == pytest.approx(grid.mean)  # batches unknown: its mean
    assert host.slows(2) and host.slowdown_of(["small"]) == pytest.approx([grid.mean])


def test_a_replica_at_a_small_batch_is_slowed_more_than_at_a_large_one(catalog: Catalog) -> None:
    gpu, model = catalog.gpu("rtx-4090"), catalog.model(LLAMA7)
    sims = [ReplicaSimulator(ReplicaSpec(model, gpu)), ReplicaSimulator(ReplicaSpec(model, gpu))]
    loads = [_requests(60, 0.2, 1), _requests(600, 6.0, 2)]  # one light replica (batch ~1), one batching
    grid = SlowdownGrid(batches=[1, 16], values=[[0.5, 0.5], [0.0, 0.0]])  # lost at batch 1, nothing at 16
    _, s = simulate_colocated(sims, loads, HostSharing(grids=(("m", grid),)), ["m", "m"])
    start = min(r.arrival_s[0] for r in loads)
    results = _mean_field(sims, loads, s)
    end = max(float(np.nanmax(r.finish_s)) for r in results)
    busy = [r.busy_s / (end - start) for r in results]
    batches = [r.mean_batch for r in results]
    assert batches[0] < 3 < 8 < batches[1]
    expected = [1 + grid.at(batches[0], batches[1]) * busy[1], 1 + grid.at(batches[1], batches[0]) * busy[0]]
    assert s == pytest.approx(expected, abs=2e-3)  # the fixed point, at the runs' own batches
    assert s[0] > 1.1 and s[1] == pytest.approx(1.0, abs=0.01)  # only the light replica loses to its neighbour


def test_a_slowed_curve_reads_the_curve_at_the_inflated_load() -> None:
    curve = LatencyCurve.from_points(np.asarray([1.0, 2.0, 4.0]), np.asarray([1.0, 2.0, 6.0]),
                                     busy=np.asarray([0.2, 0.4, 0.8]))
    slowed = slowed_curve(curve, 2.0)
    assert float(slowed(1.0)) == pytest.approx(2 * float(curve(2.0)))  # 4.0
    assert float(slowed(1.5)) == pytest.approx(2 * 4.0)  # curve(3.0) = 4.0
    assert slowed.capacity == pytest.approx(2.0)
    assert not np.isfinite(float(slowed(2.5)))


def test_busy_shares_are_linear_from_idle_and_full_past_capacity() -> None:
    curve = LatencyCurve.from_points(np.asarray([1.0, 2.0, 4.0]), np.asarray([1.0, 2.0, 6.0]),
                                     busy=np.asarray([0.2, 0.4, 0.8]))
    assert curve.busy_at(0.5) == pytest.approx(0.1)
    assert curve.busy_at(3.0) == pytest.approx(0.6)
    assert curve.busy_at(5.0) == 1.0
    unknown = LatencyCurve.from_points(np.asarray([1.0, 2.0]), np.asarray([1.0, 2.0]))
    assert unknown.busy_at(0.5) == 1.0  # not recorded: a neighbour taken as always busy
    assert unknown.busy_at(0.0) == 0.0


def test_mean_batches_are_interpolated_and_kept_by_a_slowed_curve() -> None:
    curve = LatencyCurve.from_points(np.asarray([1.0, 2.0, 4.0]), np.asarray([1.0, 2.0, 6.0]),
                                     batch=np.asarray([1.2, 2.0, 6.0]))
    assert curve.batch_at(3.0) == pytest.approx(4.0) and curve.batch_at(0.1) == pytest.approx(1.2)
    assert slowed_curve(curve, 2.0).batch_at(1.5) == pytest.approx(4.0)  # read at the inflated load, 3.0
    assert LatencyCurve.from_points(np.asarray([1.0]), np.asarray([1.0])).batch_at(1.0) is None


def test_a_pace_rises_by_each_busy_neighbours_figure() -> None:
    pace = StepPace.of(1.1, [(0.3, np.asarray([[1.0, 3.0], [5.0, 6.0]])), (0.2, np.asarray([[2.0, 5.5]]))])
    expected = {0.0: 1.0, 1.0: 1.3, 2.5: 1.5, 3.0: 1.2, 5.2: 1.5, 5.5: 1.3, 6.0: 1.0, 9.0: 1.0}
    assert [pace.at(t) for t in expected] == pytest.approx([1.1 * v for v in expected.values()])
    assert [pace.next_change(t) for t in (0.0, 2.5, 5.5)] == [1.0, 3.0, 6.0]
    assert pace.next_change(6.0) == float("inf")
    assert StepPace.of(2.0, []).at(4.0) == 2.0


def test_a_paced_replica_runs_at_the_pace_of_each_stretch(catalog: Catalog) -> None:
    sim = ReplicaSimulator(ReplicaSpec(catalog.model(LLAMA7), catalog.gpu("rtx-4090")))
    one = RequestSet(np.asarray([0.0]), np.asarray([200]), np.asarray([200]))
    alone = sim.run(one)
    took = float(alone.finish_s[0])
    assert sim.run(one, StepPace.of(2.0, [])).finish_s[0] == pytest.approx(2 * took, rel=1e-9)
    # slowed by half until took/2: a third of its work done by then (took/2 at 1.5x), the rest at full pace
    half = sim.run(one, StepPace.of(1.0, [(0.5, np.asarray([[0.0, took / 2]]))]))
    assert half.finish_s[0] == pytest.approx(took / 2 + (took - took / 3), rel=0.02)
    assert alone.busy_intervals.tolist() == [[0.0, pytest.approx(took)]]


def test_timed_replicas_busy_at_different_times_do_not_slow_each_other(catalog: Catalog) -> None:
    gpu, model = catalog.gpu("rtx-4090"), catalog.model(LLAMA7)
    sims = [ReplicaSimulator(ReplicaSpec(model, gpu)), ReplicaSimulator(ReplicaSpec(model, gpu))]
    one = RequestSet(np.asarray([0.0]), np.asarray([200]), np.asarray([100]))
    took = float(sims[0].run(one).finish_s[0])
    apart = [one, RequestSet(np.asarray([3 * took]), np.asarray([200]), np.asarray([100]))]
    field, s = simulate_colocated(sims, apart, HostSharing(neighbour_slowdown=0.5))
    assert s[0] > 1.1 and field[0].finish_s[0] > 1.1 * took  # the mean field spreads the neighbour over the run
    results, _ = simulate_colocated(sims, apart, HostSharing(neighbour_slowdown=0.5), timed=True)
    assert results[0].finish_s[0] == pytest.approx(took) and results[1].finish_s[0] == pytest.approx(4 * took)
    together = [one, one]  # the same request on both at once: each loses the whole 0.5 throughout
    both, _ = simulate_colocated(sims, together, HostSharing(neighbour_slowdown=0.5), timed=True)
    assert [r.finish_s[0] for r in both] == pytest.approx([1.5 * took] * 2, rel=0.02)
