"""BOUTE's multi-objective Bayesian optimisation over routing fractions x deployment choice.

Surrogates: one GP per outcome on ``log L`` (latency) and ``logit Q`` (quality), standardised, in double precision.
Kernel (BOUTE's structural information): an additive kernel - ARD Matern-5/2 on the routing coordinates plus
Matern-3/2 on the deployment coordinates - plus a small learned product term, with the deployment part weighted by
GPU preference ``w(c) = exp(beta * sum_mn a_mn s_mn)`` (``a_mn``: share of model ``m``'s GPUs of type ``n``;
``s_mn``: how well type ``n`` serves model ``m``, its capacity per dollar, normalised). Acquisition:
``qLogNoisyExpectedHypervolumeImprovement`` with outcome constraints L <= L_max and Q >= Q_min when given; it is
maximised over a pool of points within the budget and the GPUs (the deployment coordinates are discrete), ``q``
points per round. Every evaluation is a perf-DB look-up through :class:`PlanProblem`.

Seed-robustness (issue 30): the design holds, besides the corners, each split's cheapest carrying deployment
(:func:`feasible_design`) and its budget-filling one (:func:`filled_design`); local moves re-deploy a moved split
within the budget; with SLOs the last rounds refine the best plan meeting them (:data:`LATE_AFTER`).

Plans that cannot carry their load (infinite latency) are modelled as BoTorch supports it: a third GP on the plan's
headroom (log capacity / load, smooth where latency has a cliff) and the outcome constraint headroom >= 0, which
qLogNEHVI weighs by its probability; the latency GP sees only feasible plans (``feasibility="constraint"``, the
default). ``feasibility="penalty"`` keeps the first design (an infeasible plan counts as twice the worst latency),
for comparison.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from exitplan.planner.convergence import convergence
from exitplan.planner.problem import MIN_SHARE, Plan, PlanProblem, pareto
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
        per: dict[str, float] = {}
        for (gpu, tp, pp, _), curve in problem.curves[m].items():
            cands = [g for c in problem.candidates[m] for g in c.groups if g.gpu == gpu]
            price = cands[0].price_per_gpu if cands else None
            if price:
                per[gpu] = max(per.get(gpu, 0.0), curve.capacity / (tp * pp * price))
        top = max(per.values(), default=1.0) or 1.0
        prefs[m] = {g: v / top for g, v in per.items()}
    return prefs


def preference_tables(problem: PlanProblem, prefs: Mapping[str, Mapping[str, float]]) -> list[np.ndarray]:
    """Per model, ``sum_n a_mn s_mn`` of each of its candidates: indexed like the candidate list, or, when the
    problem plans depth, a ``depths x candidates`` table indexed like the deployment coordinate at each depth
    (rows padded with their last value)."""
    tables = []
    for i, m in enumerate(problem.models):
        row = []
        for cand in problem.candidates[m]:
            gpus = sum(g.gpus for g in cand.groups) or 1
            row.append(sum(g.gpus / gpus * prefs[m].get(g.gpu, 0.0) for g in cand.groups))
        if problem.plans_depth:
            rows = [[row[c] for c in problem.at_depth(i, d)] for d in problem.depths(i)]
            width = max(map(len, rows))
            tables.append(np.asarray([r + [r[-1]] * (width - len(r)) for r in rows]))
        else:
            tables.append(np.asarray(row))
    return tables


def _depth_counts(problem: PlanProblem) -> list[list[int]]:
    """Per model, how many candidates each of its depths has (shallowest first); ``[]`` without depth."""
    if not problem.plans_depth:
        return [[] for _ in problem.models]
    return [[len(problem.at_depth(i, d)) for d in problem.depths(i)] for i in range(len(problem.models))]


def _preference_kernel(base, dims: list[int], tables: list[np.ndarray], beta: float,
                       depth_dims: Sequence[int] = (), counts: Sequence[Sequence[int]] = ()):
    """``w(x) k(x, x') w(x')`` with ``w`` the GPU-preference weight of the deployment ``x`` decodes to (its depth
    coordinate picking the row of a 2-D table, ``counts`` the candidates at each depth)."""
    import torch
    from gpytorch.kernels import Kernel

    class PreferenceWeighted(Kernel):
        def __init__(self) -> None:
            super().__init__()
            self.base = base
            self._tables = [torch.tensor(t, dtype=torch.double) for t in tables]
            self._counts = [torch.tensor(list(c), dtype=torch.double) for c in counts]

        def weight(self, x: torch.Tensor) -> torch.Tensor:
            total = torch.zeros(x.shape[:-1], dtype=x.dtype)
            for j, (dim, table) in enumerate(zip(dims, self._tables, strict=True)):
                if table.dim() == 1:
                    index = (x[..., dim] * len(table)).floor().clamp(0, len(table) - 1).long()
                    total = total + table[index]
                    continue
                depth = (x[..., depth_dims[j]] * len(table)).floor().clamp(0, len(table) - 1).long()
                n = self._counts[j][depth]
                index = (x[..., dim] * n).floor().clamp(min=0).minimum(n - 1).long()
                total = total + table[depth, index]
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
    r, c, z = problem.routing_dims, problem.deployment_dims, problem.depth_dims
    routing = ScaleKernel(MaternKernel(nu=2.5, ard_num_dims=len(r), active_dims=r))
    deployment = ScaleKernel(MaternKernel(nu=1.5, ard_num_dims=len(c), active_dims=c))
    if tables is not None and beta:
        deployment = _preference_kernel(deployment, c, tables, beta, z, _depth_counts(problem))
    product = ScaleKernel(ProductKernel(MaternKernel(nu=2.5, ard_num_dims=len(r), active_dims=r),
                                        MaternKernel(nu=1.5, ard_num_dims=len(c), active_dims=c)),
                          outputscale_prior=GammaPrior(1.0, 20.0))  # small interaction term
    if not z:
        return routing + deployment + product
    # Depth: an ordered choice per model (its coordinate's cells are the depths, shallowest first, so nearby
    # cells are nearby depths: a stationary kernel on the ordinal coordinate). Depth moves quality with the load
    # routed to the model, so it interacts with routing too.
    depth = ScaleKernel(MaternKernel(nu=2.5, ard_num_dims=len(z), active_dims=z))
    with_routing = ScaleKernel(ProductKernel(MaternKernel(nu=2.5, ard_num_dims=len(r), active_dims=r),
                                             MaternKernel(nu=2.5, ard_num_dims=len(z), active_dims=z)))
    return routing + deployment + product + depth + with_routing


def _feasibility_kernel(dim: int) -> Any:
    """ARD Matern-5/2 on every coordinate for the headroom: a minimum over models of ``log capacity - log share``,
    so it is an interaction of routing and deployment that BOUTE's additive kernel would smooth away."""
    from gpytorch.kernels import MaternKernel, ScaleKernel

    return ScaleKernel(MaternKernel(nu=2.5, ard_num_dims=dim))


def _outcomes(latency: np.ndarray, quality: np.ndarray, transforms: bool = True) -> np.ndarray:
    """The modelled outcomes (both maximised) of latencies and qualities: ``-log L`` and ``logit Q`` (BOUTE's
    output transforms, S4), or ``-L`` and ``Q`` when not ``transforms`` (the ablation)."""
    lat, q = np.asarray(latency, float), np.asarray(quality, float)
    if not transforms:
        return np.stack([-lat, q], axis=-1)
    q = np.clip(q, 1e-4, 1 - 1e-4)
    return np.stack([-np.log(lat), np.log(q / (1 - q))], axis=-1)


def _targets(plans: list[Plan], worst_latency: float, transforms: bool = True) -> np.ndarray:
    """Model outcomes of ``plans`` (:func:`_outcomes`; an infeasible latency counts as twice the worst)."""
    lat = np.asarray([p.latency if p.latency < INF else 2 * worst_latency for p in plans])
    return _outcomes(lat, np.asarray([p.quality for p in plans]), transforms)


def _corners(problem: PlanProblem) -> list[np.ndarray]:
    """Structural prior: all load on one model with its fastest (dearest) candidate - one point per model."""
    points = []
    k = len(problem.models)
    for i in range(k):
        theta = np.ones(problem.dim)
        theta[problem.routing_dims] = problem.routing_theta(np.eye(k)[i])
        full = [problem.at_depth(j, problem.depths(j)[-1])[-1] for j in range(k)]
        _set_choice(problem, theta, full)
        points.append(theta)
    return points


def _cheapest_each(problem: PlanProblem, fractions: np.ndarray,
                   layers: Sequence[int] | None = None) -> list[int] | None:
    """Per model, its cheapest candidate at ``layers`` (default: full depth) that carries its share of the load
    (its depth's cheapest for an unloaded model); ``None`` when a loaded model has none, whatever the budget."""
    choice = []
    for i, f in enumerate(fractions):
        same = problem.at_depth(i, problem.depths(i)[-1] if layers is None else layers[i])
        if f < MIN_SHARE:
            choice.append(same[0])
            continue
        carrying = [c for c in same if problem.model_latency(i, c, f) < INF]
        if not carrying:
            return None
        choice.append(carrying[0])
    return choice


def cheapest_carrying(problem: PlanProblem, fractions: np.ndarray,
                      layers: Sequence[int] | None = None) -> tuple[int, ...] | None:
    """Per model, its cheapest candidate at ``layers`` (default: full depth) that carries its share of the load
    (finite P95), if the plan they make is within the budget and the GPUs; ``None`` otherwise (an unloaded model
    keeps its depth's cheapest, not deployed)."""
    choice = _cheapest_each(problem, fractions, layers)
    return tuple(choice) if choice is not None and problem.feasible(fractions, choice) else None


def fastest_within_budget(problem: PlanProblem, fractions: np.ndarray,
                          layers: Sequence[int] | None = None) -> tuple[int, ...] | None:
    """The deployment a budget-bound plan wants at these fractions and ``layers`` (default: full depth; depths are
    kept): from :func:`cheapest_carrying`, the slowest
    loaded model is moved, again and again, to its cheapest faster candidate that keeps the plan within the budget
    and the GPUs (water-filling: the budget goes in small steps to whichever model is slowest now), until the
    slowest model cannot get faster (the plan's P95 is its slowest model's); then each model takes its cheapest
    candidate within that P95 (:func:`_trimmed`). ``None`` when not even the cheapest carrying plan fits.

    Moving the slowest model to its *fastest* affordable candidate instead spent the budget on one model and left
    the next one stuck: on llama2-k3 (three models) MOBO's hypervolume share over seeds 0-4 was 0.942 0.930 0.929
    0.942 0.936; with the cheapest step 0.961 0.960 0.945 0.953 0.969 (llama2-boute and qwen-pair unchanged)."""
    start = cheapest_carrying(problem, fractions, layers)
    if start is None:
        return None
    choice = list(start)
    loaded = [i for i, f in enumerate(fractions) if f >= MIN_SHARE]
    while True:
        slowest = max(loaded, key=lambda i: problem.model_latency(i, choice[i], float(fractions[i])))
        now = problem.model_latency(slowest, choice[slowest], float(fractions[slowest]))
        better = []
        for c in problem.at_depth(slowest, problem.layers_of(slowest, choice[slowest])):
            trial = [*choice[:slowest], c, *choice[slowest + 1:]]
            latency = problem.model_latency(slowest, c, float(fractions[slowest]))
            if latency < now - 1e-12 and problem.feasible(fractions, trial):
                better.append((problem.cost(fractions, trial), latency, c))
        if not better:
            return _trimmed(problem, fractions, choice, now)
        choice[slowest] = min(better)[2]


def _trimmed(problem: PlanProblem, fractions: np.ndarray, choice: list[int], p95: float) -> tuple[int, ...]:
    """``choice`` with every loaded model moved to its cheapest candidate that still answers within ``p95`` (the
    plan's P95 is unchanged, its cost is not): without it the search spends its evaluations on cheaper copies of
    the plan it has, and BOUTE's convergence rule (a cheaper plan of the same P95 is a change) never settles."""
    out = list(choice)
    for i, f in enumerate(fractions):
        if f < MIN_SHARE:
            continue
        same = problem.at_depth(i, problem.layers_of(i, out[i]))
        for c in same[: same.index(out[i])]:
            trial = [*out[:i], c, *out[i + 1:]]
            if problem.model_latency(i, c, float(f)) <= p95 and problem.feasible(fractions, trial):
                out[i] = c
                break
    return tuple(out)


def _theta(problem: PlanProblem, fractions: np.ndarray, choice: Sequence[int]) -> np.ndarray:
    """The point that decodes to ``fractions`` and ``choice`` (deployment coordinates at candidate centres)."""
    theta = np.zeros(problem.dim)
    theta[problem.routing_dims] = problem.routing_theta(np.asarray(fractions, float))
    _set_choice(problem, theta, choice)
    return theta


def _set_choice(problem: PlanProblem, theta: np.ndarray, choice: Sequence[int]) -> None:
    """Move ``theta``'s deployment (and depth) coordinates to the centres of ``choice``'s candidates, in place."""
    for j, c in enumerate(choice):
        deployment, depth = problem.coordinates(j, c)
        theta[problem.deployment_dims[j]] = deployment
        if depth is not None:
            theta[problem.depth_dims[j]] = depth


def feasible_design(problem: PlanProblem) -> list[np.ndarray]:
    """Points that are sure to carry their load, one per model's side of the routing: all load on one model, and
    the load split evenly, each with the cheapest deployments that carry it (:func:`cheapest_carrying`); the
    fractions whose cheapest carrying plan breaks the budget or the GPUs are left out. At a load most of the cube
    cannot carry, a Sobol design may hold no plan on one model's side at all, and the search then never learns
    that side (BOUTE's design starts from each model's feasible corner)."""
    k = len(problem.models)
    points = []
    for fractions in [*np.eye(k), np.full(k, 1.0 / k)]:
        choice = cheapest_carrying(problem, fractions)
        if choice is not None:
            points.append(_theta(problem, fractions, choice))
    return points


PAIR_SPLITS = (0.25, 0.5, 0.75)
"""Shares of the load on the first model of each pair in :func:`filled_design`."""


def filled_design(problem: PlanProblem) -> list[np.ndarray]:
    """The budget-filled side of the design: all load on one model, the even split, and every pair of models at
    :data:`PAIR_SPLITS`, each deployed with :func:`fastest_within_budget` (left out where nothing fits). With the
    :func:`feasible_design` (the cheap end of each split) it spans the front's two ends at the routings a front
    is made of, so no seed starts blind to one of them."""
    k = len(problem.models)
    splits = [*np.eye(k), np.full(k, 1.0 / k)]
    for i in range(k):
        for j in range(i + 1, k):
            for share in PAIR_SPLITS:
                fractions = np.zeros(k)
                fractions[i], fractions[j] = share, 1.0 - share
                splits.append(fractions)
    chosen = [(fractions, fastest_within_budget(problem, fractions)) for fractions in splits]
    return _unique([_theta(problem, fractions, choice) for fractions, choice in chosen if choice is not None])


def _unique(points: Sequence[np.ndarray]) -> list[np.ndarray]:
    """``points`` without repeats (in order): a repeated design point would spend an evaluation on nothing."""
    seen, out = set(), []
    for theta in points:
        key = tuple(np.round(theta, 9))
        if key not in seen:
            seen.add(key)
            out.append(theta)
    return out


def _any_feasible(problem: PlanProblem) -> bool:
    """Whether some plan is feasible (all load on one model, its cheapest candidate, is the easiest)."""
    k = len(problem.models)
    return any(problem.feasible(np.eye(k)[i], [0] * k) for i in range(k))


def _neighbour(problem: PlanProblem, theta: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A point near ``theta``: one to three moves, each either a share of the load (5-20%) moved from one model to
    another - followed, a :data:`REFILL_SHARE` of the time, by the budget-filling deployment of the new split
    (:func:`fastest_within_budget`) - or one model's candidate moved up to four places in its (cost-ordered) list,
    the other models first squeezed to their cheapest carrying candidates a :data:`SQUEEZE_SHARE` of the time (so
    the budget they free can go to the moved one). Moving load and re-sizing deployments together is what a
    budget-bound front needs."""
    out = np.asarray(theta, float).copy()
    for _ in range(int(rng.integers(1, 4))):
        if rng.uniform() < 0.5:
            fractions = problem.fractions(out)
            src, dst = rng.choice(len(problem.models), size=2, replace=False)
            moved = min(float(rng.choice([0.05, 0.1, 0.2])), fractions[src])
            fractions[src] -= moved
            fractions[dst] += moved
            out[problem.routing_dims] = problem.routing_theta(fractions)
            depths = [problem.layers_of(j, c) for j, c in enumerate(problem.choice(out))]
            refill = fastest_within_budget(problem, fractions, depths) if rng.uniform() < REFILL_SHARE else None
            if refill is not None:
                _set_choice(problem, out, refill)
        elif problem.plans_depth and rng.uniform() < DEPTH_SHARE:
            i = int(rng.integers(len(problem.models)))
            d = problem.depth_dims[i]
            out[d] = float(np.clip(out[d] + rng.choice([-1, 1]) / len(problem.depths(i)), 0.0, 1.0 - 1e-9))
        else:
            i = int(rng.integers(len(problem.models)))
            if rng.uniform() < SQUEEZE_SHARE:
                now = problem.choice(out)
                cheapest = _cheapest_each(problem, problem.fractions(out),
                                          [problem.layers_of(j, c) for j, c in enumerate(now)])
                if cheapest is not None:
                    cheapest[i] = now[i]
                    _set_choice(problem, out, cheapest)
            n = len(problem.at_depth(i, problem.layers_of(i, problem.choice(out)[i])))
            d = problem.deployment_dims[i]
            out[d] = float(np.clip(out[d] + rng.choice([-4, -3, -2, -1, 1, 2, 3, 4]) / n, 0.0, 1.0 - 1e-9))
    return out


def _pool(problem: PlanProblem, size: int, rng: np.random.Generator, tries: int = 200,
          around: Sequence[np.ndarray] = (), local_share: float | None = None) -> np.ndarray:
    """Points within the budget and GPUs, deployment coordinates snapped to candidate centres (the discrete
    choices): random ones (a routing coordinate is pushed to an end now and then, so plans that load only some
    models are in the pool) and, ``local_share`` of them (:data:`LOCAL_SHARE` by default), neighbours of
    ``around`` (the current front) when given: the local moves a discrete space needs to refine a front that
    random points rarely hit."""
    share = LOCAL_SHARE if local_share is None else local_share
    points: list[np.ndarray] = []
    for _ in range(size * tries):
        if len(points) >= size:
            break
        if len(around) and rng.uniform() < share:
            theta = _neighbour(problem, around[int(rng.integers(len(around)))], rng)
        else:
            theta = rng.uniform(size=problem.dim)
            for d in problem.routing_dims:
                if rng.uniform() < 0.15:
                    theta[d] = float(rng.integers(2))
        fractions = problem.fractions(theta)
        choice = problem.repair(fractions, problem.choice(theta))
        if choice is None:
            continue
        _set_choice(problem, theta, choice)
        points.append(theta)
    return np.asarray(points)


def _incumbents(xs: Sequence[np.ndarray], plans: Sequence[Plan], max_latency: float | None,
                min_quality: float | None) -> list[np.ndarray]:
    """The points of the front of the plans that meet the SLOs (the whole front when none does, or when no SLO
    is given)."""
    ok = [(x, p) for x, p in zip(xs, plans, strict=True)
          if p.latency <= (max_latency or INF) and p.quality >= (min_quality or -INF)]
    ok = ok or list(zip(xs, plans, strict=True))
    front = {id(p) for p in pareto([p for _, p in ok])}
    return [x for x, p in ok if id(p) in front]


Feasibility = Literal["constraint", "penalty"]
"""How MOBO treats plans that cannot carry their load: ``constraint`` models the plan's headroom (log of its
capacity over its load, :meth:`PlanProblem.headroom`) with a third GP and makes "headroom >= 0" an outcome
constraint of qLogNEHVI, with the latency GP fitted on feasible plans only; ``penalty`` (the first design) feeds an
infeasible plan to the latency GP as twice the worst latency seen."""

REFILL_SHARE = 0.5
"""Share of a neighbour's routing moves followed by the budget-filling deployment of the new split. With it (and
:func:`filled_design`) the llama2-boute hypervolume over seeds 0-4 went from 0.784 at worst to 0.917 at worst."""

SQUEEZE_SHARE = 0.3
"""Share of a neighbour's deployment moves that first set the other models to their cheapest carrying candidates."""

DEPTH_SHARE = 0.5
"""When the problem plans depth: share of a neighbour's non-routing moves that step one model's depth one exit up or
down (the rest move its candidate at its depth)."""

LATE_AFTER = 20
"""With SLOs, the evaluations after which MOBO stops drawing the front and refines the best plan meeting them
(single-objective qLogNEI on latency under the SLOs, pool mostly next to the incumbents). On the GSM8K lengths at
25/50/70% on the 70B, 40 evaluations, seeds 0-4: MOBO's P95 over the exact optimum went from up to 1.66x to 1.00x in
all 15 runs. A count, not a share of the evaluations: as a share (half), a run capped at 80 for BOUTE's convergence
rule drew the front for 40 and found its plan too late to converge (``boute_eval`` Table 2)."""

LATE_SHARE = 0.8
"""Share of the late phase's pool drawn next to the incumbents."""

LOCAL_SHARE = 0.1
"""Share of the acquisition pool drawn next to the current front (the rest uniformly). Hypervolume shares after 40
evaluations, seeds 0 and 1 (Qwen pair; llama2-k3): none 0.996, 0.964; 0.768, 0.784 - a tenth 0.996, 0.998;
0.801, 0.785 - a quarter 0.924, 0.960; 0.862, 0.768 - a half 0.942, 0.998; 0.806."""

MASK_PROBABILITY = 0.5
"""The acquisition is maximised only over pool points at least this likely (by the headroom GP) to carry their
load."""

HEADROOM_CLIP = 4.0
"""Headroom targets are clipped to +-this (a plan 50x over or under its load tells the GP nothing more)."""


def _fit(x: Any, y: Any, kernel: Any) -> Any:
    """A single-output GP on ``(x, y)`` (standardised outcome) with the given kernel, its hyperparameters fitted
    by marginal likelihood; when every fitting attempt fails (a step-shaped outcome over repeated discrete points
    can do that), it keeps the kernel's initial hyperparameters rather than stopping the search."""
    from botorch.exceptions.errors import ModelFittingError
    from botorch.fit import fit_gpytorch_mll
    from botorch.models import SingleTaskGP
    from botorch.models.transforms.outcome import Standardize
    from gpytorch.mlls import ExactMarginalLogLikelihood

    gp = SingleTaskGP(x, y, covar_module=kernel, outcome_transform=Standardize(m=1))
    initial = {k: v.clone() for k, v in gp.state_dict().items()}
    try:
        fit_gpytorch_mll(ExactMarginalLogLikelihood(gp.likelihood, gp))
    except ModelFittingError:
        gp.load_state_dict(initial)
    return gp


def _surrogate(xs: list[np.ndarray], plans: list[Plan], headroom: list[float],
               feasibility: Feasibility, kernel: Callable[[], Any], transforms: bool = True) -> tuple[Any, Any]:
    """The fitted model list (outcome 2: the headroom, under ``constraint``) and the objectives' observed values
    (of the feasible plans under ``constraint``; for the reference point), outcomes as :func:`_outcomes` makes
    them. ``constraint`` needs two feasible plans."""
    import torch
    from botorch.models import ModelListGP

    x = torch.tensor(np.asarray(xs), dtype=torch.double)
    ok = np.asarray([p.latency < INF for p in plans])
    worst = max((p.latency for p in plans if p.latency < INF), default=1.0)
    y = torch.tensor(_targets(plans, worst, transforms), dtype=torch.double)
    if feasibility == "penalty":
        gps = [_fit(x, y[:, k:k + 1], kernel()) for k in range(2)]
        observed = y
    else:
        mask = torch.tensor(ok)
        h = torch.tensor(np.clip(headroom, -HEADROOM_CLIP, HEADROOM_CLIP), dtype=torch.double)[:, None]
        gps = [_fit(x[mask], y[mask, :1], kernel()), _fit(x, y[:, 1:2], kernel()),
               _fit(x, h, _feasibility_kernel(x.shape[-1]))]
        observed = y[mask]
    return ModelListGP(*gps), observed


def _latency_objective(z: Any, X: Any = None) -> Any:  # noqa: N803 (BoTorch's keyword)
    """The late phase's objective: -log L of samples ``z``."""
    return z[..., 0]


def _at_least(outcome: int, bound: float) -> Callable:
    """The constraint "outcome ``outcome`` >= ``bound``" on samples ``z`` (feasible where ``<= 0``)."""
    return lambda z: bound - z[..., outcome]


def _constraints(max_latency: float | None, min_quality: float | None, constrained: bool,
                 transforms: bool = True) -> list[Callable]:
    """Outcome constraints on samples ``z`` of the modelled outcomes (:func:`_outcomes`, then the headroom), each
    feasible where ``<= 0``."""
    out: list[Callable] = []
    latency, quality = _outcomes(np.asarray(1.0 if max_latency is None else max_latency),
                                 np.asarray(0.5 if min_quality is None else min_quality), transforms)
    if max_latency is not None:
        out.append(_at_least(0, float(latency)))
    if min_quality is not None:
        out.append(_at_least(1, float(quality)))
    if constrained:
        out.append(lambda z: -z[..., 2])
    return out


def _acquisition(model: Any, observed: Any, x: Any, constrained: bool, max_latency: float | None,
                 min_quality: float | None, seed: int, single: bool = False, transforms: bool = True) -> Any:
    """qLogNEHVI on (-log L, logit Q) (or ``-L``, ``Q`` without ``transforms``), with the SLO constraints and,
    when modelled, headroom >= 0; ``single``: qLogNEI on the latency outcome alone under the same constraints (the
    late phase's refinement of the best plan)."""
    import torch
    from botorch.acquisition.logei import qLogNoisyExpectedImprovement
    from botorch.acquisition.multi_objective.logei import qLogNoisyExpectedHypervolumeImprovement
    from botorch.acquisition.multi_objective.objective import IdentityMCMultiOutputObjective
    from botorch.acquisition.objective import GenericMCObjective
    from botorch.sampling import SobolQMCNormalSampler

    constraints = _constraints(max_latency, min_quality, constrained, transforms) or None
    sampler = SobolQMCNormalSampler(torch.Size([64]), seed=seed)
    if single:
        return qLogNoisyExpectedImprovement(model, X_baseline=x, sampler=sampler, prune_baseline=True,
                                            objective=GenericMCObjective(_latency_objective),
                                            constraints=constraints)
    span = (observed.max(dim=0).values - observed.min(dim=0).values).clamp(min=1e-3)
    ref = (observed.min(dim=0).values - 0.1 * span).tolist()
    return qLogNoisyExpectedHypervolumeImprovement(
        model, ref_point=ref, X_baseline=x, prune_baseline=True, constraints=constraints,
        objective=IdentityMCMultiOutputObjective(outcomes=[0, 1]) if constrained else None, sampler=sampler)


def _likely_feasible(gp: Any, pool: np.ndarray, keep: int, threshold: float = MASK_PROBABILITY) -> np.ndarray:
    """The pool points the headroom GP gives at least ``threshold`` probability of carrying their load (at least
    the ``keep`` likeliest): the feasibility mask on the acquisition."""
    import torch

    with torch.no_grad():
        post = gp.posterior(torch.tensor(pool, dtype=torch.double))
        mean, sd = post.mean[:, 0], post.variance[:, 0].clamp(min=1e-12).sqrt()
        prob = torch.distributions.Normal(0.0, 1.0).cdf(mean / sd).numpy()
    order = np.argsort(-prob)
    return pool[order[:max(keep, int((prob >= threshold).sum()))]]


def _most_feasible(xs: list[np.ndarray], headroom: list[float], pool: np.ndarray, q: int,
                   kernel: Callable[[], Any]) -> np.ndarray:
    """The ``q`` pool points with the highest predicted headroom (before two feasible plans are known)."""
    import torch

    h = torch.tensor(np.clip(headroom, -HEADROOM_CLIP, HEADROOM_CLIP), dtype=torch.double)[:, None]
    gp = _fit(torch.tensor(np.asarray(xs), dtype=torch.double), h, _feasibility_kernel(len(xs[0])))
    with torch.no_grad():
        mean = gp.posterior(torch.tensor(pool, dtype=torch.double)).mean[:, 0].numpy()
    return pool[np.argsort(-mean)[:q]]


def _settled(plans: list[Plan], min_quality: float | None, patience: int | None) -> bool:
    """Whether BOUTE's convergence rule would stop a search that has evaluated ``plans`` (never without
    ``patience``)."""
    floor = -INF if min_quality is None else min_quality
    return patience is not None and convergence(plans, floor, patience).converged


def _quiet(fn: Callable[..., MoboResult]) -> Callable[..., MoboResult]:
    """``fn`` with the numerical warnings of GP fitting silenced: jitter added to a near-singular covariance (plans
    repeat on a discrete space), a fit that stops early, qLogNEHVI's fallback sampling - each handled where it
    arises (:func:`_fit` keeps the initial hyperparameters), and hundreds of lines per run otherwise."""

    @functools.wraps(fn)
    def quiet(*args: Any, **kwargs: Any) -> MoboResult:
        from botorch.exceptions.warnings import BotorchWarning, OptimizationWarning
        from linear_operator.utils.warnings import NumericalWarning

        with warnings.catch_warnings():
            for category in (NumericalWarning, BotorchWarning, OptimizationWarning):
                warnings.simplefilter("ignore", category)
            return fn(*args, **kwargs)

    return quiet


@_quiet
def optimise(problem: PlanProblem, evaluations: int = 40, initial: int = 8, q: int = 4, seed: int = 0,
             structured: bool = True, beta: float = 1.0, max_latency: float | None = None,
             min_quality: float | None = None, pool_size: int = 1024,
             feasibility: Feasibility = "constraint", feasible_start: bool = True,
             transforms: bool = True, patience: int | None = None) -> MoboResult:
    """Run MOBO for ``evaluations`` plans (the design, topped up to ``initial`` with Sobol points, then rounds of
    ``q``), or until it converges by BOUTE's rule when ``patience`` is given. With an SLO, the rounds after
    :data:`LATE_AFTER` evaluations refine the best plan meeting it.

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
        feasibility: How plans that cannot carry their load are modelled (:data:`Feasibility`).
        feasible_start: Start from :func:`feasible_design` and :func:`filled_design` too (``False``: the corners
            and Sobol points only).
        transforms: BOUTE's output transforms, log latency and logit quality (``False``: raw, for the ablation).
        patience: Stop once the solution (the best plan meeting ``min_quality``) has been unchanged for this many
            evaluations (:func:`exitplan.planner.convergence.convergence`); ``None``: run all ``evaluations``.
    """
    import torch
    from botorch.optim import optimize_acqf_discrete
    from torch.quasirandom import SobolEngine

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    started = time.perf_counter()
    result = MoboResult()
    tables = preference_tables(problem, gpu_preference(problem))
    xs: list[np.ndarray] = []
    headroom: list[float] = []

    def kernel() -> Any:
        return _kernel(problem, structured, tables, beta)

    def run(theta: np.ndarray) -> None:
        plan = problem.evaluate(theta)
        if plan is not None:
            xs.append(np.asarray(theta, float))
            headroom.append(problem.headroom(np.asarray(plan.fractions), plan.choice))
            result.plans.append(plan)
            result.history_s.append(time.perf_counter() - started)

    design = _unique([*(feasible_design(problem) + filled_design(problem) if feasible_start else []),
                      *_corners(problem)])
    sobol = SobolEngine(problem.dim, scramble=True, seed=seed).draw(initial).double().numpy()
    for theta in [*design, *sobol][:min(evaluations, max(initial, len(design)))]:  # the design within the budget
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
    slo = max_latency is not None or min_quality is not None
    while len(result.plans) < evaluations and not _settled(result.plans, min_quality, patience):
        batch = min(q, evaluations - len(result.plans))
        late = slo and len(result.plans) >= LATE_AFTER
        around = _incumbents(xs, result.plans, *((max_latency, min_quality) if late else (None, None)))
        pool = _pool(problem, pool_size, rng, around=around, local_share=LATE_SHARE if late else None)
        if not len(pool):
            break
        constrained = feasibility == "constraint"
        if constrained and sum(p.latency < INF for p in result.plans) < 2:
            chosen = _most_feasible(xs, headroom, pool, batch, kernel)
        else:
            model, observed = _surrogate(xs, result.plans, headroom, feasibility, kernel, transforms)
            if constrained:
                pool = _likely_feasible(model.models[2], pool, batch)
            acq = _acquisition(model, observed, torch.tensor(np.asarray(xs), dtype=torch.double), constrained,
                               max_latency, min_quality, int(rng.integers(1 << 30)), single=late,
                               transforms=transforms)
            picked, _ = optimize_acqf_discrete(acq, q=batch, choices=torch.tensor(pool, dtype=torch.double))
            chosen = picked.numpy()
        for theta in chosen:
            run(theta)
    result.seconds = time.perf_counter() - started
    return result
