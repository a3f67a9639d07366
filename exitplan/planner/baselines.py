"""Baselines on the same perf DB and labels, each the best plan it can find for the SLO's quality floor.

- ``single-<model>``: all load on one model, its deployment chosen freely (heterogeneous GPUs);
- ``single-<model>-homo``: the same on one GPU type;
- ``routellm-uniform``: routing fractions optimised (RouteLLM-style), GPUs split uniformly (BOUTE's RouteLLM
  baseline: the same resources for every model type) - each model may use ``1/K`` of the GPUs of each type, within
  the one budget;
- ``routellm-uniform-budget``: the same with the budget split instead - each model gets ``1/K`` of it;
- ``homogeneous`` (BOUTE-Homo): fractions and deployments optimised, all models on one GPU type.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from exitplan.planner.problem import Plan, PlanProblem, best_under
from exitplan.planner.search import fastest, fraction_grid


def on_one_type(problem: PlanProblem, gpu: str) -> Callable[[int, int], bool]:
    """``allowed(model, candidate)``: the candidate uses only GPUs of type ``gpu``."""
    def ok(model: int, cand: int) -> bool:
        return all(g.gpu == gpu for g in problem.candidates[problem.models[model]][cand].groups)
    return ok


def even_gpus(problem: PlanProblem) -> Callable[[int, int], bool]:
    """``allowed(model, candidate)``: the candidate uses at most ``1/K`` of the GPUs of each type (``K`` models)."""
    k = len(problem.models)

    def ok(model: int, cand: int) -> bool:
        chosen = problem.candidates[problem.models[model]][cand]
        return all(chosen.gpus(g) <= n // k for g, n in problem.available.items())
    return ok


def baselines(problem: PlanProblem, min_quality: float, max_latency: float = float("inf"),
              steps: int = 20) -> dict[str, Plan | None]:
    """Each baseline's best plan meeting the quality floor (``None`` when it cannot)."""
    k = len(problem.models)
    grid = fraction_grid(k, steps)
    gpus = sorted({g.gpu for cands in problem.candidates.values() for c in cands for g in c.groups})
    out: dict[str, Plan | None] = {}
    for i, m in enumerate(problem.models):
        alone = [np.eye(k)[i]]
        out[f"single-{m}"] = best_under(fastest(problem, alone), max_latency, min_quality)
        homo = [p for g in gpus for p in fastest(problem, alone, on_one_type(problem, g))]
        out[f"single-{m}-homo"] = best_under(homo, max_latency, min_quality)
    out["routellm-uniform"] = best_under(fastest(problem, grid, even_gpus(problem)), max_latency, min_quality)
    out["routellm-uniform-budget"] = best_under(fastest(problem, grid, share=1.0 / k), max_latency, min_quality)
    homo = [p for g in gpus for p in fastest(problem, grid, on_one_type(problem, g))]
    out["homogeneous"] = best_under(homo, max_latency, min_quality)
    return out


def paper_baselines(problem: PlanProblem, min_quality: float, homo_gpu: str, steps: int = 20) -> dict[str, Plan | None]:
    """BOUTE's baselines (section 6.1) by its names: each one's best plan meeting the quality floor.

    ``None`` for a baseline that cannot meet it. The largest model is the problem's last.

    - ``stand-alone-homo``: the largest model alone on ``homo_gpu`` GPUs only (BOUTE: on H100s);
    - ``stand-alone-hetero``: the largest model alone on any GPUs;
    - ``routellm-count``: routing optimised, each model on at most ``1/K`` of the GPUs of each type;
    - ``routellm-budget``: routing optimised, each model within ``1/K`` of the budget;
    - ``boute-homo``: routing and deployment optimised on ``homo_gpu`` GPUs only.
    """
    k = len(problem.models)
    grid = fraction_grid(k, steps)
    alone = [np.eye(k)[k - 1]]
    homo = on_one_type(problem, homo_gpu)
    found = {"stand-alone-homo": fastest(problem, alone, homo), "stand-alone-hetero": fastest(problem, alone),
             "routellm-count": fastest(problem, grid, even_gpus(problem)),
             "routellm-budget": fastest(problem, grid, share=1.0 / k), "boute-homo": fastest(problem, grid, homo)}
    return {name: best_under(plans, min_quality=min_quality) for name, plans in found.items()}
