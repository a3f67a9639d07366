"""device.yaml through its model: written and read back equal, a bad file named with its problem."""

from __future__ import annotations

import pytest

from exitplan.errors import ExitplanError
from exitplan.profiling.device import device_entry
from exitplan.profiling.device_file import DeviceProfile, ReplicaKnobs, read_device, write_device


def _profile(engine: ReplicaKnobs | None = None) -> DeviceProfile:
    gpu = device_entry("local-cpu", 4e11, 1.5e10, 20.0, 0.1, "test", {1: 1.7, 8: 1.0})
    return DeviceProfile(gpu=gpu, step_overhead_s=0.004, seq_overhead_s=0.0007, engine=engine)


def test_a_profile_reads_back_equal_with_or_without_engine_knobs(tmp_path) -> None:
    knobs = ReplicaKnobs(max_num_seqs=16, block_size=32, max_model_len=4096, dtype="bfloat16", kv_cache_gib=2.0)
    for profile in (_profile(), _profile(knobs)):
        path = write_device(tmp_path / "device.yaml", profile)
        assert read_device(path, "profile_device") == profile
        assert path.read_bytes() == write_device(tmp_path / "again.yaml", profile).read_bytes()


def test_missing_and_bad_profiles_name_the_file_and_the_stage(tmp_path) -> None:
    with pytest.raises(ExitplanError, match=r"no device profile at .*absent.yaml: run `dvc repro profile_device`"):
        read_device(tmp_path / "absent.yaml", "profile_device")
    path = write_device(tmp_path / "device.yaml", _profile())
    path.write_text(path.read_text().replace("step_overhead_s: 0.004", "step_overhead_s: -1.0"))
    with pytest.raises(ExitplanError, match=r"device.yaml is not a device profile \(step_overhead_s.*re-run"):
        read_device(path, "profile_device")
    (tmp_path / "junk.yaml").write_text("gpu: [unclosed\n")
    with pytest.raises(ExitplanError, match="junk.yaml is not a device profile"):
        read_device(tmp_path / "junk.yaml", "profile_vllm")


def test_the_fitted_rates_and_the_request_overhead_read_back_and_older_files_read_as_none(tmp_path) -> None:
    gpu = device_entry("vllm-cpu", 2e11, 4e10, 20.0, 0.1, "test", {1: 0.3, 16: 1.0}, overlap=False,
                       attention=0.42, kv_memory=0.08)
    gpu = gpu.model_copy(update={"model_compute": {"a/small": 0.98, "a/large": 1 / 0.98}})
    profile = DeviceProfile(gpu=gpu, step_overhead_s=0.002, seq_overhead_s=0.001, prompt_overhead_s=0.049)
    path = write_device(tmp_path / "device.yaml", profile)
    assert read_device(path, "profile_vllm") == profile
    path.write_text(path.read_text().replace("prompt_overhead_s: 0.049\n", ""))
    assert read_device(path, "profile_vllm").prompt_overhead_s == 0.0  # written before the overhead was fitted
