"""``exitplan calibrate``: the drift against the device's reference probe, the device rescaled by it, a stale or
foreign calibration reported as such, and bad files rejected by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from exitplan import REPO_ROOT
from exitplan.catalog import Catalog
from exitplan.cli import app
from exitplan.config import load_params
from exitplan.errors import ExitplanError
from exitplan.profiling.calibration import Calibration, applies, calibrated, read_calibration, rescale, standing
from exitplan.profiling.device import device_entry
from exitplan.profiling.device_file import DeviceProfile, read_device, write_device
from exitplan.profiling.probe import Drift, Probe
from exitplan.simulator.cost_model import CostModel, ReplicaSpec

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
HOUR = 3600.0


def _probe(prefill: float = 0.02, decode: float = 0.005, at: float = 1.8e9) -> Probe:
    return Probe(model=SMOLLM2, dtype="float32", threads=1, prefill_s=prefill, decode_s=decode, measured_at=at)


def _device(probe: Probe | None = None) -> DeviceProfile:
    gpu = device_entry("vllm-cpu", 4e11, 1.5e10, 20.0, 0.1, "test", None)
    return DeviceProfile(gpu=gpu, step_overhead_s=0.004, seq_overhead_s=0.0007, prompt_overhead_s=0.04, probe=probe)


def test_a_device_rescaled_by_the_drift_runs_a_memory_bound_step_that_much_slower(catalog: Catalog) -> None:
    device = _device(_probe())
    slower = rescale(device, Drift(prefill=2.0, decode=1.25))
    assert slower.gpu.bf16_tflops == pytest.approx(device.gpu.bf16_tflops / 2)
    assert slower.gpu.hbm_bandwidth_gbps == pytest.approx(device.gpu.hbm_bandwidth_gbps / 1.25)
    assert slower.step_overhead_s == pytest.approx(0.005) and slower.seq_overhead_s == pytest.approx(0.000875)
    assert slower.prompt_overhead_s == pytest.approx(0.05)
    model = catalog.llm(SMOLLM2).model_copy(update={"dtype_bytes": 4})

    def decode_step(d: DeviceProfile) -> float:
        cost = CostModel(ReplicaSpec(model, d.gpu), d.step_overhead_s, d.seq_overhead_s)
        return cost.step_time(new_tokens=4, attn_pairs=4 * 256, kv_tokens_read=4 * 256, sampled=4)

    assert decode_step(slower) == pytest.approx(1.25 * decode_step(device), rel=1e-6)


def test_standing_reports_the_last_probe_its_age_and_when_it_is_stale() -> None:
    device = _device(_probe(at=1.8e9))
    fresh = standing(device, None, max_age_h=24, now=1.8e9 + 2 * HOUR)
    assert (fresh.since, fresh.stale, fresh.drift) == ("profiling", False, None)
    assert fresh.age_h == pytest.approx(2.0) and "STALE" not in fresh.line()
    old = standing(device, None, max_age_h=24, now=1.8e9 + 30 * HOUR)
    assert old.stale and "STALE: run `exitplan calibrate`" in old.line()
    mine = Calibration(stage="profile_vllm", reference=device.probe, probe=_probe(0.03, 0.006, at=1.8e9 + 29 * HOUR))
    recent = standing(device, mine, max_age_h=24, now=1.8e9 + 30 * HOUR)
    assert (recent.since, recent.stale) == ("calibration", False) and recent.age_h == pytest.approx(1.0)
    assert recent.drift is not None and (recent.drift.prefill, recent.drift.decode) == pytest.approx((1.5, 1.2))
    assert "drift prefill x1.500 decode x1.200" in recent.line()
    assert calibrated(device, mine).gpu.bf16_tflops == pytest.approx(device.gpu.bf16_tflops / 1.5)


def test_a_calibration_of_an_earlier_profile_does_not_apply_to_a_re_profiled_device() -> None:
    earlier = Calibration(stage="profile_vllm", reference=_probe(at=1.7e9), probe=_probe(0.04, 0.01, at=1.7e9 + 1))
    device = _device(_probe(at=1.8e9))
    assert not applies(device, earlier) and calibrated(device, earlier) == device
    assert standing(device, earlier, max_age_h=24, now=1.8e9 + HOUR).since == "profiling"
    with pytest.raises(ExitplanError, match="no reference probe"):
        standing(_device(None), None, max_age_h=24)


@pytest.fixture
def params_file(tmp_path: Path) -> Path:
    tree = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    tree["catalog"] = str(REPO_ROOT / "model_repository" / "catalog.yaml")
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def _calibrate(params_file: Path, *args: str):
    return CliRunner().invoke(app, ["calibrate", "--params", str(params_file), *args])


def test_calibrate_probes_the_profiled_work_and_writes_the_drift(params_file: Path) -> None:
    params = load_params(params_file)
    device_path = params.path(params.profile_vllm.output_dir) / "device.yaml"
    write_device(device_path, _device(_probe(prefill=1e-3, decode=1e-3)))
    result = _calibrate(params_file)
    assert result.exit_code == 0, result.output
    assert "before: calibration: last probe" in result.output and "at profiling" in result.output
    written = read_calibration(params.path(params.calibrate.output_dir) / "profile_vllm.yaml")
    assert written is not None and written.reference == read_device(device_path, "profile_vllm").probe
    assert written.probe.model == SMOLLM2 and written.probe.threads == 1
    assert f"drift since profiling: prefill x{written.drift.prefill:.3f}" in result.output
    again = _calibrate(params_file)
    assert again.exit_code == 0 and "at calibration, drift prefill" in again.output


def test_calibrate_rejects_a_missing_old_or_corrupt_device_and_a_corrupt_calibration_by_name(
        params_file: Path) -> None:
    params = load_params(params_file)
    device_path = params.path(params.profile_vllm.output_dir) / "device.yaml"
    cases = [("no device profile at", "dvc repro profile_vllm")]
    result = _calibrate(params_file)
    assert isinstance(result.exception, ExitplanError) and all(s in str(result.exception) for s in cases[0])
    write_device(device_path, _device(None))
    result = _calibrate(params_file)
    assert isinstance(result.exception, ExitplanError) and "has no reference probe" in str(result.exception)
    device_path.write_text("gpu: [unclosed\n")
    result = _calibrate(params_file)
    assert isinstance(result.exception, ExitplanError) and "is not a device profile" in str(result.exception)
    write_device(device_path, _device(_probe()))
    calibration = params.path(params.calibrate.output_dir) / "profile_vllm.yaml"
    calibration.parent.mkdir(parents=True)
    calibration.write_text("stage: profile_vllm\nreference: 3\n")
    result = _calibrate(params_file)
    assert isinstance(result.exception, ExitplanError)
    assert f"{calibration} is not a calibration" in str(result.exception)
    result = _calibrate(params_file, "--device", "tpu")
    assert isinstance(result.exception, ExitplanError) and "--device 'tpu'" in str(result.exception)
