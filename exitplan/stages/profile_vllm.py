"""Stage ``profile_vllm``: vLLM's step times on this machine, and the simulator's device fitted to them.

Each model of ``profile_vllm.models`` is served by a vLLM CPU replica started exactly as ``exitplan deploy`` starts one
(:mod:`exitplan.vllm.replica`: the rendered flags, its own pinned core, the ``vllm`` section's KV cache); the replicas
start together, as many as the machine holds (their compiles overlap), and each is timed through its API
(:mod:`exitplan.vllm.profile`) while the others stand by, as they do beside it in a deployment, then once more while
the others decode at each of ``neighbour_batches`` (each model's ``slowdown_grids``, by its batch and the neighbour's;
their means the ``model_slowdowns`` and the device's ``neighbour_slowdown``: what co-located replicas cost each
other), and the fleet's coordinator is started in front of them to read its CPU per relayed token and per routed
workload prompt (:mod:`exitplan.vllm.coordinator_cost`: on a host the replicas fill, the coordinator's work is taken
from theirs).
The points are fitted like ``profile_device``'s, giving the catalog entry ``device_id`` and vLLM's per-step and
per-sequence overheads, with which the simulator predicts a vLLM replica on this machine; ``device.yaml`` also records
the engine knobs the replicas ran with.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

from exitplan.atomic import write_json
from exitplan.config import Params
from exitplan.tracking import log_stage_run

if TYPE_CHECKING:
    from exitplan.catalog import SlowdownGrid
    from exitplan.vllm.coordinator_cost import CoordinatorCost

STAGE = "profile_vllm"

def _waves(params: Params, names: list[str]) -> list[list[str]]:
    """The models in groups this machine holds at once (cores and RAM), in order."""
    from exitplan.vllm import replica as vllm_replica

    waves, left = [], list(names)
    while left:
        held = max(1, vllm_replica.capacity(params, [vllm_replica.replica_gib(params, params.checkpoint_path(m))
                                                     for m in left]))
        waves.append(left[:held])
        left = left[held:]
    return waves


def _rows_of(params: Params, names: list[str]) -> tuple[list[dict[str, Any]], dict[str, SlowdownGrid],
                                                         CoordinatorCost | None]:
    """Serve ``names`` on vLLM replicas started together (each on its own cores, as a deployment starts them, so
    their compiles overlap), time each in turn while the others stand by, then each beside the others busy, then
    the coordinator in front of them; stop them all. Returns the rows, each model's neighbour-slowdown grid and the
    coordinator's cost (neither with one replica)."""
    from exitplan.vllm import replica as vllm_replica
    from exitplan.vllm.coordinator_cost import measure_coordinator_cost
    from exitplan.vllm.profile import measure, neighbour_grids
    from exitplan.vllm.truncate import read_layers

    section, settings = params.profile_vllm, params.vllm
    core_sets = vllm_replica.cores(len(names), settings.threads_per_replica)
    started = []
    try:
        for i, name in enumerate(names):
            spec = vllm_replica.cpu_replica(params, name, "127.0.0.1", params.deploy.base_port + i)
            log = params.path(".cache") / STAGE / f"{name.replace('/', '_')}.log"  # vLLM's own log, not an output
            started.append(vllm_replica.start(params, params.checkpoint_path(name), spec, core_sets[i], log))
        rows = []
        for replica in started:
            vllm_replica.wait_ready(replica, settings.startup_timeout_s)
        for name, replica in zip(names, started, strict=True):
            rows += [{"model": name, **row} for row in measure(
                replica.url, name, read_layers(params.checkpoint_path(name)), section.batch_sizes, section.contexts,
                section.prefill_lengths, section.tokens, section.repeats)]
        if len(started) < 2:
            return rows, {}, None
        replicas = [(r.url, n) for r, n in zip(started, names, strict=True)]
        grids = neighbour_grids(replicas, section.neighbour_batches, min(section.contexts), section.tokens,
                                section.neighbour_repeats)
        cost = measure_coordinator_cost(params, replicas, _prompts(params), 4 * section.tokens,
                                        params.path(".cache") / STAGE / "coordinator")
        return rows, dict(zip(names, grids, strict=True)), cost
    finally:
        for replica in started:
            vllm_replica.stop(replica.process)


def _prompts(params: Params) -> list[str]:
    """The workload's prompts the coordinator routes while its CPU is read (the first ``ROUTED`` of a shuffle)."""
    import pandas as pd

    from exitplan.artifacts import queries_path
    from exitplan.vllm.coordinator_cost import ROUTED

    queries = pd.read_parquet(queries_path(params), columns=["prompt"])
    return queries["prompt"].sample(n=min(ROUTED, len(queries)), random_state=0).astype(str).tolist()


def main(params: Params) -> dict[str, Any]:
    """Time every model of ``profile_vllm.models`` on vLLM; fit the device; write the points, entry and metrics."""
    import psutil

    from exitplan.catalog import load_catalog
    from exitplan.kinds import DTYPE_BYTES
    from exitplan.profiling.device_file import ReplicaKnobs
    from exitplan.profiling.probe import reference_model, run_probe
    from exitplan.stages.profile_device import fit_and_write
    from exitplan.vllm import replica as vllm_replica
    from exitplan.vllm.replica import cpu_engine, replica_dtype

    section = params.profile_vllm
    began = time.perf_counter()
    waves = [_rows_of(params, wave) for wave in _waves(params, list(section.models))]
    rows = [row for wave_rows, _, _ in waves for row in wave_rows]
    grids = {model: g for _, measured, _ in waves for model, g in measured.items()}
    by_model = {model: g.mean for model, g in grids.items()}
    slowdown = statistics.fmean(by_model.values()) if by_model else 0.0  # one replica at a time: none measured
    costs = [c for _, _, c in waves if c is not None]  # the coordinator's, where two models were up together
    host: dict[str, Any] = {"neighbour_slowdown": slowdown, "model_slowdowns": by_model, "slowdown_grids": grids,
                            "host_slots": 0, "relay_cpu_s": 0.0, "score_cpu_s": 0.0}
    if costs:
        host.update(host_slots=vllm_replica.slots(params), relay_cpu_s=statistics.fmean(c.relay_cpu_s for c in costs),
                    score_cpu_s=statistics.fmean(c.score_cpu_s for c in costs))
    dtype = replica_dtype(params)  # float32 on a CPU without bfloat16 kernels
    size = DTYPE_BYTES[dtype]
    catalog = load_catalog(params.path(params.catalog))
    models = {name: catalog.model(name).model_copy(update={"dtype_bytes": size}) for name in section.models}
    memory = section.memory_gib or psutil.virtual_memory().total / 2**30
    knobs = cpu_engine(params)  # what the replicas ran with
    engine = ReplicaKnobs(max_num_seqs=knobs.max_num_seqs, block_size=knobs.block_size,
                          max_model_len=params.vllm.max_model_len, dtype=dtype,
                          kv_cache_gib=float(params.vllm.kv_cache_gib))
    # the reference probe, right after the replicas have stopped, in their precision and on their threads' count
    probe = run_probe(reference_model(catalog, list(section.models)), dtype, params.calibrate.repeats,
                      params.vllm.threads_per_replica)
    metrics = fit_and_write(rows, models, section.device_id, memory, section.price_per_hour,
                            params.path(section.output_dir), probe, engine, host)
    metrics.update({**{k: v for k, v in host.items() if k not in ("model_slowdowns", "slowdown_grids")},
                    **{f"neighbour_slowdown_{m.split('/')[-1]}": s for m, s in by_model.items()},
                    **{f"neighbour_slowdown_{m.split('/')[-1]}_b{own}_n{other}": g.values[i][j]
                       for m, g in grids.items() for i, own in enumerate(g.batches)
                       for j, other in enumerate(g.batches)},
                    "relay_cpu_ms": host["relay_cpu_s"] * 1e3, "score_cpu_ms": host["score_cpu_s"] * 1e3})
    decode = [r for r in rows if r["kind"] == "decode"]
    shortest = min(r["context"] for r in decode)
    metrics.update({f"decode_tok_s_b{r['batch']}_{r['model'].split('/')[-1]}": r["batch"] / r["seconds"]
                    for r in decode if r["context"] == shortest})
    report = write_json(params.path("reports") / STAGE / "metrics.json", metrics)
    seconds = time.perf_counter() - began
    log_stage_run(STAGE, params.tracking, params.root, section.model_dump(),
                  {k: v for k, v in metrics.items() if isinstance(v, (int, float))}, [report],
                  wall_s={"seconds": seconds})
    return {**metrics, "seconds": seconds}
