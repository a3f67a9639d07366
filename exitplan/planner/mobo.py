"""BOUTE's multi-objective Bayesian optimisation over routing fractions x deployment choice.

Surrogates: one GP per outcome on ``log L`` (latency) and ``logit Q`` (quality), standardised, in double precision.
Kernel (BOUTE's structural information): an additive kernel - ARD Matern-5/2 on the routing coordinates plus
Matern-3/2 on the deployment coordinates - plus a small learned product term, with the deployment part weighted by
GPU preference ``w(c) = exp(beta * sum_mn a_mn s_mn)`` (``a_mn``: share of model ``m``'s GPUs of type ``n``;
``s_mn``: how well type ``n`` serves model ``m``, its capacity per dollar, normalised). Acquisition:
``qLogNoisyExpectedHypervolumeImprovement`` with outcome constraints L <= L_max and Q >= Q_min when given; it is
maximised over a pool of feasible points (the deployment coordinates are discrete), ``q`` points per round. Every
evaluation is a perf-DB look-up through :class:`PlanProblem`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from exitplan.planner.problem import Plan, PlanProblem
from exitplan.simulator.curve import INF


@dataclass
class MoboResult:
    """Evaluations in order, and seconds spent.

    Attributes:
        plans: Every evaluated plan, in evaluation order.
        seconds: Wall time of the run.
        history_s: Seconds elapsed at each evaluation.
    """

    plans: list[Plan] = field(default_factory=list)
    seconds: float = 0.0
    history_s: list[float] = field(default_factory=list)


def gpu_preference(problem: PlanProblem) -> dict[str, dict[str, float]]:
    """``s_mn``: per model, each GPU type's best capacity per dollar over its layouts, normalised to max 1."""
    prefs = {}
    for m in problem.models:
        per = {}
        for (gpu, tp, pp, _), curve in problem.curves[m].items():
            cands = [g for c in problem.candidates[m] for g in c.groups if g.gpu == gpu]
            price = cands[0].price_per_gpu if cands else None
            if price:
                per[gpu] = max(per.get(gpu, 0.0), curve.capacity / (tp * pp * price))
        top = max(per.values(), default=1.0) or 1.0
        prefs[m] = {g: v / top for g, v in per.items()}
    return prefs


def preference_tables(problem: PlanProblem, prefs: Mapping[str, Mapping[str, float]]) -> list[np.ndarray]:
    """Per model, ``sum_n a_mn s_mn`` of each of its candidates (indexed like the candidate list)."""
    tables = []
    for m in problem.models:
        row = []
        for cand in problem.candidates[m]:
            gpus = sum(g.gpus for g in cand.groups) or 1
            row.append(sum(g.gpus / gpus * prefs[m].get(g.gpu, 0.0) for g in cand.groups))
        tables.append(np.asarray(row))
    return tables


def _preference_kernel(base, dims: list[int], tables: list[np.ndarray], beta: float):
    """``w(x) k(x, x') w(x')`` with ``w`` the GPU-preference weight of the deployment ``x`` decodes to."""
    import torch
    from gpytorch.kernels import Kernel

    class PreferenceWeighted(Kernel):
        def __init__(self) -> None:
            super().__init__()
            self.base = base
            self._tables = [torch.tensor(t, dtype=torch.double) for t in tables]

        def weight(self, x: torch.Tensor) -> torch.Tensor:
            total = torch.zeros(x.shape[:-1], dtype=x.dtype)
            for dim, table in zip(dims, self._tables, strict=True):
                index = (x[..., dim] * len(table)).floor().clamp(0, len(table) - 1).long()
                total = total + table[index]
            return torch.exp(beta * total)

        def forward(self, x1: torch.Tensor, x2: torch.Tensor, diag: bool = False, **params) -> torch.Tensor:
            k = self.base(x1, x2, diag=diag, **params)
            k = k if diag else k.to_dense()
            w1, w2 = self.weight(x1), self.weight(x2)
            return w1 * k * w2 if diag else w1[..., :, None] * k * w2[..., None, :]

    return PreferenceWeighted()


def _kernel(problem: PlanProblem, structured: bool, tables: list[np.ndarray] | None = None, beta: float = 0.0):
    """BOUTE's additive kernel on the problem's coordinates (or a plain ARD Matern-5/2 when not ``structured``)."""
    from gpytorch.kernels import MaternKernel, ProductKernel, ScaleKernel
    from gpytorch.priors import GammaPrior

    d = problem.dim
    if not structured:
        return ScaleKernel(MaternKernel(nu=2.5, ard_num_dims=d))
    r, c = problem.routing_dims, problem.deployment_dims
    routing = ScaleKernel(MaternKernel(nu=2.5, ard_num_dims=len(r), active_dims=r))
    deployment = ScaleKernel(MaternKernel(nu=1.5, ard_num_dims=len(c), active_dims=c))
    if tables is not None and beta:
        deployment = _preference_kernel(deployment, c, tables, beta)
    product = ScaleKernel(ProductKernel(MaternKernel(nu=2.5, ard_num_dims=len(r), active_dims=r),
                                        MaternKernel(nu=1.5, ard_num_dims=len(c), active_dims=c)),
                          outputscale_prior=GammaPrior(1.0, 20.0))  # small interaction term
    return routing + deployment + product


def _targets(plans: list[Plan], worst_latency: float) -> np.ndarray:
    """Model outcomes (both maximised): ``-log L`` (an infeasible latency counts as twice the worst) and
    ``logit Q``."""
    lat = np.asarray([p.latency if p.latency < INF else 2 * worst_latency for p in plans])
    q = np.clip(np.asarray([p.quality for p in plans]), 1e-4, 1 - 1e-4)
    return np.stack([-np.log(lat), np.log(q / (1 - q))], axis=1)


def _corners(problem: PlanProblem) -> list[np.ndarray]:
    """Structural prior: all load on one model with its fastest (dearest) candidate - one point per model."""
    points = []
    k = len(problem.models)
    for i in range(k):
        theta = np.ones(problem.dim)
        for d in range(k - 1):  # stick-breaking: u_d = 0 stops the load at model d
            theta[d] = 0.0 if d == i else 1.0
        for j, m in enumerate(problem.models):
            theta[problem.deployment_dims[j]] = 1.0 - 0.5 / len(problem.candidates[m])
        points.append(theta)
    return points


def _any_feasible(problem: PlanProblem) -> bool:
    """Whether some plan is feasible (all load on one model, its cheapest candidate, is the easiest)."""
    k = len(problem.models)
    return any(problem.feasible(np.eye(k)[i], [0] * k) for i in range(k))


def _pool(problem: PlanProblem, size: int, rng: np.random.Generator, tries: int = 200) -> np.ndarray:
    """Random feasible points, deployment coordinates snapped to candidate centres (the discrete choices); a
    routing coordinate is pushed to an end now and then, so plans that load only some models are in the pool."""
    points = []
    for _ in range(size * tries):
        if len(points) >= size:
            break
        theta = rng.uniform(size=problem.dim)
        for d in problem.routing_dims:
            if rng.uniform() < 0.15:
                theta[d] = float(rng.integers(2))
        fractions = problem.fractions(theta)
        choice = problem.repair(fractions, problem.choice(theta))
        if choice is None:
            continue
        for i, (m, k) in enumerate(zip(problem.models, choice, strict=True)):
            theta[problem.deployment_dims[i]] = (k + 0.5) / len(problem.candidates[m])
        points.append(theta)
    return np.asarray(points)


def optimise(problem: PlanProblem, evaluations: int = 40, initial: int = 8, q: int = 4, seed: int = 0,
             structured: bool = True, beta: float = 1.0, max_latency: float | None = None,
             min_quality: float | None = None, pool_size: int = 1024) -> MoboResult:
    """Run MOBO for ``evaluations`` plans (``initial`` of them from a Sobol design).

    Args:
        problem: The co-optimisation problem.
        evaluations: Plans to evaluate in all.
        initial: Sobol points first.
        q: Plans per round.
        seed: Seed of the design, pools and MC samplers.
        structured: BOUTE's kernel and GPU preference (``False``: a plain ARD Matern-5/2, for the ablation).
        beta: GPU preference strength.
        max_latency: Outcome constraint L <= this (seconds), if any.
        min_quality: Outcome constraint Q >= this, if any.
        pool_size: Feasible points the acquisition is maximised over per round.
    """
    import torch
    from botorch.acquisition.multi_objective.logei import qLogNoisyExpectedHypervolumeImprovement
    from botorch.fit import fit_gpytorch_mll
    from botorch.models import ModelListGP, SingleTaskGP
    from botorch.models.transforms.outcome import Standardize
    from botorch.optim import optimize_acqf_discrete
    from botorch.sampling import SobolQMCNormalSampler
    from gpytorch.mlls import SumMarginalLogLikelihood
    from torch.quasirandom import SobolEngine

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    started = time.perf_counter()
    result = MoboResult()
    tables = preference_tables(problem, gpu_preference(problem))
    xs: list[np.ndarray] = []

    def run(theta: np.ndarray) -> None:
        plan = problem.evaluate(theta)
        if plan is not None:
            xs.append(np.asarray(theta, float))
            result.plans.append(plan)
            result.history_s.append(time.perf_counter() - started)

    for theta in [*_corners(problem), *SobolEngine(problem.dim, scramble=True, seed=seed).draw(initial).double()
                  .numpy()][:max(initial, len(problem.models))]:
        run(theta)
    for _ in range(50 * initial):  # top up the design where most of the cube is infeasible
        if len(result.plans) >= min(initial, 2):
            break
        pool = _pool(problem, 1, rng) if _any_feasible(problem) else np.empty((0, problem.dim))
        if len(pool):
            run(pool[0])
    if len(result.plans) < 2:
        from exitplan.errors import ExitplanError

        raise ExitplanError("fewer than two feasible plans found: the budget or the GPUs available are too tight "
                            "for these models at this load")
    while len(result.plans) < evaluations:
        worst = max((p.latency for p in result.plans if p.latency < INF), default=1.0)
        x = torch.tensor(np.asarray(xs), dtype=torch.double)
        y = torch.tensor(_targets(result.plans, worst), dtype=torch.double)
        models = []
        for k in range(2):
            gp = SingleTaskGP(x, y[:, k:k + 1], covar_module=_kernel(problem, structured, tables, beta),
                              outcome_transform=Standardize(m=1))
            models.append(gp)
        model = ModelListGP(*models)
        fit_gpytorch_mll(SumMarginalLogLikelihood(model.likelihood, model))
        ref = (y.min(dim=0).values - 0.1 * (y.max(dim=0).values - y.min(dim=0).values).clamp(min=1e-3)).tolist()
        constraints = []
        if max_latency is not None:
            constraints.append(lambda z, b=-math.log(max_latency): b - z[..., 0])
        if min_quality is not None:
            mq = min(max(min_quality, 1e-4), 1 - 1e-4)
            constraints.append(lambda z, b=math.log(mq / (1 - mq)): b - z[..., 1])
        acq = qLogNoisyExpectedHypervolumeImprovement(
            model, ref_point=ref, X_baseline=x, prune_baseline=True, constraints=constraints or None,
            sampler=SobolQMCNormalSampler(torch.Size([64]), seed=int(rng.integers(1 << 30))))
        pool = _pool(problem, pool_size, rng)
        if not len(pool):
            break
        chosen, _ = optimize_acqf_discrete(acq, q=min(q, evaluations - len(result.plans)),
                                           choices=torch.tensor(pool, dtype=torch.double))
        for theta in chosen.numpy():
            run(theta)
    result.seconds = time.perf_counter() - started
    return result
