"""``device.yaml``: the device a profiling stage fitted, as one typed model that its writer and readers go through.

``profile_device`` writes the engine's device (this machine through our runner), ``profile_vllm`` vLLM's (with the
knobs its replicas ran with); the perf DB, the planning catalog and the benchmarks read them back.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import Field

from exitplan.atomic import write_atomic
from exitplan.catalog import Gpu
from exitplan.errors import ConfigError, ExitplanError
from exitplan.kinds import Dtype
from exitplan.profiling.probe import Probe
from exitplan.yaml_model import StrictModel, load_yaml_model


class ReplicaKnobs(StrictModel):
    """The engine knobs of the replicas a device was profiled with (vLLM's)."""

    max_num_seqs: int = Field(ge=1)
    """Batch limit."""

    block_size: int = Field(ge=1)
    """KV block size (tokens)."""

    max_model_len: int = Field(ge=1)
    """Max model length (tokens)."""

    dtype: Dtype
    """Weights and activations."""

    kv_cache_gib: float = Field(gt=0)
    """KV cache of each replica (GiB)."""


class DeviceProfile(StrictModel):
    """A fitted device: its catalog entry and the engine's overheads on it."""

    gpu: Gpu
    """The catalog entry (effective FLOP/s, bytes/s, memory, price)."""

    step_overhead_s: float = Field(ge=0)
    """Fitted cost per iteration (seconds)."""

    seq_overhead_s: float = Field(ge=0)
    """Fitted cost per sequence per iteration (seconds)."""

    prompt_overhead_s: float = Field(default=0.0, ge=0)
    """Fitted cost per request, in the iteration that starts its prompt (seconds; 0 in profiles written before it
    was fitted)."""

    engine: ReplicaKnobs | None = None
    """The knobs of the replicas profiled (``profile_vllm``; none for our own engine)."""

    probe: Probe | None = None
    """The reference probe, taken right after the profiling (:mod:`exitplan.profiling.probe`): what a later
    calibration measures the machine's drift against (none in profiles written before probes existed)."""


def write_device(path: Path, profile: DeviceProfile) -> Path:
    """Write ``profile`` as YAML, atomically."""
    text = yaml.safe_dump(profile.model_dump(), sort_keys=False)
    return write_atomic(path, lambda tmp: Path(tmp).write_text(text))


def read_device(path: Path, stage: str) -> DeviceProfile:
    """The device profile at ``path``, written by ``stage``.

    Raises:
        ExitplanError: it is missing (run the stage) or is not a device profile (re-run it).
    """
    if not path.is_file():
        raise ExitplanError(f"no device profile at {path}: run `dvc repro {stage}` first")
    try:
        return load_yaml_model(path, DeviceProfile)
    except ConfigError as exc:
        raise ExitplanError(f"{path} is not a device profile ({'; '.join(exc.problems)}); re-run "
                            f"`dvc repro {stage}`") from exc
