"""The simulator's vLLM replica here: the fitted device file read back, and a replica holding the profiled cache."""

from __future__ import annotations

import pytest
import yaml

from exitplan.errors import ExitplanError
from exitplan.profiling.device import device_entry
from exitplan.simulator.requests import generate_requests
from exitplan.vllm.simulate import GIB, read_vllm_device, replica_simulator

QWEN = "Qwen/Qwen2.5-Coder-0.5B-Instruct"


def write_device(path, kv_cache_gib=2, dtype="bfloat16"):
    gpu = device_entry("vllm-cpu", 5e11, 2e10, 23.0, 0.1, "test")
    entry = {"gpu": gpu.model_dump(), "step_overhead_s": 0.01, "seq_overhead_s": 0.002,
             "engine": {"max_num_seqs": 16, "block_size": 32, "max_model_len": 4096, "dtype": dtype,
                        "kv_cache_gib": kv_cache_gib}}
    path.write_text(yaml.safe_dump(entry))
    return path


def test_a_replica_holds_the_profiled_kv_cache_and_overheads(tmp_path, catalog) -> None:
    device = read_vllm_device(write_device(tmp_path / "device.yaml"))
    sim = replica_simulator(device, catalog.model(QWEN))
    model = catalog.model(QWEN).model_copy(update={"dtype_bytes": 2})
    kv_per_block = model.kv_bytes_per_token(model.num_layers) * 32
    assert sim.total_blocks == pytest.approx(2 * GIB / kv_per_block, abs=1)
    assert sim.engine.step_overhead_s == 0.01 and sim.engine.max_num_seqs == 16 and sim.engine.block_size == 32
    result = sim.run(generate_requests(20, 0.5, 100, 16))
    assert (result.finish_s > result.first_token_s).all()
    wide = replica_simulator(read_vllm_device(write_device(tmp_path / "fp32.yaml", dtype="float32")),
                             catalog.model(QWEN))  # replicas profiled in float32 (a CPU without bfloat16 kernels)
    assert wide.spec.model.dtype_bytes == 4 and wide.spec.weight_bytes_per_gpu == 2 * sim.spec.weight_bytes_per_gpu


def test_a_missing_or_malformed_profile_names_the_stage(tmp_path) -> None:
    with pytest.raises(ExitplanError, match="run `dvc repro profile_vllm`"):
        read_vllm_device(tmp_path / "absent.yaml")
    (tmp_path / "bad.yaml").write_text("gpu: {}\n")
    with pytest.raises(ExitplanError, match=r"bad.yaml is not a device profile \(gpu.id: required key"):
        read_vllm_device(tmp_path / "bad.yaml")
    ours = yaml.safe_load(write_device(tmp_path / "ours.yaml").read_text())
    del ours["engine"]  # profile_device's: our engine's device, no vLLM knobs
    (tmp_path / "ours.yaml").write_text(yaml.safe_dump(ours))
    with pytest.raises(ExitplanError, match="not a vLLM device profile"):
        read_vllm_device(tmp_path / "ours.yaml")
