"""Invariants of the replica simulator that could fail if its scheduler or cost model were wrong."""

from __future__ import annotations

import numpy as np
import pytest

from exitplan.catalog import Catalog
from exitplan.config import EngineParams
from exitplan.errors import SimulationError
from exitplan.simulator.cost_model import ReplicaSpec
from exitplan.simulator.metrics import summarize
from exitplan.simulator.replica import ReplicaSimulator, RequestSet, kv_capacity_blocks
from exitplan.simulator.requests import generate_requests

LLAMA7 = "meta-llama/Llama-2-7b-hf"
LLAMA70 = "meta-llama/Llama-3.1-70B-Instruct"


def _varied(n: int, qps: float, seed: int = 0) -> RequestSet:
    rng = np.random.default_rng(seed)
    base = generate_requests(n, qps, 1, 1, seed=seed)
    return RequestSet(base.arrival_s, rng.integers(20, 1500, n), rng.integers(2, 500, n))


@pytest.mark.parametrize(("model", "gpu", "tp", "pp"), [
    (LLAMA7, "a100-80g", 1, 1), (LLAMA7, "rtx-4090", 2, 1), (LLAMA70, "h100-sxm", 4, 2), (LLAMA70, "h200", 8, 1),
    ("Qwen/Qwen2.5-Coder-1.5B-Instruct", "rtx-5090", 1, 2),
])
def test_tpot_never_beats_the_roofline_floor(catalog: Catalog, model: str, gpu: str, tp: int, pp: int) -> None:
    spec = ReplicaSpec(catalog.model(model), catalog.gpu(gpu), tp, pp)
    result = ReplicaSimulator(spec).run(_varied(300, 2.0))
    metrics = summarize([result])
    m, g = spec.model, spec.gpu
    floor = m.num_layers * m.layer_params * m.dtype_bytes / (tp * g.hbm_bandwidth_gbps * 1e9)
    r = result.requests
    tpot = (result.finish_s - result.first_token_s)[r.output_len > 1] / (r.output_len[r.output_len > 1] - 1)
    assert tpot.min() >= floor
    assert metrics["tpot_s"]["p50"] < 20 * floor  # and not absurdly slow at light load


def test_littles_law_holds_on_a_long_run(catalog: Catalog) -> None:
    spec = ReplicaSpec(catalog.model(LLAMA7), catalog.gpu("a100-80g"))
    result = ReplicaSimulator(spec).run(_varied(5000, 6.0))
    served = ~result.rejected
    in_service = (result.finish_s - result.scheduled_s)[served]
    throughput = served.sum() / np.nanmax(result.finish_s)
    assert result.mean_running == pytest.approx(throughput * in_service.mean(), rel=0.02)
    assert result.mean_running > 5  # a real batch, not a trivial case
    # the batch while busy: the same integral over the busy time only
    assert result.mean_batch == pytest.approx(result.mean_running * np.nanmax(result.finish_s) / result.busy_s,
                                              rel=1e-3)
    assert result.mean_batch >= result.mean_running


def test_latency_is_monotone_in_load(catalog: Catalog) -> None:
    spec = ReplicaSpec(catalog.model(LLAMA7), catalog.gpu("a100-80g"))
    sim = ReplicaSimulator(spec)
    e2e, ttft = [], []
    for qps in (1, 2, 4, 6, 8, 10, 12):
        metrics = summarize([sim.run(_varied(1500, qps, seed=3))])
        e2e.append(metrics["e2e_s"]["mean"])
        ttft.append(metrics["ttft_s"]["p95"])
    assert all(b >= a for a, b in zip(e2e, e2e[1:], strict=False)), e2e
    assert all(b >= a * 0.98 for a, b in zip(ttft, ttft[1:], strict=False)), ttft
    assert e2e[-1] > 2 * e2e[0]


def test_more_kv_memory_never_hurts(catalog: Catalog) -> None:
    spec = ReplicaSpec(catalog.model(LLAMA7), catalog.gpu("rtx-4090"))
    requests = _varied(1500, 3.0, seed=5)
    previous = None
    for utilisation in (0.7, 0.8, 0.9, 0.95):
        engine = EngineParams(gpu_memory_utilization=utilisation)
        result = ReplicaSimulator(spec, engine).run(requests)
        metrics = summarize([result])
        if previous is not None:
            assert metrics["e2e_s"]["mean"] <= previous["e2e_s"]["mean"] * 1.01
            assert metrics["preemptions"] <= previous["preemptions"]
        previous = metrics
    assert kv_capacity_blocks(spec, EngineParams(gpu_memory_utilization=0.7)) < result.kv_blocks


def test_kv_pressure_preempts_and_still_serves_everyone(catalog: Catalog) -> None:
    spec = ReplicaSpec(catalog.model(LLAMA7), catalog.gpu("rtx-4090"))
    engine = EngineParams(gpu_memory_utilization=0.66)
    result = ReplicaSimulator(spec, engine).run(_varied(600, 50.0))
    assert result.preemptions.sum() > 0
    served = ~result.rejected
    assert np.all(np.isfinite(result.finish_s[served]))
    assert np.all(result.finish_s[served] >= result.first_token_s[served])
    assert np.all(result.first_token_s[served] >= result.requests.arrival_s[served])


@pytest.mark.parametrize("chunked", [False, True])
def test_burst_capacity_test_serves_every_request(catalog: Catalog, chunked: bool) -> None:
    spec = ReplicaSpec(catalog.model(LLAMA7), catalog.gpu("h100-sxm"))
    burst = generate_requests(400, 1.0, 512, 128, arrival="burst")
    result = ReplicaSimulator(spec, EngineParams(enable_chunked_prefill=chunked)).run(burst)
    metrics = summarize([result])
    assert metrics["completed"] == 400
    assert metrics["queue_s"]["p99"] > metrics["queue_s"]["p50"] >= 0
    # every output token is produced: the capacity figure counts 128 per request
    assert metrics["throughput_out_tok_s"] == pytest.approx(metrics["throughput_req_s"] * 128)


def test_chunked_prefill_keeps_decodes_flowing_under_long_prompts(catalog: Catalog) -> None:
    spec = ReplicaSpec(catalog.model(LLAMA7), catalog.gpu("a100-80g"))
    requests = generate_requests(400, 3.0, 3000, 200, seed=2)
    first = summarize([ReplicaSimulator(spec).run(requests)])
    chunked = summarize([ReplicaSimulator(spec, EngineParams(enable_chunked_prefill=True)).run(requests)])
    assert chunked["tpot_s"]["p99"] < first["tpot_s"]["p99"]


def test_a_partial_early_exit_model_is_cheaper_per_token(catalog: Catalog) -> None:
    model, gpu = catalog.model("Qwen/Qwen2.5-Coder-1.5B-Instruct"), catalog.gpu("rtx-4090")
    requests = _varied(400, 20.0)
    full = ReplicaSimulator(ReplicaSpec(model, gpu))
    half = ReplicaSimulator(ReplicaSpec(model, gpu, layers=14))
    assert half.total_blocks > 1.8 * full.total_blocks
    assert summarize([half.run(requests)])["tpot_s"]["p50"] < summarize([full.run(requests)])["tpot_s"]["p50"]


def test_requests_that_can_never_run_are_rejected_not_hung(catalog: Catalog) -> None:
    spec = ReplicaSpec(catalog.model(LLAMA7), catalog.gpu("a100-80g"))
    requests = RequestSet(np.array([0.0, 0.1]), np.array([100, 9000]), np.array([10, 10]))
    result = ReplicaSimulator(spec, EngineParams(max_model_len=4096)).run(requests)
    assert result.rejected.tolist() == [False, True]
    assert summarize([result])["completed"] == 1


@pytest.mark.parametrize(("model", "gpu", "tp", "pp", "message"), [
    (LLAMA70, "rtx-4090", 4, 1, "does not fit on 4 x rtx-4090"),
    (LLAMA70, "h100-sxm", 3, 1, "TP 3 does not divide the 64 attention heads"),
    (LLAMA7, "rtx-5090", 8, 1, "TP 8 exceeds the 4 GPUs"),
])
def test_bad_layouts_are_refused(catalog: Catalog, model: str, gpu: str, tp: int, pp: int, message: str) -> None:
    with pytest.raises(SimulationError, match=message):
        ReplicaSimulator(ReplicaSpec(catalog.model(model), catalog.gpu(gpu), tp, pp))


@pytest.mark.parametrize("chunked", [False, True])
def test_a_request_pays_the_request_overhead_once_before_its_first_token(catalog: Catalog, chunked: bool) -> None:
    spec = ReplicaSpec(catalog.model(LLAMA7), catalog.gpu("a100-80g"))
    requests = RequestSet(np.array([0.0, 30.0]), np.array([500, 40]), np.array([20, 20]))
    runs = [ReplicaSimulator(spec, EngineParams(enable_chunked_prefill=chunked, prompt_overhead_s=cost)).run(requests)
            for cost in (0.0, 0.3)]
    assert runs[1].first_token_s - runs[0].first_token_s == pytest.approx([0.3, 0.3])  # apart: each pays once
    assert runs[1].finish_s - runs[0].finish_s == pytest.approx([0.3, 0.3])
