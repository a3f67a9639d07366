"""``exitplan calibrate``: the machine's drift since a device was profiled, measured by the reference probe, and the
device rescaled by it.

A profiling stage stores a probe with the device it fits (:attr:`DeviceProfile.probe`). Calibrating re-runs the same
probe (:mod:`exitplan.profiling.probe`) and writes ``<calibrate.output_dir>/<stage>.yaml``: the reference it was
compared with, the new probe, hence the drift. The simulator's checks against the real engines (``fleet_vs_plan``,
``simulator_vs_engine``) read the device through :func:`calibrated` and say how old the last probe is
(:func:`standing`). The DVC pipeline keeps the device as profiled, so ``dvc repro`` stays reproducible and a
calibration never re-runs a stage; when the drift is large, re-profiling (``dvc repro profile_vllm``) is what makes
the plans on the machine's present speed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import yaml

from exitplan.artifacts import calibration_path, engine_device_path, vllm_device_path
from exitplan.atomic import write_atomic
from exitplan.errors import ConfigError, ExitplanError
from exitplan.profiling.device_file import DeviceProfile, read_device
from exitplan.profiling.probe import Drift, Probe, run_probe
from exitplan.yaml_model import StrictModel, load_yaml_model

if TYPE_CHECKING:
    from exitplan.catalog import Catalog
    from exitplan.config import Params

Stage = Literal["profile_vllm", "profile_device"]
"""The stages that fit a device of this machine."""

DEVICE_PATHS = {"profile_vllm": vllm_device_path, "profile_device": engine_device_path}
"""Where each stage's device lies."""


class Calibration(StrictModel):
    """One calibration: the probe now against the profiled device's reference probe."""

    stage: Stage
    """The stage whose device this calibrates."""

    reference: Probe
    """The device's probe it was compared with (a re-profiled device has another, and this calibration no longer
    applies to it)."""

    probe: Probe
    """The probe taken when calibrating."""

    @property
    def drift(self) -> Drift:
        """How much slower the machine is now than when the device was profiled."""
        return Drift.between(self.reference, self.probe)


@dataclass(frozen=True)
class Standing:
    """How old the device's last probe is, and whether that is too old."""

    age_h: float
    """Hours since the last probe."""

    since: Literal["profiling", "calibration"]
    """Which probe that was."""

    stale: bool
    """Older than ``calibrate.max_age_h``."""

    drift: Drift | None
    """The last calibration's drift (none when the device has not been calibrated since profiling)."""

    def line(self) -> str:
        """One line for a report: age, source and drift, and what to run when stale."""
        drift = "" if self.drift is None else (f", drift prefill x{self.drift.prefill:.3f} decode "
                                               f"x{self.drift.decode:.3f}")
        advice = " - STALE: run `exitplan calibrate`" if self.stale else ""
        return f"calibration: last probe {self.age_h:.1f} h ago, at {self.since}{drift}{advice}"


def probe_as(reference: Probe, catalog: Catalog, repeats: int) -> Probe:
    """The probe of ``reference``'s work (its model, precision and threads), run now."""
    return run_probe(catalog.llm(reference.model), reference.dtype, repeats, reference.threads)


def read_calibration(path: Path) -> Calibration | None:
    """The calibration at ``path``; none when there is none yet.

    Raises:
        ExitplanError: the file is not a calibration (it names the file; re-run ``exitplan calibrate``).
    """
    if not path.is_file():
        return None
    try:
        return load_yaml_model(path, Calibration)
    except ConfigError as exc:
        raise ExitplanError(f"{path} is not a calibration ({'; '.join(exc.problems)}); delete it and run "
                            f"`exitplan calibrate`") from exc


def device_of(params: Params, stage: Stage) -> DeviceProfile:
    """The device ``stage`` fitted, with its reference probe.

    Raises:
        ExitplanError: no device, not a device file, or one without a probe (written before probes: re-profile).
    """
    path = DEVICE_PATHS[stage](params)
    device = read_device(path, stage)
    if device.probe is None:
        raise ExitplanError(f"{path} has no reference probe (profiled before probes existed): re-run "
                            f"`dvc repro {stage}`")
    return device


def calibrate(params: Params, stage: Stage, catalog: Catalog) -> Calibration:
    """Run the probe of ``stage``'s device now and write the calibration, atomically."""
    device = device_of(params, stage)
    assert device.probe is not None  # device_of checked
    calibration = Calibration(stage=stage, reference=device.probe,
                              probe=probe_as(device.probe, catalog, params.calibrate.repeats))
    text = yaml.safe_dump(calibration.model_dump(), sort_keys=False)
    write_atomic(calibration_path(params, stage), lambda tmp: Path(tmp).write_text(text))
    return calibration


def applies(device: DeviceProfile, calibration: Calibration | None) -> bool:
    """Whether ``calibration`` was measured against this device's reference probe."""
    return calibration is not None and device.probe is not None and calibration.reference == device.probe


def standing(device: DeviceProfile, calibration: Calibration | None, max_age_h: float,
             now: float | None = None) -> Standing:
    """How old ``device``'s last probe is: the calibration's where it applies, else the profiling's."""
    if device.probe is None:
        raise ExitplanError("the device profile has no reference probe: re-profile it")
    now = time.time() if now is None else now
    if applies(device, calibration):
        assert calibration is not None
        age = (now - calibration.probe.measured_at) / 3600
        return Standing(age, "calibration", age > max_age_h, calibration.drift)
    age = (now - device.probe.measured_at) / 3600
    return Standing(age, "profiling", age > max_age_h, None)


def rescale(device: DeviceProfile, drift: Drift) -> DeviceProfile:
    """``device`` on a machine ``drift`` slower: compute by the prefill probe's ratio, memory bandwidth and the
    per-step, per-sequence and per-request overheads by the decode probe's."""
    gpu = device.gpu.model_copy(update={"bf16_tflops": device.gpu.bf16_tflops / drift.prefill,
                                        "hbm_bandwidth_gbps": device.gpu.hbm_bandwidth_gbps / drift.decode})
    return device.model_copy(update={"gpu": gpu, "step_overhead_s": device.step_overhead_s * drift.decode,
                                     "seq_overhead_s": device.seq_overhead_s * drift.decode,
                                     "prompt_overhead_s": device.prompt_overhead_s * drift.decode})


def calibrated(device: DeviceProfile, calibration: Calibration | None) -> DeviceProfile:
    """``device`` rescaled by ``calibration``'s drift where it applies to it, else as profiled."""
    return rescale(device, calibration.drift) if calibration is not None and applies(device, calibration) else device
