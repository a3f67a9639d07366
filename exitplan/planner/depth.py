"""Quality by depth: what cutting a model's replicas to an exit costs in quality, for the planner's Q(f, depths).

A replica cut to ``L`` layers (a truncated checkpoint, :mod:`exitplan.vllm.truncate`) answers through the model's
own final norm and head at layer ``L``: the exit profile's *identity* exit at ``L``. Its per-query quality comes from
labels measured at that depth where they exist; otherwise from the exit's top-1 agreement with the full model by
this rule:

    q_L(query) = floor + a_L * (q_full(query) - floor)

- each token the cut model emits equals the full model's with probability ``a_L`` (the agreement that
  ``exit_profile`` measured on held-out text, or a published table's), and the answer keeps the full model's
  quality in that proportion, falling to ``floor`` (the quality of a wrong answer, a scenario knob) for the rest.
  It is optimistic for long answers (one wrong token can derail the rest) and pessimistic where a different token
  is as good; it is linear, so the quality of a routed mix stays a sum of each model's share.

Q(f, depths) is then the mean, over the router's held-out queries split by ``f``, of each query's quality on the
model it is routed to at that model's depth: one contribution curve per (model, depth) over the fraction grid,
summed and interpolated like Q(f) (:func:`exitplan.planner.build.quality_function`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from exitplan.errors import ExitplanError
from exitplan.routing.fractions import route, thresholds

SERVED_KIND = "identity"
"""The exit profile's head kind a partial vLLM replica serves (its own final norm and head at the cut)."""


def depth_quality_rule(q_full: np.ndarray, agreement: float, floor: float) -> np.ndarray:
    """Per-query quality at an exit whose top-1 agreement with the full model is ``agreement`` (module docstring).

    Raises:
        ExitplanError: an agreement outside [0, 1] or a non-finite one.
    """
    if not np.isfinite(agreement) or not 0.0 <= agreement <= 1.0:
        raise ExitplanError(f"an exit's agreement with the full model must lie in [0, 1] (got {agreement})")
    return floor + agreement * (np.asarray(q_full, float) - floor)


@dataclass(frozen=True)
class DepthQuality:
    """Q(f, depths) over a fraction grid.

    Attributes:
        grid: Fraction vectors (``points x K``).
        contributions: ``(model index, layers)`` -> per grid point, the mean over the held-out queries of the
            quality of those routed to the model at that depth (0 for the others).
        sources: Model -> where its quality-by-depth figures come from (what ``plan.json`` records).
        agreement: Model -> exit layer -> its agreement figure at each of its depths that has one (what
            ``plan.json`` records).
    """

    grid: np.ndarray
    contributions: Mapping[tuple[int, int], np.ndarray]
    sources: Mapping[str, str]
    agreement: Mapping[str, Mapping[int, float]] = field(default_factory=dict)

    def __call__(self, fractions: np.ndarray, layers: Sequence[int]) -> float:
        """Q at ``fractions`` with model ``k`` cut to ``layers[k]`` (interpolated along the large model's share
        for two models, the nearest grid point otherwise).

        Raises:
            ExitplanError: naming a (model, depth) whose quality was never measured.
        """
        from exitplan.planner.build import interpolate

        total = np.zeros(len(self.grid))
        for k, depth in enumerate(layers):
            if (k, depth) not in self.contributions:
                raise ExitplanError(f"no quality is known for model {k} at {depth} layers")
            total = total + self.contributions[(k, depth)]
        return interpolate(self.grid, total, np.asarray(fractions, float))


def routed_contributions(scores: np.ndarray, column: np.ndarray, model: int, grid: np.ndarray) -> np.ndarray:
    """Per grid point, the mean over the queries of ``column`` for those the split sends to ``model`` (else 0)."""
    out = []
    for f in np.atleast_2d(grid):
        chosen = route(scores, thresholds(scores, f))
        out.append(float(np.mean(np.where(chosen == model, column, 0.0))))
    return np.asarray(out)


def build_depth_quality(models: Sequence[str], scores: np.ndarray, qualities: np.ndarray, grid: np.ndarray,
                        depths: Mapping[str, Sequence[int]], agreement: Mapping[str, Mapping[int, float]],
                        sources: Mapping[str, str], floor: float,
                        measured: Mapping[str, Mapping[int, np.ndarray]] | None = None) -> DepthQuality:
    """Q(f, depths) of the router's held-out queries.

    Args:
        models: The scenario's models, smallest first.
        scores: Routing scores of the held-out queries.
        qualities: Their measured quality on each model at full depth (``queries x K``).
        grid: Fraction vectors to tabulate on.
        depths: Model -> the layer counts it may be cut to; the largest is its full depth (quality as labelled).
        agreement: Model -> layers -> the exit's agreement with the full model (every depth below full needs one).
        sources: Model -> where its agreement figures come from.
        floor: The quality of a wrong answer (:func:`depth_quality_rule`).
        measured: Model -> layers -> each held-out query's quality labelled at that depth: used as it is, before
            the rule.

    Raises:
        ExitplanError: naming a model's depth that has no agreement figure.
    """
    table: dict[tuple[int, int], np.ndarray] = {}
    figures: dict[str, dict[int, float]] = {}
    for k, m in enumerate(models):
        full = max(depths[m])
        for layers in depths[m]:
            if layers == full:
                column = qualities[:, k]
            elif measured is not None and layers in measured.get(m, {}):
                column = np.asarray(measured[m][layers], float)
            elif layers in agreement.get(m, {}):
                column = depth_quality_rule(qualities[:, k], agreement[m][layers], floor)
            else:
                raise ExitplanError(f"{m}: no quality is known at {layers} layers (measured: "
                                    f"{sorted(agreement.get(m, {}))})")
            table[(k, layers)] = routed_contributions(scores, column, k, grid)
        figures[m] = {d: float(agreement[m][d]) for d in depths[m] if d in agreement.get(m, {})}
    return DepthQuality(np.asarray(grid, float), table, {m: sources.get(m, "labels (full depth)") for m in models},
                        figures)


def read_agreement(path: Path, kind: str = SERVED_KIND, dataset: str = "all") -> dict[str, dict[int, float]]:
    """Model -> exit layer -> top-1 agreement with the final layer, from ``exit_profile``'s curves table.

    Raises:
        ExitplanError: the table is missing (naming the stage to run) or lacks the columns or the head kind.
    """
    import pandas as pd

    if not path.is_file():
        raise ExitplanError(f"no exit profile at {path}: run the exit_profile stage (depth planning needs it)")
    frame = pd.read_parquet(path)
    need = {"model", "kind", "dataset", "exit_layer", "agreement"}
    if not need <= set(frame.columns):
        raise ExitplanError(f"{path} lacks the columns {sorted(need - set(frame.columns))}: re-run exit_profile")
    rows = frame[(frame["kind"] == kind) & (frame["dataset"] == dataset)]
    if rows.empty:
        raise ExitplanError(f"{path} has no {kind} exits on '{dataset}': add '{kind}' to exit_profile.head_kinds")
    out: dict[str, dict[int, float]] = {}
    for model, layer, value in rows[["model", "exit_layer", "agreement"]].itertuples(index=False):
        out.setdefault(str(model), {})[int(layer)] = float(value)
    return out


def check_depths(model: str, swept: Sequence[int], full: int, measured: Mapping[int, float]) -> list[int]:
    """The depths a model may be cut to: those the perf DB swept, each one its quality source measured.

    Args:
        model: The model's id.
        swept: Layer counts the perf DB holds for it.
        full: Its full depth (always allowed: its labels are measured there).
        measured: Layers -> agreement, the depths its quality source measured.

    Raises:
        ExitplanError: naming a swept depth that was never measured, and the depths that were.
    """
    never = sorted(d for d in swept if d != full and d not in measured)
    if never:
        raise ExitplanError(f"{model}: depth {never[0]} of {full} layers is in the perf DB but its quality was never "
                            f"measured (the exit profile measured {sorted(measured)}): remove it from "
                            f"build_perf_db.partial_layers or add an exit there")
    return sorted({*swept, full})
