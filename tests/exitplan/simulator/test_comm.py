"""TP's all-reduces and PP's sends (``simulator.comm``) against hand-computed values, and their effect on decode."""

from __future__ import annotations

import numpy as np
import pytest

from exitplan.catalog import Catalog
from exitplan.simulator.comm import Interconnect
from exitplan.simulator.cost_model import CostModel, ReplicaSpec

LLAMA_70B = "meta-llama/Llama-2-70b-hf"  # 80 layers, hidden 8192, bfloat16: 16,384 activation bytes per token
LLAMA_13B = "meta-llama/Llama-2-13b-hf"  # 40 layers, hidden 5120: 10,240 bytes per token


def _cost(catalog: Catalog, model: str, gpu: str, tp: int = 1, pp: int = 1) -> CostModel:
    return CostModel(ReplicaSpec(catalog.model(model), catalog.gpu(gpu), tp, pp))


# Decode of 8 sequences on H100 NVLink: 131,072-byte messages take vLLM's custom all-reduce, 3.3 us + 0.37 us per
# GPU beyond two + 2(p-1)/p x 131072 B / (0.25 x 300 GB/s): TP2 3.3 + 1.7476 = 5.0476 us, TP4 3.3 + 0.74 + 2.6214
# = 6.6614 us, TP8 3.3 + 2.22 + 3.0583 = 8.5783 us (NCCL's ring: 10 us + ... is slower), x 2 all-reduces x 80 layers.
@pytest.mark.parametrize(("tp", "step_ms"), [(2, 0.80762), (4, 1.06583), (8, 1.37253)])
def test_70b_decode_all_reduces_on_nvlink_match_hand_computed_values(catalog: Catalog, tp: int,
                                                                     step_ms: float) -> None:
    assert _cost(catalog, LLAMA_70B, "h100-sxm", tp).comm_time(8) * 1e3 == pytest.approx(step_ms, rel=1e-4)


def test_a_prefill_chunk_above_the_custom_buffer_takes_nccls_ring(catalog: Catalog) -> None:
    # 2048 tokens x 16384 B = 32 MiB > 8 MiB: 10 us + 1.75 x 33554432 B / (0.7 x 300 GB/s) = 289.62 us per all-reduce.
    link = Interconnect.of(catalog.gpu("h100-sxm"))
    assert link.all_reduce_s(2048 * 16384, 8) * 1e6 == pytest.approx(289.62, rel=1e-4)
    assert link.ring.seconds(8 * 16384, 8) > link.custom.seconds(8 * 16384, 8)  # type: ignore[union-attr]


def test_pcie_all_reduces_are_nccls_and_grow_per_gpu(catalog: Catalog) -> None:
    # 13B, 8 tokens = 81,920 B on L40S (PCIe 4.0, 32 GB/s x 0.7): 6.6 us + (p-2) x 6.4 us + 2(p-1)/p x 3.657 us;
    # TP2 10.257 us, TP4 24.886 us; x 2 x 40 layers. A PP2 send: 6.6 us + 3.657 us.
    link = Interconnect.of(catalog.gpu("l40s"))
    assert link.custom is None
    assert _cost(catalog, LLAMA_13B, "l40s", 2).comm_time(8) * 1e3 == pytest.approx(0.82057, rel=1e-4)
    assert _cost(catalog, LLAMA_13B, "l40s", 4).comm_time(8) * 1e3 == pytest.approx(1.99086, rel=1e-4)
    assert _cost(catalog, LLAMA_13B, "l40s", 1, 2).comm_time(8) * 1e6 == pytest.approx(10.257, rel=1e-4)


def test_communication_makes_70b_decode_scale_sublinearly_with_tp(catalog: Catalog) -> None:
    costs = {tp: _cost(catalog, LLAMA_70B, "h100-sxm", tp) for tp in (2, 4, 8)}
    step = {tp: c.decode_times(8, 8 * 500, 1)[0] for tp, c in costs.items()}
    share = {tp: costs[tp].comm_time(8) / step[tp] for tp in step}
    assert share[2] < share[4] < share[8]  # the weights per GPU shrink, the all-reduces do not
    assert 0.02 < share[2] < 0.05 and 0.1 < share[8] < 0.25
    assert step[2] / step[8] < 3.2  # four times the GPUs, well under four times the speed


def test_the_vector_and_scalar_paths_agree_with_communication(catalog: Catalog) -> None:
    cost = _cost(catalog, LLAMA_70B, "h100-sxm", 4, 2)
    tokens = np.array([1.0, 8.0, 512.0, 4096.0])  # the last two cross the 8 MiB custom buffer at TP4
    vector = cost.step_times(tokens, tokens * 100, tokens * 100, np.minimum(tokens, 8))
    scalar = [cost.step_time(n, n * 100, n * 100, min(n, 8)) for n in tokens]
    assert vector == pytest.approx(scalar)
    assert cost.comm_time(tokens) == pytest.approx([float(cost.comm_time(n)) for n in tokens])
