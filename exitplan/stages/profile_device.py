"""Stage ``profile_device``: step times of the candidates on this machine, and the simulator's device fitted."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from exitplan.artifacts import DEVICE_FILE, engine_device_path
from exitplan.atomic import write_json, write_parquet
from exitplan.config import Params
from exitplan.cpu_features import local_dtype, torch_dtype
from exitplan.kinds import DTYPE_BYTES
from exitplan.profiling.device_file import DeviceProfile, ReplicaKnobs, read_device, write_device
from exitplan.profiling.probe import Probe, reference_model, run_probe
from exitplan.tracking import log_stage_run

STAGE = "profile_device"


def catalog_model(params: Params, name: str) -> Any:
    """The catalog entry of ``name`` with the element size the engine serves it in (``helios.dtype``)."""
    from exitplan.catalog import load_catalog

    size = DTYPE_BYTES[local_dtype(params.helios.dtype)]
    return load_catalog(params.path(params.catalog)).model(name).model_copy(update={"dtype_bytes": size})


def main(params: Params) -> dict[str, Any]:
    """Time every model of ``profile_device.models`` as the engine serves it (``helios.dtype``, in the serving form
    where packing gains: :func:`~exitplan.earlyexit.fused.for_serving`); fit the device; write the points, the entry
    and metrics."""
    import psutil

    from exitplan.catalog import load_catalog
    from exitplan.earlyexit.fused import for_serving
    from exitplan.profiling.device import measure

    section = params.profile_device
    started = time.perf_counter()
    rows = []
    for name in section.models:
        model = for_serving(params.checkpoint_path(name), dtype=torch_dtype(params.helios.dtype),
                            pack_head=params.helios.pack_lm_head, native=params.helios.native_kernels)
        depths = sorted({model.num_layers, *([max(1, round(model.num_layers * section.partial_depth))]
                                             if section.partial_depth else [])})
        for row in measure(model, section.batch_sizes, section.contexts, section.prefill_lengths, section.repeats,
                           depths):
            rows.append({"model": name, **row})
        del model
    memory = section.memory_gib or psutil.virtual_memory().total / 2**30
    models = {name: catalog_model(params, name) for name in section.models}
    probe = run_probe(reference_model(load_catalog(params.path(params.catalog)), list(section.models)),
                      local_dtype(params.helios.dtype), params.calibrate.repeats)
    metrics = fit_and_write(rows, models, section.device_id, memory, section.price_per_hour,
                            params.path(section.output_dir), probe)
    report = write_json(params.path("reports") / STAGE / "metrics.json", metrics)
    seconds = time.perf_counter() - started
    log_stage_run(STAGE, params.tracking, params.root, section.model_dump(),
                  {k: v for k, v in metrics.items() if isinstance(v, (int, float))}, [report],
                  wall_s={"seconds": seconds})
    return {**metrics, "seconds": seconds}


def fit_and_write(rows: list[dict[str, Any]], models: dict[str, Any], device_id: str, memory_gib: float,
                  price_per_hour: float, out: Path, probe: Probe, engine: ReplicaKnobs | None = None,
                  host: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Fit the device to the measured ``rows``, add each row's prediction, and write ``steps.parquet`` and
    ``device.yaml`` (the entry with how its replicas share a host as measured, ``host``'s fields, its overheads, the
    reference ``probe`` taken after the profiling and the replicas' ``engine`` knobs) into ``out``; returns the fit's
    metrics."""
    import pandas as pd

    from exitplan.profiling.device import fit_device, predict

    device, overheads, errors = fit_device(rows, models, device_id, memory_gib, price_per_hour)
    device = device.model_copy(update=dict(host or {}))
    for name, model in models.items():
        mine = [r for r in rows if r["model"] == name]
        for row, seconds in zip(mine, predict(mine, model, device, overheads), strict=True):
            row["predicted"] = float(seconds)
    write_parquet(out / "steps.parquet", pd.DataFrame(rows))
    write_device(out / DEVICE_FILE, DeviceProfile(gpu=device, step_overhead_s=overheads.step_s,
                                                  seq_overhead_s=overheads.seq_s, prompt_overhead_s=overheads.prompt_s,
                                                  engine=engine, probe=probe))
    return {"device": device.id, "flops_per_s": device.bf16_tflops * 1e12,
            "bytes_per_s": device.hbm_bandwidth_gbps * 1e9, "step_overhead_s": overheads.step_s,
            "seq_overhead_s": overheads.seq_s, "prompt_overhead_s": overheads.prompt_s,
            "attention_rate": device.efficiency.attention, "kv_read_rate": device.efficiency.kv_memory,
            **{f"compute_{name}": rate for name, rate in device.model_compute.items()},
            "points": len(rows), "probe_prefill_s": probe.prefill_s, "probe_decode_s": probe.decode_s, **errors}


def load_device(params: Params) -> DeviceProfile:
    """The device this stage fitted (entry and overheads).

    Raises:
        ExitplanError: the stage has not run, or its output is not a device profile.
    """
    return read_device(engine_device_path(params), STAGE)
