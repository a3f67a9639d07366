"""The simulator's vLLM replica on this machine: the ``vllm-cpu`` device ``profile_vllm`` fitted, with the engine
knobs its replicas ran with, so a plan of vLLM replicas here can be predicted like any other."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from exitplan.catalog import Catalog, Gpu, Model
from exitplan.config import EngineParams, Params
from exitplan.errors import ExitplanError
from exitplan.profiling.device import DEVICE_FILE
from exitplan.simulator.cost_model import ReplicaSpec
from exitplan.simulator.replica import ReplicaSimulator

GIB = 2**30



@dataclass(frozen=True)
class VllmDevice:
    """The fitted device of vLLM here.

    Attributes:
        gpu: Its catalog entry (effective FLOP/s and bytes/s).
        step_overhead_s: vLLM's fitted cost per iteration.
        seq_overhead_s: vLLM's fitted cost per sequence per iteration.
        max_num_seqs: Batch limit of the profiled replicas.
        block_size: Their KV block size.
        max_model_len: Their max model length.
        kv_cache_gib: Their KV cache.
    """

    gpu: Gpu
    step_overhead_s: float
    seq_overhead_s: float
    max_num_seqs: int
    block_size: int
    max_model_len: int
    kv_cache_gib: float


def read_vllm_device(path: Path) -> VllmDevice:
    """``device.yaml`` of ``profile_vllm``.

    Raises:
        ExitplanError: when it is missing (run the stage) or malformed.
    """
    if not path.is_file():
        raise ExitplanError(f"no vLLM device profile at {path}: run `dvc repro profile_vllm` first")
    try:
        entry = yaml.safe_load(path.read_text())
        engine = entry["engine"]
        return VllmDevice(Gpu.model_validate(entry["gpu"]), float(entry["step_overhead_s"]),
                          float(entry["seq_overhead_s"]), int(engine["max_num_seqs"]), int(engine["block_size"]),
                          int(engine["max_model_len"]), float(engine["kv_cache_gib"]))
    except (yaml.YAMLError, KeyError, TypeError, ValueError) as exc:
        raise ExitplanError(f"{path} is not a vLLM device profile ({exc}); re-run `dvc repro profile_vllm`") from exc


def vllm_engine(device: VllmDevice) -> EngineParams:
    """The engine knobs of the profiled replicas, as the simulator models vLLM V1 (prefills share iterations with
    decodes within the token budget), with vLLM's fitted overheads; all of the device's memory is the engine's."""
    return EngineParams(max_num_seqs=device.max_num_seqs, block_size=device.block_size,
                        max_model_len=device.max_model_len, max_num_batched_tokens=max(device.max_model_len, 2048),
                        enable_chunked_prefill=True, gpu_memory_utilization=1.0,
                        step_overhead_s=device.step_overhead_s, seq_overhead_s=device.seq_overhead_s, watermark=0.0)


def holding(device: VllmDevice, models: list[Model]) -> Gpu:
    """The device with the memory of one replica: the largest model's weights and the profiled KV cache."""
    weights = max(ReplicaSpec(m, device.gpu).weight_bytes_per_gpu for m in models)
    return device.gpu.model_copy(update={"memory_gib": (weights + device.kv_cache_gib * GIB) / GIB})


def replica_simulator(device: VllmDevice, model: Model, dtype_bytes: int = 2) -> ReplicaSimulator:
    """The simulator of one vLLM CPU replica of ``model``: the fitted device holding exactly the model's weights and
    the replica's KV cache, with :func:`vllm_engine`'s knobs."""
    model = model.model_copy(update={"dtype_bytes": dtype_bytes})
    return ReplicaSimulator(ReplicaSpec(model, holding(device, [model])), vllm_engine(device))


def planning_catalog(params: Params) -> Catalog:
    """The catalog, plus the fitted vLLM device of this machine when ``build_perf_db.vllm_device`` is on (as it
    was swept: holding one replica of the largest profiled model)."""
    from exitplan.catalog import load_catalog

    catalog = load_catalog(params.path(params.catalog))
    if not params.build_perf_db.vllm_device:
        return catalog
    device = read_vllm_device(params.path(params.profile_vllm.output_dir) / DEVICE_FILE)
    models = [catalog.llm(m).model_copy(update={"dtype_bytes": 2}) for m in params.profile_vllm.models]
    gpus = [g for g in catalog.gpus if g.id != device.gpu.id] + [holding(device, models)]
    return Catalog.model_validate({**catalog.model_dump(), "gpus": [g.model_dump() for g in gpus]})
