"""The simulator's vLLM replica on this machine: the ``vllm-cpu`` device ``profile_vllm`` fitted, with the engine
knobs its replicas ran with, so a plan of vLLM replicas here can be predicted like any other."""

from __future__ import annotations

from pathlib import Path

from exitplan.artifacts import vllm_device_path
from exitplan.catalog import Catalog, Gpu, Model
from exitplan.config import EngineParams, Params
from exitplan.errors import ExitplanError
from exitplan.kinds import DTYPE_BYTES
from exitplan.profiling.device_file import DeviceProfile, ReplicaKnobs, read_device
from exitplan.simulator.cost_model import PARTIAL_EXIT_LAYERS, ReplicaSpec
from exitplan.simulator.replica import ReplicaSimulator

GIB = 2**30



def read_vllm_device(path: Path) -> DeviceProfile:
    """``device.yaml`` of ``profile_vllm`` (with the knobs its replicas ran with).

    Raises:
        ExitplanError: when it is missing (run the stage) or is not a vLLM device profile.
    """
    device = read_device(path, "profile_vllm")
    if device.engine is None:
        raise ExitplanError(f"{path} is not a vLLM device profile (no engine knobs); re-run `dvc repro profile_vllm`")
    return device


def _knobs(device: DeviceProfile) -> ReplicaKnobs:
    if device.engine is None:
        raise ExitplanError(f"device {device.gpu.id} has no vLLM engine knobs (not written by profile_vllm)")
    return device.engine


def vllm_engine(device: DeviceProfile) -> EngineParams:
    """The engine knobs of the profiled replicas, as the simulator models vLLM V1 (prefills share iterations with
    decodes within the token budget), with vLLM's fitted overheads; all of the device's memory is the engine's."""
    knobs = _knobs(device)
    return EngineParams(max_num_seqs=knobs.max_num_seqs, block_size=knobs.block_size,
                        max_model_len=knobs.max_model_len, max_num_batched_tokens=max(knobs.max_model_len, 2048),
                        enable_chunked_prefill=True, gpu_memory_utilization=1.0,
                        step_overhead_s=device.step_overhead_s, seq_overhead_s=device.seq_overhead_s,
                        prompt_overhead_s=device.prompt_overhead_s, watermark=0.0)


def holding(device: DeviceProfile, models: list[Model]) -> Gpu:
    """The device with the memory of one replica: the largest model's weights and the profiled KV cache."""
    weights = max(ReplicaSpec(m, device.gpu).weight_bytes_per_gpu for m in models)
    return device.gpu.model_copy(update={"memory_gib": (weights + _knobs(device).kv_cache_gib * GIB) / GIB})


def replica_simulator(device: DeviceProfile, model: Model, layers: int | None = None) -> ReplicaSimulator:
    """The simulator of one vLLM CPU replica of ``model`` (cut to ``layers``: a truncated checkpoint, its own head at
    the cut): the fitted device holding exactly the model's weights and the replica's KV cache, in the precision it
    was profiled in, with :func:`vllm_engine`'s knobs."""
    model = model.model_copy(update={"dtype_bytes": DTYPE_BYTES[_knobs(device).dtype]})
    return ReplicaSimulator(ReplicaSpec(model, holding(device, [model]), layers=layers,
                                        exit_head_layers=PARTIAL_EXIT_LAYERS),
                            vllm_engine(device))


def planning_catalog(params: Params) -> Catalog:
    """The catalog, plus the fitted vLLM device of this machine when ``build_perf_db.vllm_device`` is on (as it
    was swept: holding one replica of the largest profiled model)."""
    from exitplan.catalog import load_catalog

    catalog = load_catalog(params.path(params.catalog))
    if not params.build_perf_db.vllm_device:
        return catalog
    device = read_vllm_device(vllm_device_path(params))
    models = [catalog.llm(m).model_copy(update={"dtype_bytes": DTYPE_BYTES[_knobs(device).dtype]})
              for m in params.profile_vllm.models]
    gpus = [g for g in catalog.gpus if g.id != device.gpu.id] + [holding(device, models)]
    return Catalog.model_validate({**catalog.model_dump(), "gpus": [g.model_dump() for g in gpus]})
