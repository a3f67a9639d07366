"""The reference probe: it times the layer it says, on the threads it says, and compares only like with like."""

from __future__ import annotations

import pytest
import torch

from exitplan.catalog import Catalog
from exitplan.profiling.probe import Drift, Probe, reference_model, run_probe

QWEN_SMALL, QWEN_LARGE = "Qwen/Qwen2.5-Coder-0.5B-Instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct"


def _probe(prefill: float, decode: float, **changes) -> Probe:
    fields = {"model": QWEN_SMALL, "dtype": "float32", "threads": 1, "prefill_s": prefill, "decode_s": decode,
              "measured_at": 1.8e9, **changes}
    return Probe(**fields)


def test_a_probe_times_a_prefill_chunk_longer_than_a_decode_step_and_restores_the_threads(catalog: Catalog) -> None:
    small = catalog.llm(QWEN_SMALL).model_copy(update={"hidden_size": 512, "intermediate_size": 2048,
                                                         "num_attention_heads": 8, "num_kv_heads": 2})
    torch.set_num_threads(1)
    probe = run_probe(small, "float32", repeats=3, threads=2)
    assert probe.threads == 2 and torch.get_num_threads() == 1
    assert probe.model == QWEN_SMALL and probe.dtype == "float32"
    # 128 rows against 8 through the same 3.7M weights: 16x the arithmetic; the step is at least 2x longer
    assert probe.prefill_s > 2 * probe.decode_s > 0


def test_the_widest_profiled_model_is_probed(catalog: Catalog) -> None:
    assert reference_model(catalog, [QWEN_SMALL, QWEN_LARGE]).name == QWEN_LARGE
    assert reference_model(catalog, [QWEN_SMALL]).name == QWEN_SMALL


def test_drift_is_now_over_reference_and_only_like_work_compares() -> None:
    reference, now = _probe(0.2, 0.05), _probe(0.24, 0.045)
    drift = Drift.between(reference, now)
    assert drift.prefill == pytest.approx(1.2) and drift.decode == pytest.approx(0.9)
    assert drift.worst == pytest.approx(0.2)
    assert Drift.between(reference, _probe(0.19, 0.07)).worst == pytest.approx(0.4)
    both = Drift.mean([drift, Drift(prefill=1.0, decode=1.1)])
    assert both.prefill == pytest.approx(1.1) and both.decode == pytest.approx(1.0)
    assert reference.comparable(now)
    assert not reference.comparable(_probe(0.2, 0.05, threads=2))
    assert not reference.comparable(_probe(0.2, 0.05, dtype="bfloat16"))
    with pytest.raises(ValueError, match="greater than 0"):
        _probe(0.0, 0.05)
