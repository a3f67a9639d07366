"""Stage ``build_perf_db``: the performance database, its latency-vs-load plots and metrics."""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from exitplan.artifacts import perf_db_path, queries_path, vllm_device_path
from exitplan.atomic import write_atomic, write_json, write_parquet
from exitplan.catalog import load_catalog
from exitplan.config import DaskParams, Params
from exitplan.errors import WorkloadError
from exitplan.files import read_table
from exitplan.simulator.perf_db import build_perf_db
from exitplan.tracking import log_stage_run

STAGE = "build_perf_db"
CURVES_FILE = "curves.csv"


def _lengths(params: Params) -> tuple[Any, Any]:
    import pandas as pd

    name = params.build_perf_db.lengths_trace
    path = params.path(params.prepare_workload.output_dir) / f"trace_{name}.parquet"
    if not path.is_file():
        raise WorkloadError(f"no trace at {path}: run the prepare_workload stage first")
    trace = pd.read_parquet(path, columns=["prompt_len", "output_len"])
    return trace["prompt_len"].to_numpy(), trace["output_len"].to_numpy()


def _model_lengths(params: Params) -> dict[str, tuple[Any, Any]]:
    """Per-model (prompt, output) lengths of ``build_perf_db.model_lengths`` for the models it covers."""
    import pandas as pd

    name = params.build_perf_db.model_lengths
    if name is None:
        return {}
    path = params.path(name)
    if not path.is_file():
        raise WorkloadError(f"no per-model lengths at {path}: run the import_labels stage first (or set "
                            f"build_perf_db.model_lengths: null)")
    table = pd.read_parquet(path, columns=["model", "prompt_len", "output_len"])
    table = table[(table["prompt_len"] > 0) & (table["output_len"] > 0)]
    return {m: (rows["prompt_len"].to_numpy(), rows["output_len"].to_numpy())
            for m, rows in table.groupby("model") if m in params.build_perf_db.models}


def plot_curves(db: Any, out_dir: Path) -> list[Path]:
    """One PNG per model: P95 end-to-end latency vs load, a line per deployment (unsaturated points only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for model, rows in db.groupby("model", sort=True):
        fig, ax = plt.subplots(figsize=(8, 5))
        for (gpu, tp, pp, layers), curve in rows[~rows["saturated"]].groupby(["gpu", "tp", "pp", "layers"]):
            ax.plot(curve["qps"], curve["e2e_p95_s"], marker=".", linewidth=1,
                    label=f"{gpu} tp{tp} pp{pp}" + ("" if layers == rows["layers"].max() else f" l{layers}"))
        ax.set(xlabel="load (requests/s)", ylabel="P95 end-to-end latency (s)", yscale="log", title=model)
        ax.legend(fontsize=6, ncol=2)
        path = out_dir / (re.sub(r"[^\w.-]+", "_", model) + ".png")
        write_atomic(path, lambda tmp, fig=fig: fig.savefig(tmp, dpi=100, format="png"))  # type: ignore[misc]
        plt.close(fig)
        paths.append(path)
    return paths


def workload_queries(params: Params) -> Any:
    """The workload's queries that this machine's replicas serve: the prompts the local fleet is sent
    (``fleet_vs_plan`` and ``plan_ranking`` replay them), answers (``output_len``) cut to
    ``build_perf_db.vllm_max_output_len``, those too long for ``vllm.max_model_len`` left out (vLLM rejects them).

    Raises:
        WorkloadError: no queries file, or no query fits.
    """
    path, cap = queries_path(params), params.build_perf_db.vllm_max_output_len
    queries = read_table(path, "query table", ["prompt", "prompt_len", "output_len"], WorkloadError,
                         "run the prepare_workload stage first")
    fits = queries[(queries["prompt_len"] > 0) & (queries["prompt_len"] + cap <= params.vllm.max_model_len)]
    if fits.empty:
        raise WorkloadError(f"no query of {path} fits vllm.max_model_len={params.vllm.max_model_len} with "
                            f"{cap} answer tokens")
    return fits.assign(output_len=fits["output_len"].clip(1, cap)).reset_index(drop=True)


def workload_lengths(params: Params) -> tuple[Any, Any]:
    """(prompt, answer) token counts of :func:`workload_queries`."""
    fits = workload_queries(params)
    return fits["prompt_len"].to_numpy(), fits["output_len"].to_numpy()


def vllm_rows(params: Params, lengths: Mapping[str, tuple[Any, Any]] | None = None, partial: bool = True,
              dask: DaskParams | None = None) -> Any:
    """The perf DB of the vLLM replicas of this machine: ``profile_vllm``'s device and engine knobs, the profiled
    models that the perf DB covers, on ``vllm_qps``, with the workload's own lengths (:func:`workload_lengths`: a
    plan for this fleet is a plan for the prompts it serves; GSM8K's lengths, the other models' trace, have a P95
    prompt of about 100 tokens where the workload's is about 1,300, and a prefill of that costs seconds here).

    Args:
        params: The pipeline's parameters.
        lengths: Model -> its own (prompt, answer) lengths instead (those models only: the lengths a router sends
            each, :mod:`exitplan.planner.routed`).
        partial: Sweep the partial replicas of ``build_perf_db.partial_layers`` too (else full depth only).
        dask: Where the layouts are swept (default: ``params.dask``; in this process from within a Dask worker).
    """
    from exitplan.vllm.simulate import planning_catalog, read_vllm_device, vllm_engine

    section = params.build_perf_db
    device = read_vllm_device(vllm_device_path(params))
    models = [m for m in params.profile_vllm.models if m in section.models and (lengths is None or m in lengths)]
    # with ``lengths`` each model swept has its own, and the common lengths argument is not read
    cut = workload_lengths(params) if lengths is None else next(iter(lengths.values()))
    return build_perf_db(planning_catalog(params), models, [device.gpu.id], vllm_engine(device), section.vllm_qps, cut,
                         section.requests_per_point, section.seed, 1, [1.0], dask or params.dask, model_lengths=lengths,
                         partial_layers=section.partial_layers if partial else None)


def main(params: Params) -> dict[str, Any]:
    """Build ``<output_dir>/perf_db.parquet``, ``reports/build_perf_db/`` (metrics, curves CSV, PNG plots)."""
    import pandas as pd

    section = params.build_perf_db
    catalog = load_catalog(params.path(params.catalog))
    lengths, own = _lengths(params), _model_lengths(params)
    started = time.perf_counter()
    db = build_perf_db(catalog, section.models, section.gpus, params.simulator.engine, section.qps, lengths,
                       section.requests_per_point, section.seed, section.max_gpus_per_replica,
                       section.layer_fractions, params.dask, model_lengths=own,
                       partial_layers=section.partial_layers)
    if section.vllm_device:
        db = pd.concat([db, vllm_rows(params)], ignore_index=True)
    seconds = time.perf_counter() - started
    reports = params.path("reports") / STAGE
    write_parquet(perf_db_path(params), db)
    curves = db[~db["saturated"]][["model", "gpu", "tp", "pp", "layers", "qps", "e2e_p95_s", "ttft_p95_s",
                                   "tpot_p95_s"]].assign(deployment=lambda f: f["gpu"] + " tp" + f["tp"].astype(str)
                                                         + " pp" + f["pp"].astype(str))
    write_atomic(reports / CURVES_FILE, lambda tmp: curves.to_csv(tmp, index=False))
    plots = plot_curves(db, reports / "plots")
    capacity = db[~db["saturated"]].groupby(["model", "gpu"])["qps"].max()
    metrics = {
        "rows": int(len(db)),
        "deployments": int(db.groupby(["model", "gpu", "tp", "pp", "layers"]).ngroups),
        "saturated_share": float(db["saturated"].mean()),
        "max_sustained_qps": {f"{m}:{g}": float(q) for (m, g), q in capacity.items()},
        "lengths": {m: ("model_lengths" if m in own else f"trace {section.lengths_trace}") for m in section.models},
        "vllm_lengths": "workload queries" if section.vllm_device else None,
    }
    report = write_json(reports / "metrics.json", metrics)
    log_stage_run(STAGE, params.tracking, params.root, section.model_dump(), metrics, [report, *plots],
                  wall_s={"build_s": seconds})
    return {**metrics, "build_s": seconds}
