"""Load fractions <-> score thresholds, and the quality curve Q(f) they give.

Queries are ordered by routing score (low: the smallest model suffices). Fractions ``f_1..f_K`` (summing to 1) send
the lowest-scoring ``f_1`` of the queries to model 1, the next ``f_2`` to model 2, and so on; the thresholds are the
score quantiles at the cumulative fractions of a recent window of scores, so new queries are split in the asked
proportions as long as the score distribution holds.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from exitplan.errors import ExitplanError


def check_fractions(fractions: Sequence[float]) -> np.ndarray:
    """``fractions`` as an array, checked to be non-negative and to sum to 1.

    Raises:
        ExitplanError: naming the problem.
    """
    f = np.asarray(fractions, float)
    if f.ndim != 1 or len(f) < 1 or np.any(f < 0) or abs(f.sum() - 1) > 1e-6:
        raise ExitplanError(f"load fractions must be >= 0 and sum to 1 (got {list(f)})")
    return f


def thresholds(window: np.ndarray, fractions: Sequence[float]) -> np.ndarray:
    """The ``K - 1`` score thresholds that split ``window`` (recent scores) by ``fractions``."""
    f = check_fractions(fractions)
    cumulative = np.cumsum(f)[:-1]
    cuts = np.quantile(np.asarray(window, float), np.clip(cumulative, 0, 1))
    cuts[cumulative <= 1e-12] = -np.inf  # nothing for the models below: every score routes past this cut
    cuts[cumulative >= 1 - 1e-12] = np.inf  # nothing for the models above
    return cuts


def route(scores: np.ndarray, cuts: np.ndarray) -> np.ndarray:
    """Model index (0 = smallest) of each query: how many thresholds its score exceeds."""
    return np.searchsorted(np.asarray(cuts), np.asarray(scores), side="right")


def quality_curve(scores: np.ndarray, qualities: np.ndarray, fractions: np.ndarray) -> np.ndarray:
    """Mean quality when each row of ``fractions`` (``m x K``) splits these held-out queries by their scores.

    Args:
        scores: Routing scores of the held-out queries, ``n``.
        qualities: Measured quality of each query on each model, ``n x K``.
        fractions: Fraction vectors, ``m x K``.

    Returns:
        ``m`` mean qualities.
    """
    out = []
    for f in np.atleast_2d(fractions):
        chosen = route(scores, thresholds(scores, f))
        out.append(float(np.mean(qualities[np.arange(len(scores)), chosen])))
    return np.asarray(out)
