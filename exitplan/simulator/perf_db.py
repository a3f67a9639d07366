"""The performance database (BOUTE's offline phase): latency and throughput of every feasible deployment of each
model on each GPU type, at every load of a grid.

One row per (model, GPU, TP, PP, layers held, QPS). Layouts whose weights do not fit, or whose TP leaves one node's
fast links, are pruned. Loads are swept upward; once a deployment saturates (it completes fewer requests per second
than it is offered), the higher loads are recorded as saturated without simulating them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from exitplan.catalog import Catalog, Gpu, Model
from exitplan.config import DaskParams, EngineParams
from exitplan.errors import SimulationError
from exitplan.fanout import sweep
from exitplan.simulator.cost_model import PARTIAL_EXIT_LAYERS, ReplicaSpec, validate_parallelism
from exitplan.simulator.curve import LatencyCurve
from exitplan.simulator.metrics import summarize
from exitplan.simulator.replica import ReplicaResult, ReplicaSimulator, RequestSet, kv_capacity_blocks
from exitplan.simulator.requests import sample_lengths
from exitplan.workload.arrivals import poisson_arrivals

SATURATION = 0.95
"""A load is saturated when, in the steady window (:data:`STEADY`), the replica completes fewer than this share of
the requests that arrive in it."""

STEADY = (0.1, 0.9)
"""The steady window of a run: between these quantiles of the arrival times (warm-up and drain left out)."""


def steady_ratio(result: ReplicaResult) -> float:
    """Requests completed in the steady window shifted by the median latency, over requests arrived in it.

    A replica that keeps up completes requests at the rate they arrive, one latency later; one that falls behind
    completes them at its capacity, whatever the window. Counting in the steady window leaves out the warm-up and
    the drain: the overall rate (completions from first arrival to last finish) counts the time the last, longest
    requests take to finish, so a run of AlpacaEval answers (300-600 tokens, ~5 s each) read as saturated at a
    load the replica sustained with 8% of its KV cache in use.
    """
    arrival = result.requests.arrival_s
    start, stop = np.quantile(arrival, STEADY)
    arrived = int(((arrival >= start) & (arrival <= stop)).sum())
    served = ~result.rejected
    finish = result.finish_s[served]
    if not arrived or not len(finish):
        return 0.0
    shift = float(np.median(finish - arrival[served]))
    completed = int(((finish >= start + shift) & (finish <= stop + shift)).sum())
    return completed / arrived


LATENCY_METRICS = ("ttft_s", "tpot_s", "e2e_s")


@dataclass(frozen=True)
class Layout:
    """One deployment of a replica: GPU type, TP, PP and layers held."""

    gpu: str
    tp: int
    pp: int
    layers: int


def layer_counts(model: Model, layer_fractions: Sequence[float], extra: Sequence[int] = ()) -> list[int]:
    """The layer counts swept for ``model``: each fraction of its layers (rounded), and ``extra`` (partial replicas
    at given exits), without repeats, deepest last.

    Raises:
        SimulationError: an extra count beyond the model's layers.
    """
    beyond = [n for n in extra if not 1 <= n <= model.num_layers]
    if beyond:
        raise SimulationError(f"{model.name} has {model.num_layers} layers: cannot sweep replicas of {beyond}")
    return sorted({*(max(1, round(model.num_layers * f)) for f in layer_fractions), *extra})


def enumerate_layouts(model: Model, gpu: Gpu, max_gpus: int, layer_fractions: Sequence[float],
                      engine: EngineParams, extra_layers: Sequence[int] = ()) -> list[Layout]:
    """Every feasible (TP, PP, layers) of ``model`` on ``gpu`` with TP x PP <= ``max_gpus``.

    TP and PP are powers of two; TP stays within one node's fast links and divides the heads; layouts whose
    weights leave no KV room are dropped (BOUTE's pruning rules). ``layers``: :func:`layer_counts`.
    """
    layouts = []
    for layers in layer_counts(model, layer_fractions, extra_layers):
        tp = 1
        while tp <= min(max_gpus, gpu.max_tensor_parallel):
            pp = 1
            while tp * pp <= max_gpus:
                if not validate_parallelism(model, gpu, tp, pp, layers):
                    try:
                        kv_capacity_blocks(ReplicaSpec(model, gpu, tp, pp, layers, PARTIAL_EXIT_LAYERS), engine)
                        layouts.append(Layout(gpu.id, tp, pp, layers))
                    except SimulationError:
                        pass
                pp *= 2
            tp *= 2
    return layouts


def _row(model: Model, gpu: Gpu, layout: Layout, qps: float, metrics: dict[str, Any] | None,
         saturated: bool) -> dict[str, Any]:
    row: dict[str, Any] = {"model": model.name, "gpu": gpu.id, "tp": layout.tp, "pp": layout.pp,
                           "layers": layout.layers, "num_gpus": layout.tp * layout.pp,
                           "cost_per_hour": layout.tp * layout.pp * gpu.price_per_hour, "qps": float(qps),
                           "saturated": metrics is None or saturated}
    for name in LATENCY_METRICS:
        for stat in ("mean", "p50", "p95", "p99"):
            row[f"{name.removesuffix('_s')}_{stat}_s"] = np.nan if metrics is None else metrics[name][stat]
    for key in ("throughput_req_s", "throughput_out_tok_s", "kv_utilisation", "preemptions", "busy_fraction",
                "mean_batch"):
        row[key] = np.nan if metrics is None else metrics[key]
    return row


def sweep_layout(model: Model, gpu: Gpu, layout: Layout, engine: EngineParams, qps_grid: Sequence[float],
                 lengths: tuple[np.ndarray, np.ndarray], num_requests: int, seed: int) -> list[dict[str, Any]]:
    """Simulate one layout at every load of the grid (ascending), stopping at saturation."""
    sim = ReplicaSimulator(ReplicaSpec(model, gpu, layout.tp, layout.pp, layout.layers, PARTIAL_EXIT_LAYERS), engine)
    prompts, outputs = sample_lengths(lengths[0], lengths[1], num_requests, seed)
    unit = poisson_arrivals(num_requests, 1.0, np.random.default_rng([seed, 29]))
    rows, saturated = [], False
    for qps in sorted(qps_grid):
        metrics = None
        if not saturated:
            # Common random numbers: the same arrival pattern scaled to each load keeps the curve smooth.
            result = sim.run(RequestSet(unit / qps, prompts, outputs))
            metrics = summarize([result])
            saturated = steady_ratio(result) < SATURATION
        row = _row(model, gpu, layout, qps, metrics, saturated)
        saturated = bool(row["saturated"])
        rows.append(row)
    return rows


def _sweep_job(job: tuple) -> list[dict[str, Any]]:
    """:func:`sweep_layout` of one job tuple (a module-level function, so Dask workers can import it)."""
    return sweep_layout(*job)


def build_perf_db(catalog: Catalog, models: Iterable[str], gpus: Iterable[str], engine: EngineParams,
                  qps_grid: Sequence[float], lengths: tuple[np.ndarray, np.ndarray], num_requests: int,
                  seed: int = 0, max_gpus_per_replica: int = 8, layer_fractions: Sequence[float] = (1.0,),
                  dask: DaskParams | None = None, progress: Callable[[str], None] | None = None,
                  model_lengths: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
                  client: Any = None, partial_layers: Mapping[str, Sequence[int]] | None = None) -> Any:
    """The perf DB as a DataFrame (one row per model x layout x load).

    Each layout is one job of a Dask sweep (:func:`exitplan.fanout.sweep`); the rows come back in layout order, so
    the table is the same however many workers swept it.

    Args:
        catalog: GPUs and models.
        models: Hugging Face ids to include.
        gpus: GPU ids to include.
        engine: Engine knobs of every replica.
        qps_grid: Loads in requests per second.
        lengths: Observed (prompt, output) token lengths to sample requests from.
        num_requests: Requests per grid point.
        seed: Seed of lengths and arrivals.
        max_gpus_per_replica: Largest TP x PP considered.
        layer_fractions: Shares of the layers held (1.0 = full model; less = partial early-exit replicas).
        dask: Where the layouts are swept (default: in this process).
        progress: Called with a line per layout swept.
        model_lengths: Model -> its own (prompt, output) lengths, used instead of ``lengths`` for that model.
        client: A running Dask client to sweep on instead of one made from ``dask``.
        partial_layers: Model -> layer counts of partial replicas swept besides ``layer_fractions``.

    Raises:
        SimulationError: if no layout of a model fits any of the GPUs.
    """
    import pandas as pd

    gpus = list(gpus)
    jobs: list[Any] = []
    for name in models:
        model = catalog.model(name)
        if not isinstance(model, Model):
            raise SimulationError(f"{name} is not a decoder model")
        layouts = [(catalog.gpu(g), layout) for g in gpus
                   for layout in enumerate_layouts(model, catalog.gpu(g), max_gpus_per_replica, layer_fractions,
                                                   engine, (partial_layers or {}).get(name, ()))]
        if not layouts:
            raise SimulationError(f"no layout of {name} fits on any of {gpus}")
        own = (model_lengths or {}).get(name, lengths)
        jobs.extend((model, gpu, layout, engine, list(qps_grid), own, num_requests, seed)
                    for gpu, layout in layouts)
    done = (lambda job: progress(_describe(job))) if progress else None
    swept = sweep(_sweep_job, jobs, dask or DaskParams(workers=1), done, client)
    return pd.DataFrame([row for rows in swept for row in rows])


def _describe(job: tuple) -> str:
    model, gpu, layout = job[:3]
    return f"{model.name} on {gpu.id} tp={layout.tp} pp={layout.pp} layers={layout.layers}"


def curve_of(db: Any, model: str, gpu: str, tp: int, pp: int, layers: int | None = None,
             metric: str = "e2e_p95_s") -> LatencyCurve:
    """The monotone latency-vs-load curve of one deployment in the perf DB.

    Raises:
        SimulationError: if the perf DB has no such deployment.
    """
    rows = db[(db["model"] == model) & (db["gpu"] == gpu) & (db["tp"] == tp) & (db["pp"] == pp)]
    if layers is not None:
        rows = rows[rows["layers"] == layers]
    if rows.empty:
        raise SimulationError(f"perf DB has no {model} on {gpu} at tp={tp} pp={pp} layers={layers}")
    busy = rows["busy_fraction"].to_numpy() if "busy_fraction" in rows else None  # perf DBs before it: none
    batch = rows["mean_batch"].to_numpy() if "mean_batch" in rows else None
    return LatencyCurve.from_points(rows["qps"].to_numpy(), rows[metric].to_numpy(), rows["saturated"].to_numpy(),
                                    busy, batch)
