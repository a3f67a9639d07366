"""Routing coordinates as the router's score thresholds: the search space without BOUTE's load-share encoding.

BOUTE (S1) does not optimise the routing thresholds ``tau`` themselves: it re-parameterises them as load shares,
because a small move of a threshold where the scores are dense moves much load at once, and the load share is what
latency is (near) linear in. :class:`ThresholdProblem` is the same problem with the routing coordinates read as
thresholds instead - each coordinate a threshold on the router's score scale, ``0`` at the lowest score of its
window and ``1`` past the highest - for the ablation of that encoding (``benchmarks/boute_eval.py``, Table 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from exitplan.errors import ExitplanError
from exitplan.planner.problem import PlanProblem


@dataclass
class ThresholdProblem(PlanProblem):
    """A :class:`PlanProblem` whose ``K - 1`` routing coordinates are score thresholds (sorted), scaled to the
    score window: model ``k`` takes the queries whose score lies between thresholds ``k - 1`` and ``k``.

    Attributes:
        scores: The router's window of recent scores, sorted (the load a threshold sends each way is read off it;
            :func:`threshold_problem` sorts them).
    """

    scores: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def _span(self) -> tuple[float, float]:
        """The score scale's ends: just below the lowest score and just past the highest."""
        lo, hi = float(self.scores[0]), float(self.scores[-1])
        pad = 1e-9 * max(1.0, hi - lo)
        return lo - pad, hi + pad

    def fractions(self, theta: np.ndarray) -> np.ndarray:
        """Load fractions the thresholds of ``theta``'s routing coordinates give on the score window."""
        lo, hi = self._span()
        cuts = lo + np.sort(np.asarray(theta, float)[: len(self.models) - 1]) * (hi - lo)
        below = np.searchsorted(self.scores, cuts, side="left") / len(self.scores)
        return np.diff(np.concatenate([[0.0], below, [1.0]]))

    def routing_theta(self, fractions: np.ndarray) -> np.ndarray:
        """Threshold coordinates that send (as near as the window allows) ``fractions`` of it to each model: each
        cut halfway between the last score of one model's share and the first of the next."""
        lo, hi = self._span()
        n = len(self.scores)
        out = []
        for c in np.cumsum(np.asarray(fractions, float))[:-1]:
            k = int(round(float(c) * n))
            cut = lo if k <= 0 else hi if k >= n else 0.5 * (self.scores[k - 1] + self.scores[k])
            out.append((cut - lo) / (hi - lo))
        return np.asarray(out)


def threshold_problem(problem: PlanProblem, scores: np.ndarray) -> ThresholdProblem:
    """``problem`` with its routing coordinates read as thresholds on ``scores`` (the router's window).

    Raises:
        ExitplanError: fewer than two distinct scores (no threshold can split them).
    """
    scores = np.asarray(scores, float)
    if scores.ndim != 1 or not np.all(np.isfinite(scores)) or len(np.unique(scores)) < 2:
        raise ExitplanError("the threshold encoding needs at least two distinct, finite routing scores")
    shared = {f.name: getattr(problem, f.name) for f in fields(PlanProblem) if f.name != "_cache"}
    return ThresholdProblem(**shared, scores=np.sort(scores))
