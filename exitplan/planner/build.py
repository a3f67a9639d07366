"""Build a :class:`PlanProblem` from the pipeline's outputs: the perf DB, the catalog's prices, the quality labels."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from exitplan.errors import ExitplanError, LabelsNotFound
from exitplan.planner.candidates import Candidate, mixed_candidates
from exitplan.planner.problem import PlanProblem
from exitplan.simulator.colocation import HostSharing
from exitplan.simulator.curve import LatencyCurve
from exitplan.simulator.perf_db import curve_of


def deployment_curves(db: Any, model: str, gpus: Sequence[str], metric: str,
                      layers: Sequence[int] | None = None) -> dict[tuple, LatencyCurve]:
    """Every layout of ``model`` on ``gpus`` in the perf DB holding one of ``layers`` layers (default: the deepest
    the perf DB holds, full depth), as latency curves.

    Raises:
        ExitplanError: if the perf DB has no layout of the model on those GPUs.
    """
    rows = db[(db["model"] == model) & db["gpu"].isin(list(gpus))]
    if len(rows):
        rows = rows[rows["layers"].isin(list(layers) if layers is not None else [int(rows["layers"].max())])]
    layouts = rows[["gpu", "tp", "pp", "layers"]].drop_duplicates().itertuples(index=False)
    curves = {(g, int(tp), int(pp), int(layers)): curve_of(db, model, g, int(tp), int(pp), int(layers), metric)
              for g, tp, pp, layers in layouts}
    if not curves:
        raise ExitplanError(f"the perf DB has no {model} on {list(gpus)}: add them to build_perf_db")
    return curves


def quality_table(labels: Any, models: Sequence[str]) -> Any:
    """Queries labelled for every model: a frame indexed by (dataset, query_id) with one quality column per model.

    Raises:
        ExitplanError: naming the models without labels.
    """
    missing = [m for m in models if m not in set(labels["model"])]
    if missing:
        raise LabelsNotFound(f"no quality labels for {missing}: run label_quality on them, import them "
                             f"(import_labels), or supply a CSV (model, dataset, query_id, quality) as "
                             f"label_quality.user_labels")
    mine = whole_depth(labels[labels["model"].isin(list(models))])
    wide = mine.pivot_table(index=["dataset", "query_id"], columns="model", values="quality")[list(models)].dropna()
    if len(wide) < 4:
        raise ExitplanError(f"only {len(wide)} queries are labelled for all of {list(models)}")
    return wide


def whole_depth(labels: Any) -> Any:
    """The label rows of each model at its full depth: all of them when the table has no ``layers`` column (labels
    imported or supplied), else those at the model's deepest labelled depth (or without a depth)."""
    from exitplan.routing.labels import below_full_depth

    return labels[~below_full_depth(labels)]


def depth_labels(labels: Any, models: Sequence[str], index: Any) -> dict[tuple[str, int], np.ndarray]:
    """Per (model, cut depth), the quality of each query of ``index`` ((dataset, query_id) pairs, in order) labelled
    at that depth: only depths below the model's full one that label every query of ``index``."""
    from exitplan.routing.labels import below_full_depth

    if "layers" not in labels.columns:
        return {}
    out = {}
    cut = labels[labels["model"].isin(list(models)) & below_full_depth(labels)]
    for (model, layers), rows in cut.groupby(["model", "layers"]):
        column = rows.set_index(["dataset", "query_id"])["quality"]
        column = column[~column.index.duplicated()].reindex(index)
        if column.notna().all():
            out[(str(model), int(layers))] = column.to_numpy(float)
    return out


def quality_function(scores: np.ndarray, qualities: np.ndarray, steps: int) -> tuple[Any, np.ndarray, np.ndarray]:
    """Q(f) measured on held-out queries over a fraction grid, interpolated (K = 2) or nearest (K > 2)."""
    from exitplan.planner.search import fraction_grid
    from exitplan.routing.fractions import quality_curve

    grid = np.asarray(fraction_grid(qualities.shape[1], steps))
    values = quality_curve(scores, qualities, grid)

    def q(fractions: np.ndarray) -> float:
        return interpolate(grid, values, fractions)

    return q, grid, values


def interpolate(grid: np.ndarray, values: np.ndarray, fractions: np.ndarray) -> float:
    """A curve tabulated on a fraction grid, at ``fractions``: linear in the large model's share for two models,
    the nearest grid point for more."""
    if len(fractions) == 2:
        order = np.argsort(grid[:, 1])
        return float(np.interp(fractions[1], grid[order, 1], values[order]))
    return float(values[int(np.argmin(np.abs(grid - np.asarray(fractions)).sum(axis=1)))])


def tokens_per_request(db: Any, models: Sequence[str]) -> dict[str, float]:
    """Each model's mean output tokens per request in ``db`` (its output throughput over its request throughput,
    the median over the rows that served any)."""
    out = {}
    for m in models:
        rows = db[(db["model"] == m) & (db["throughput_req_s"] > 0)]
        ratio = (rows["throughput_out_tok_s"] / rows["throughput_req_s"]).dropna()
        out[m] = float(ratio.median()) if len(ratio) else 0.0
    return out


def problem_from(db: Any, prices: Mapping[str, float], available: Mapping[str, int], models: Sequence[str],
                 quality: Any, load: float, budget: float, metric: str, budget_points: int,
                 target_latency: float | None, shares: Sequence[float] = (1.0,),
                 sharing: Mapping[str, HostSharing] | None = None,
                 depths: Mapping[str, Sequence[int]] | None = None, depth_quality: Any = None,
                 routed: Any = None) -> PlanProblem:
    """The co-optimisation problem: candidates per model from the perf DB (knapsack over a budget grid, at each
    share of the load the model may be routed, and at each depth it may be cut to); ``sharing`` and
    ``depth_quality`` as :class:`PlanProblem` takes them (each model's tokens per request read from ``db``);
    ``depths``: model -> the layer counts its replicas may hold (default: full depth only); ``routed``: perf-DB rows
    with a ``share`` column, simulated on the lengths each model is routed (:mod:`exitplan.planner.routed`), read
    instead of ``db``'s for the layouts they hold."""
    from exitplan.planner.routed import share_curves

    curves: dict[str, Mapping[tuple, LatencyCurve]] = {}
    by_share: dict[str, Any] = {}
    candidates: dict[str, list[Candidate]] = {}
    budgets = np.linspace(budget / budget_points, budget, budget_points).tolist()
    for m in models:
        mine = None if depths is None else depths.get(m)
        curves[m] = deployment_curves(db, m, list(prices), metric, mine)
        held = sorted({key[3] for key in curves[m]})
        by_share[m] = share_curves(routed, m, list(prices), metric, held)
        found = []
        for layers in held:
            at = {key: c for key, c in curves[m].items() if key[3] == layers}
            target = target_latency or float(np.median([c.latency[-1] for c in at.values() if c.capacity]))
            found += mixed_candidates(at, prices, load, available, budgets, target, shares)
        candidates[m] = sorted(found, key=lambda c: c.cost)
        if not candidates[m]:
            raise ExitplanError(f"{m}: no deployment fits {dict(available)} GPUs and ${budget}/h")
    return PlanProblem(list(models), candidates, curves, load, budget, available, quality,
                       dict(sharing or {}), depth_quality, tokens_per_request(db, models), by_share)


def read_tables(paths: Sequence[tuple[Path, str]]) -> Any:
    """The rows of several stages' tables (labels, or queries) in one frame, ``query_id`` as text.

    Args:
        paths: ``(path, stage that writes it)`` pairs.

    Raises:
        ExitplanError: naming the stage to run for a table that is missing.
    """
    import pandas as pd

    frames = []
    for path, stage in paths:
        if not path.is_file():
            raise ExitplanError(f"no table at {path}: run the {stage} stage first")
        frames.append(pd.read_parquet(path))
    frame = pd.concat([f for f in frames if len(f)] or frames[:1], ignore_index=True)
    frame["query_id"] = frame["query_id"].astype(str)
    return frame
