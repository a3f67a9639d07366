"""Baselines on the same perf DB and labels, each the best plan it can find for the SLO's quality floor.

- ``single-<model>``: all load on one model, its deployment chosen freely (heterogeneous GPUs);
- ``single-<model>-homo``: the same on one GPU type;
- ``routellm-uniform``: routing fractions optimised (RouteLLM-style), GPUs split uniformly - every model gets the
  same share of the budget and its best candidate within it;
- ``homogeneous`` (BOUTE-Homo): fractions and deployments optimised, all models on one GPU type.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from exitplan.planner.problem import Plan, PlanProblem, best_under
from exitplan.planner.search import fraction_grid


def _on_one_type(problem: PlanProblem, gpu: str) -> Callable[[int, int], bool]:
    def ok(model: int, cand: int) -> bool:
        return all(g.gpu == gpu for g in problem.candidates[problem.models[model]][cand].groups)
    return ok


def _plans(problem: PlanProblem, fractions: list[np.ndarray], allowed: Callable[[int, int], bool],
           share: float | None = None) -> list[Plan]:
    """Feasible plans over ``fractions`` x the allowed candidates (each under ``share`` x budget if given)."""
    import itertools

    per_model = []
    for i, m in enumerate(problem.models):
        options = [c for c in range(len(problem.candidates[m])) if allowed(i, c)
                   and (share is None or problem.candidates[m][c].cost <= share * problem.budget + 1e-9)]
        per_model.append(options)
    plans = []
    for f in fractions:
        for choice in itertools.product(*per_model):
            if problem.feasible(f, choice):
                plans.append(problem.evaluate_plan(f, choice))
    return plans


def baselines(problem: PlanProblem, min_quality: float, max_latency: float = float("inf"),
              steps: int = 20) -> dict[str, Plan | None]:
    """Each baseline's best plan meeting the quality floor (``None`` when it cannot)."""
    k = len(problem.models)
    grid = fraction_grid(k, steps)
    gpus = sorted({g.gpu for cands in problem.candidates.values() for c in cands for g in c.groups})
    out: dict[str, Plan | None] = {}
    for i, m in enumerate(problem.models):
        alone = [np.eye(k)[i]]
        out[f"single-{m}"] = best_under(_plans(problem, alone, lambda *_: True), max_latency, min_quality)
        homo = [p for g in gpus for p in _plans(problem, alone, _on_one_type(problem, g))]
        out[f"single-{m}-homo"] = best_under(homo, max_latency, min_quality)
    out["routellm-uniform"] = best_under(_plans(problem, grid, lambda *_: True, share=1.0 / k), max_latency,
                                         min_quality)
    homo = [p for g in gpus for p in _plans(problem, grid, _on_one_type(problem, g))]
    out["homogeneous"] = best_under(homo, max_latency, min_quality)
    return out
