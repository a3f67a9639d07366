"""What each model is routed: its latency curves simulated on the prompts the router sends it, share by share.

The perf DB gives every model the workload's whole mix of lengths, but a router does not: on this machine's workload
the plan's router sent the 1.5B prompts of mean 66 tokens (P95 113) and the 0.5B prompts of mean 276 (P95 1,405),
against a whole-mix mean of 199 (P95 1,145) - and a prefill of 1,000 tokens costs seconds on a CPU replica. So the
planner promised the 1.5B a P95 twice what it measured (``docs/measurements.md``, thirteenth session).

Queries are ordered by routing score (:mod:`exitplan.routing.fractions`): at a share ``s`` of the load the smallest
model is sent the lowest-scored ``s`` of the traffic and the largest the highest-scored ``s``. For each share of a grid
the curves of a model's layouts are simulated again on the lengths of the queries of a scored traffic sample that it
would be sent (:func:`routed_db`), and the planner reads a model at fraction ``f`` from the two grid shares around
``f``, blended linearly (:func:`curves_at`). A model between the smallest and the largest (``K > 2``) is sent a band
whose place depends on every fraction, not on its own share alone: it keeps the whole mix.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from exitplan.errors import ExitplanError
from exitplan.simulator.curve import LatencyCurve

Lengths = tuple[np.ndarray, np.ndarray]
"""(prompt tokens, answer tokens) of a set of queries."""


def routed_lengths(scores: np.ndarray, lengths: Lengths, share: float, last: bool) -> Lengths:
    """The lengths of the queries the smallest model (``last`` false) or the largest (true) is sent at ``share`` of
    the traffic: the ``ceil(share x n)`` lowest- or highest-scored of ``n`` scored queries (at least one).

    Raises:
        ExitplanError: scores and lengths of different sizes, no query, or a share outside (0, 1].
    """
    scores = np.asarray(scores, float)
    if not len(scores) or any(len(x) != len(scores) for x in lengths):
        raise ExitplanError(f"routed lengths need a length pair per scored query (got {len(scores)} scores, "
                            f"{[len(x) for x in lengths]} lengths)")
    if not 0 < share <= 1:
        raise ExitplanError(f"a routed share must lie in (0, 1] (got {share})")
    count = max(1, int(np.ceil(share * len(scores) - 1e-9)))
    order = np.argsort(scores, kind="stable")
    picked = order[-count:] if last else order[:count]
    return np.asarray(lengths[0])[picked], np.asarray(lengths[1])[picked]


def routed_db(scores: np.ndarray, lengths: Lengths, models: Sequence[str], shares: Sequence[float],
              simulate: Callable[[dict[str, Lengths]], Any]) -> Any:
    """Perf-DB rows of the smallest and the largest of ``models`` at each routed share, with a ``share`` column.

    Args:
        scores: Routing scores of a sample of the traffic.
        lengths: Its (prompt, answer) tokens, query by query.
        models: The scenario's models, smallest first.
        shares: Shares of the load in (0, 1].
        simulate: Model -> its lengths, to perf-DB rows of those models (each layout at each load).
    """
    import pandas as pd

    frames = []
    ends = {models[0]: False, models[-1]: True}
    for share in sorted(set(shares)):
        rows = simulate({m: routed_lengths(scores, lengths, share, last) for m, last in ends.items()})
        frames.append(rows.assign(share=float(share)))
    return pd.concat(frames, ignore_index=True)


def share_curves(routed: Any, model: str, gpus: Sequence[str], metric: str,
                 layers: Sequence[int] | None = None) -> dict[float, dict[tuple, LatencyCurve]]:
    """Per share, the curves of ``model``'s layouts in the routed rows (empty when they hold none of it)."""
    from exitplan.planner.build import deployment_curves

    if routed is None:
        return {}
    mine = routed[(routed["model"] == model) & routed["gpu"].isin(list(gpus))]
    if layers is not None:
        mine = mine[mine["layers"].isin(list(layers))]
    return {float(s): deployment_curves(rows, model, gpus, metric, sorted(set(rows["layers"])))
            for s, rows in mine.groupby("share")}


def curves_at(base: Mapping[tuple, LatencyCurve], by_share: Mapping[float, Mapping[tuple, LatencyCurve]],
              share: float) -> dict[tuple, LatencyCurve]:
    """A model's curves at ``share`` of the load: each layout that has routed curves blended linearly between the
    two grid shares around ``share`` (the nearest end beyond the grid); the others as ``base`` has them."""
    out = dict(base)
    if not by_share:
        return out
    grid = sorted(by_share)
    hi = int(np.searchsorted(grid, share))
    if hi == 0 or hi == len(grid):
        out.update(by_share[grid[min(hi, len(grid) - 1)]])
        return out
    lo_s, hi_s = grid[hi - 1], grid[hi]
    weight = (share - lo_s) / (hi_s - lo_s)
    for key, curve in by_share[lo_s].items():
        if key in by_share[hi_s]:
            out[key] = curve.blend(by_share[hi_s][key], weight)
    return out
