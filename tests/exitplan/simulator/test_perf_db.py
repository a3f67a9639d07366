"""The perf DB's saturation test: long requests that a replica keeps up with are not called saturated."""

from __future__ import annotations

import numpy as np

from exitplan.catalog import Catalog
from exitplan.config import EngineParams
from exitplan.simulator.cost_model import ReplicaSpec
from exitplan.simulator.perf_db import SATURATION, Layout, steady_ratio, sweep_layout
from exitplan.simulator.replica import ReplicaSimulator, RequestSet
from exitplan.workload.arrivals import poisson_arrivals

LLAMA7 = "meta-llama/Llama-2-7b-hf"


def _run(catalog: Catalog, qps: float, output_len: int, n: int = 150, gpu: str = "h100-sxm"):
    spec = ReplicaSpec(catalog.model(LLAMA7), catalog.gpu(gpu), 1, 1)
    arrivals = poisson_arrivals(n, qps, np.random.default_rng(0))
    return ReplicaSimulator(spec, EngineParams()).run(RequestSet(arrivals, np.full(n, 40), np.full(n, output_len)))


def test_long_requests_at_a_sustained_load_are_not_saturated(catalog: Catalog) -> None:
    result = _run(catalog, qps=4.0, output_len=600)
    span = np.nanmax(result.finish_s) - result.requests.arrival_s.min()
    arrived_rate = (len(result.finish_s) - 1) / np.ptp(result.requests.arrival_s)
    # the overall rate counts the ~4 s drain of the last requests: it reads below 95% of the arrivals
    assert len(result.finish_s) / span < SATURATION * arrived_rate
    assert steady_ratio(result) >= SATURATION


def test_an_overloaded_replica_is_saturated(catalog: Catalog) -> None:
    # an RTX 4090 carries ~6 req/s of these: at 40 req/s its queue grows for the whole run
    light = _run(catalog, qps=2.0, output_len=600, n=300, gpu="rtx-4090")
    heavy = _run(catalog, qps=40.0, output_len=600, n=300, gpu="rtx-4090")
    assert steady_ratio(heavy) < SATURATION <= steady_ratio(light)


def test_a_sweep_stops_simulating_after_saturation(catalog: Catalog) -> None:
    lengths = (np.full(50, 40), np.full(50, 300))
    rows = sweep_layout(catalog.model(LLAMA7), catalog.gpu("rtx-4090"), Layout("rtx-4090", 1, 1, 32),
                        EngineParams(), [2, 200, 400], lengths, 200, 0)
    assert [r["saturated"] for r in rows] == [False, True, True]
    assert np.isnan(rows[2]["e2e_p95_s"]) and not np.isnan(rows[1]["e2e_p95_s"])


def test_a_sweep_records_how_busy_the_replica_is_at_each_load(catalog: Catalog) -> None:
    lengths = (np.full(50, 40), np.full(50, 300))
    rows = sweep_layout(catalog.model(LLAMA7), catalog.gpu("rtx-4090"), Layout("rtx-4090", 1, 1, 32),
                        EngineParams(), [0.05, 0.5, 2.0], lengths, 200, 0)
    busy = [r["busy_fraction"] for r in rows]
    assert 0 < busy[0] < busy[1] < busy[2] <= 1.0
    batch = [r["mean_batch"] for r in rows]  # the running batch while busy grows with the load, from about 1
    assert 1.0 <= batch[0] < 1.5 and batch[0] < batch[1] < batch[2]
    # at a light load: at most load x mean run time (Little's law: the mean number in the system, which counts
    # overlapping requests once each), and not far below it when few overlap
    in_system = 0.05 * rows[0]["e2e_mean_s"]
    assert 0.7 * in_system < busy[0] <= in_system


def test_partial_layers_are_swept_beside_the_fractions_and_beyond_the_model_refused(catalog: Catalog) -> None:
    from exitplan.errors import SimulationError
    from exitplan.simulator.perf_db import layer_counts

    model = catalog.llm("Qwen/Qwen2.5-Coder-0.5B-Instruct")  # 24 layers
    assert layer_counts(model, [0.5, 1.0], [20, 22, 12]) == [12, 20, 22, 24]
    try:
        layer_counts(model, [1.0], [30])
    except SimulationError as exc:
        assert "24 layers" in str(exc) and "[30]" in str(exc)
    else:
        raise AssertionError("a cut beyond the model was accepted")
