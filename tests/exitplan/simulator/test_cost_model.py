"""The cost model: size-dependent memory bandwidth (``Efficiency.memory_scale``), roofline or sum (``overlap``)."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from exitplan.catalog import Catalog, Efficiency
from exitplan.simulator.cost_model import CostModel, ReplicaSpec

MODEL = "Qwen/Qwen2.5-Coder-1.5B-Instruct"


def _cost(catalog: Catalog, scale: dict[int, float] | None) -> CostModel:
    gpu = catalog.gpu("rtx-4090")
    gpu = gpu.model_copy(update={"efficiency": gpu.efficiency.model_copy(update={"memory_scale": scale})})
    return CostModel(ReplicaSpec(catalog.model(MODEL), gpu), step_overhead_s=0.0)


def test_memory_scale_speeds_up_small_decode_steps_only(catalog: Catalog) -> None:
    plain, scaled = _cost(catalog, None), _cost(catalog, {1: 2.0, 8: 1.0})
    one = [plain.step_time(1, 100, 100, 1), scaled.step_time(1, 100, 100, 1)]
    assert one[1] == pytest.approx(one[0] / 2)  # decode of one token is memory-bound: twice the bandwidth
    assert scaled.step_time(8, 800, 800, 8) == pytest.approx(plain.step_time(8, 800, 800, 8))
    assert scaled.step_time(32, 800, 800, 8) == pytest.approx(plain.step_time(32, 800, 800, 8))  # edge value
    mid = plain.step_time(4.5, 450, 450, 4.5) / scaled.step_time(4.5, 450, 450, 4.5)
    assert mid == pytest.approx(1.5)  # interpolated between 1 (x2) and 8 (x1)
    tokens = np.array([1.0, 3.0, 8.0, 20.0])
    vector = scaled.step_times(tokens, tokens * 100, tokens * 100, tokens)
    assert vector == pytest.approx([scaled.step_time(n, n * 100, n * 100, n) for n in tokens])


@pytest.mark.parametrize("scale", [{0: 1.0}, {1: 0.0}, {4: -2.0}])
def test_bad_memory_scales_are_refused(scale: dict[int, float]) -> None:
    with pytest.raises(ValidationError, match="memory_scale"):
        Efficiency(compute=0.5, memory=0.5, link=0.5, source="test", memory_scale=scale)


def test_a_device_that_does_not_overlap_pays_compute_plus_memory(catalog: Catalog) -> None:
    gpu = catalog.gpu("rtx-4090")
    spec = ReplicaSpec(catalog.model(MODEL), gpu)
    serial = gpu.model_copy(update={"efficiency": gpu.efficiency.model_copy(update={"overlap": False})})
    roofline, summed = CostModel(spec, 0.0), CostModel(ReplicaSpec(catalog.model(MODEL), serial), 0.0)
    c = roofline._c
    for tokens in (1.0, 64.0, 2048.0):  # memory-bound, balanced, compute-bound
        compute = (tokens * c["layer_flops"] + c["head_flops"] + tokens * c["attn_flops"]) / c["flops_per_s"]
        memory = (c["weight_bytes"] + c["head_bytes"] + 2 * tokens * c["kv_bytes"]) / c["bytes_per_s"]
        assert roofline.step_time(tokens, tokens, tokens, 1) == pytest.approx(max(compute, memory))
        assert summed.step_time(tokens, tokens, tokens, 1) == pytest.approx(compute + memory)
        assert summed.step_times(np.array([tokens]), np.array([tokens]), np.array([tokens]),
                                 np.array([1.0]))[0] == pytest.approx(compute + memory)


def _variant(catalog: Catalog, **update: object) -> CostModel:
    gpu = catalog.gpu("rtx-4090")
    efficiency = gpu.efficiency.model_copy(update={"overlap": False, **update})
    return CostModel(ReplicaSpec(catalog.model(MODEL), gpu.model_copy(update={"efficiency": efficiency})), 0.0)


def test_attention_and_kv_reads_run_at_their_own_rates(catalog: Catalog) -> None:
    plain, slow = _variant(catalog), _variant(catalog, attention=0.5, kv_memory=0.25)
    c = plain._c
    # A decode step of 8 sequences over 4,000 context tokens: the pairs cost twice, the KV read four times as long.
    extra = 4008 * c["attn_flops"] / c["flops_per_s"] + 3 * 4000 * c["kv_bytes"] / c["bytes_per_s"]
    assert slow.step_time(8, 4008, 4000, 8) - plain.step_time(8, 4008, 4000, 8) == pytest.approx(extra)
    # A prefill of 1,000 new tokens reads no KV: only its 500,500 pairs slow down.
    pairs = 1000 * 1001 / 2
    gap = slow.prefill_time(np.array([1000]), np.array([0])) - plain.prefill_time(np.array([1000]), np.array([0]))
    assert gap == pytest.approx(pairs * c["attn_flops"] / c["flops_per_s"])
    assert slow.decode_times(8, 4000, 3) == pytest.approx([slow.step_time(8, 4008 + 8 * i, 4000 + 8 * i, 8)
                                                           for i in range(3)])


@pytest.mark.parametrize("field", ["attention", "kv_memory"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("nan")])
def test_bad_attention_or_kv_rates_are_refused(field: str, value: float) -> None:
    with pytest.raises(ValidationError, match=field):
        Efficiency(compute=0.5, memory=0.5, link=0.5, source="test", **{field: value})


def test_a_models_compute_multiplier_applies_to_that_model_only(catalog: Catalog) -> None:
    gpu = catalog.gpu("rtx-4090").model_copy(update={"model_compute": {MODEL: 2.0}})
    other = "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    named, plain = (CostModel(ReplicaSpec(catalog.model(MODEL), g), 0.0) for g in (gpu, catalog.gpu("rtx-4090")))
    assert named._c["flops_per_s"] == pytest.approx(2 * plain._c["flops_per_s"])
    assert named.prefill_time(np.array([4096]), np.array([0])) < plain.prefill_time(np.array([4096]), np.array([0]))
    unnamed = CostModel(ReplicaSpec(catalog.model(other), gpu), 0.0)
    assert unnamed._c["flops_per_s"] == CostModel(ReplicaSpec(catalog.model(other), catalog.gpu("rtx-4090")),
                                                  0.0)._c["flops_per_s"]


def test_the_request_overhead_is_paid_by_each_prompt_that_starts_in_the_step(catalog: Catalog) -> None:
    spec = ReplicaSpec(catalog.model(MODEL), catalog.gpu("rtx-4090"))
    plain, paying = CostModel(spec, 1e-3), CostModel(spec, 1e-3, 0.0, 0.25)
    chunks, starts = np.array([100, 200, 300]), np.array([0, 0, 512])  # two prompts start, one continues
    assert paying.prefill_time(chunks, starts, 900.0, 3) - plain.prefill_time(chunks, starts, 900.0, 3) == \
        pytest.approx(0.5)
    assert paying.decode_times(4, 400.0, 5) == pytest.approx(plain.decode_times(4, 400.0, 5))  # decodes never pay
