"""When a search has converged, by BOUTE's rule: its solution unchanged for a number of evaluations in a row.

BOUTE (section 6.4) reports a scheduler's time to converge as the time until its solution stops changing for 20
iterations. The solution here is the plan the search would pick: the lowest P95 meeting the quality floor
(cheapest on ties, :func:`exitplan.planner.problem.best_under`). One iteration is one evaluated plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from exitplan.planner.problem import Plan, best_under

PATIENCE = 20
"""Evaluations in a row without a change of solution after which a search has converged (BOUTE's 20 iterations)."""


@dataclass(frozen=True)
class Convergence:
    """Where a search settled.

    Attributes:
        found_at: The evaluation (1-based) that found the final solution (``None``: none meets the floor).
        stop_at: The evaluation at which the rule stops the search: ``found_at + patience``, or ``None`` when the
            search hit its cap first (not converged).
    """

    found_at: int | None
    stop_at: int | None

    @property
    def converged(self) -> bool:
        """Whether the solution stayed unchanged for ``patience`` evaluations before the cap."""
        return self.stop_at is not None


def convergence(plans: Sequence[Plan], min_quality: float, patience: int = PATIENCE) -> Convergence:
    """Where the search that evaluated ``plans`` (in order) converged under BOUTE's rule: its final solution is
    :func:`best_under` of all its plans, found at the first evaluation of it."""
    best = best_under(plans, min_quality=min_quality)
    if best is None:
        return Convergence(None, None)
    found_at = next(i for i, plan in enumerate(plans, 1) if plan is best)
    stop = found_at + patience
    return Convergence(found_at, stop if stop <= len(plans) else None)
