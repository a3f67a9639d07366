"""BOUTE's co-optimiser on one scenario: MOBO vs the reference front, random search and the baselines.

The problem is one of the ``plan`` stage's scenarios (``--scenario``; default the first, the real Qwen pair):
the perf DB of simulated GPUs, the scenario's quality labels (measured here for the Qwen pair, imported AlpacaEval
judge preferences for the Llama-2 family) and the router trained on them. The reference front is the exhaustive
search over the candidate set (fractions on a 1/``fraction_steps`` grid x every candidate per model), exact at any
K because it decomposes per fraction vector (exitplan/planner/search.py; its seconds are printed). MOBO (BOUTE's
kernel, qLogNEHVI, plans that cannot carry their load modelled by a headroom GP and an outcome constraint) and
random search get the same budget of evaluations; the hypervolume (log latency x quality) of their fronts is a
share of the reference's, with the evaluations and seconds each needs to reach 95% of it (a random evaluation is
one uncached perf-DB look-up; a MOBO round also fits the GPs and maximises the acquisition). MOBO with the first
design's penalty (an infeasible plan = twice the worst latency) runs beside it, with how many of each one's
proposals could not carry the load. The SLO for the P95 comparison is the scenario's quality floor
(``min_quality``; if it has none, the quality that routing half the load to the large model gives); the baselines
are the largest model alone, RouteLLM-uniform (fractions optimised, the budget split evenly between the models) and
homogeneous (BOUTE-Homo: fractions and deployments optimised on the best single GPU type, or on ``--homo-gpu``).
The full run adds the plain-kernel ablation and a sweep of loads x budgets.

Usage:
    python benchmarks/planner.py --quick [--scenario llama2-boute]   # 40 MOBO evaluations (~1 min)
    python benchmarks/planner.py [--scenario ...]   # 60 evaluations, the plain-kernel ablation, the sweep
    python benchmarks/planner.py --quick --load 160 --budget 3   # the scenario at another load and budget

Needs ``make run`` (perf DB, labels). Last line: ``RESULT hv_ratio=... seconds=... evals_vs_random=...
p95_vs_routellm=... p95_vs_homo=... p95_vs_single=... infeasible_share=...`` (a ratio is ``nan`` when the
baseline cannot meet the SLO at all; ``infeasible_share``: the grid's plans within budget that cannot carry the
load).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pandas as pd
from common import start  # benchmarks/ is the script's folder, so on sys.path

from exitplan.artifacts import perf_db_path
from exitplan.catalog import load_catalog
from exitplan.config import Params, PlanScenario
from exitplan.errors import ExitplanError
from exitplan.planner.baselines import baselines, on_one_type
from exitplan.planner.build import problem_from
from exitplan.planner.mobo import optimise
from exitplan.planner.problem import PlanProblem, best_under, hypervolume, pareto
from exitplan.planner.search import census, exhaustive, fastest, fraction_grid, random_search
from exitplan.routing.trainer import TrainedRouter
from exitplan.stages.plan import router


def evals_to(plans, target: float, ref) -> int | None:
    """Evaluations after which the front's hypervolume first reaches ``target`` (None if never)."""
    for k in range(1, len(plans) + 1):
        if hypervolume(plans[:k], *ref) >= target:
            return k
    return None


@cache
def perf_db(path: Path) -> pd.DataFrame:
    """The perf DB, read once per run (every problem of the sweep is built on it)."""
    return pd.read_parquet(path)


def scenario_problem(params: Params, scenario: PlanScenario, quality: Callable, load: float,
                     budget: float) -> PlanProblem:
    """The scenario's problem at another load and budget (same GPUs, perf DB and Q(f))."""
    catalog = load_catalog(params.path(params.catalog))
    prices = {g: catalog.gpu(g).price_per_hour for g in scenario.gpus}
    section = params.plan
    return problem_from(perf_db(perf_db_path(params)), prices, scenario.gpus, scenario.models, quality, load, budget,
                        section.metric, section.budget_points, scenario.max_p95_s, section.load_shares)


def sweep(params: Params, scenario: PlanScenario, quality: Callable, slo: float) -> None:
    """Best plan (exhaustive) vs RouteLLM-uniform and homogeneous at ``slo`` over loads x budgets around the
    scenario's."""
    print(f"\nsweep at Q >= {slo:.3f}: exhaustive best vs baselines (P95 s; ratio = best / baseline)")
    print(f"{'req/s':>7}{'$/h':>6}{'front span':>12}{'best':>8}{'routellm':>10}{'homo':>8}{'vs routellm':>13}"
          f"{'vs homo':>9}")
    for load in (0.5 * scenario.load_qps, 0.75 * scenario.load_qps, scenario.load_qps, 1.25 * scenario.load_qps):
        for budget in (scenario.budget_per_hour, 4 / 3 * scenario.budget_per_hour, 2 * scenario.budget_per_hour):
            try:
                problem = scenario_problem(params, scenario, quality, load, budget)
            except ExitplanError:
                continue
            truth = exhaustive(problem, params.plan.fraction_steps)
            front, ours = pareto(truth), best_under(truth, min_quality=slo)
            found = baselines(problem, slo, steps=params.plan.fraction_steps)
            cells = [ours, found["routellm-uniform"], found["homogeneous"]]
            shown = [f"{p.latency:.3f}" if p else "-" for p in cells]
            ratios = [f"{ours.latency / p.latency:.2f}" if ours and p else "-" for p in cells[1:]]
            span = front[-1].latency / front[0].latency if front else float("nan")
            print(f"{load:>7.0f}{budget:>6.1f}{span:>12.2f}{shown[0]:>8}{shown[1]:>10}{shown[2]:>8}{ratios[0]:>13}"
                  f"{ratios[1]:>9}")


def random_seconds(params: Params, scenario: PlanScenario, routing: TrainedRouter, evaluations: int) -> float:
    """Seconds random search takes for its first ``evaluations`` plans (seeded, so the same plans), on a fresh
    problem so that its perf-DB look-ups are not served from another search's cache."""
    fresh = scenario_problem(params, scenario, routing.quality, scenario.load_qps, scenario.budget_per_hour)
    started = time.perf_counter()
    random_search(fresh, evaluations, seed=params.plan.seed)
    return time.perf_counter() - started


def pick_scenario(params: Params, name: str | None) -> PlanScenario:
    """The scenario called ``name`` (default: the first), or exit naming the known ones."""
    scenarios = {sc.name: sc for sc in params.plan.scenarios}
    if name is None:
        return params.plan.scenarios[0]
    if name not in scenarios:
        sys.exit(f"no scenario {name!r} in params.yaml; known: {sorted(scenarios)}")
    return scenarios[name]


def search_table(runs: dict, clocks: dict, seconds: dict, hv_true: float, ref: tuple, budget: int,
                 timer: Callable[[int], float]) -> dict[str, int | None]:
    """Print each search's HV share, evaluations and seconds to 95%, and proposals that cannot carry the load;
    returns the evaluations to 95% per search."""
    print(f"\n{'search':<24}{'evals':>7}{'HV share':>10}{'evals to 95%':>14}{'s to 95%':>10}{'seconds':>9}"
          f"{'cannot carry':>14}")
    to95 = {}
    for name, plans in runs.items():
        shown = plans[:budget]
        to95[name] = evals_to(plans, 0.95 * hv_true, ref)
        reached = clocks[name][to95[name] - 1] if name in clocks and to95[name] else None
        if name == "random" and to95[name]:
            reached = timer(to95[name])
        at = f"{reached:.3f}" if reached is not None else "-"
        stuck = sum(not np.isfinite(p.latency) for p in shown)
        print(f"{name:<24}{len(shown):>7}{hypervolume(shown, *ref) / hv_true:>10.3f}"
              f"{str(to95[name]) if to95[name] else '>' + str(len(plans)):>14}{at:>10}{seconds[name]:>9.3f}"
              f"{stuck:>9} of {len(shown):<3}")
    return to95


def describe_plan(problem: PlanProblem, plan) -> str:
    """Fractions and GPU groups per model of a plan."""
    parts = []
    for m, c, f in zip(problem.models, plan.choice, plan.fractions, strict=True):
        if f >= 1e-3:
            groups = " + ".join(f"{g.dp}x{g.gpu} tp{g.tp} pp{g.pp}" for g in problem.candidates[m][c].groups)
            parts.append(f"{m.split('/')[-1]} {f:.2f} on {groups}")
    return "; ".join(parts)


def ratio(ours, baseline) -> float:
    """Our P95 over the baseline's (nan when the baseline cannot meet the SLO)."""
    return ours.latency / baseline.latency if ours and baseline else float("nan")


def main() -> None:
    args, params = start(__doc__, {
        "--scenario": {"default": None, "help": "scenario name (default: the first)"},
        "--homo-gpu": {"default": None, "help": "GPU type of the homogeneous baseline"},
        "--load": {"type": float, "default": None, "help": "req/s instead of the scenario's"},
        "--budget": {"type": float, "default": None, "help": "$/h instead of the scenario's"}})
    scenario, section = pick_scenario(params, args.scenario), params.plan
    scenario = scenario.model_copy(update={"load_qps": args.load or scenario.load_qps,
                                           "budget_per_hour": args.budget or scenario.budget_per_hour})
    try:
        routing = router(params, scenario)
    except ExitplanError as exc:
        sys.exit(f"{exc} (run `make run` first)")
    problem = scenario_problem(params, scenario, routing.quality, scenario.load_qps, scenario.budget_per_hour)
    started = time.perf_counter()
    truth = exhaustive(problem, section.fraction_steps)
    exhaustive_s = time.perf_counter() - started
    counted = census(problem, section.fraction_steps)
    finite = [p for p in truth if np.isfinite(p.latency)]
    ref = (max(p.latency for p in finite) * 1.05, min(p.quality for p in finite) - 0.005)
    hv_true = hypervolume(truth, *ref)
    budget = 40 if args.quick else 60
    floor = scenario.min_quality or None
    mobo = optimise(problem, budget, section.initial, section.batch, section.seed, beta=section.beta,
                    feasibility="constraint")
    penalty = optimise(problem, budget, section.initial, section.batch, section.seed, beta=section.beta,
                       feasibility="penalty")
    rand = random_search(problem, budget * 10, seed=section.seed)
    runs = {"mobo (constraint)": mobo.plans, "mobo (penalty)": penalty.plans, "random": rand}
    seconds = {"mobo (constraint)": mobo.seconds, "mobo (penalty)": penalty.seconds,
               "random": random_seconds(params, scenario, routing, budget)}
    clocks = {"mobo (constraint)": mobo.history_s, "mobo (penalty)": penalty.history_s}
    if not args.quick:
        plain = optimise(problem, budget, section.initial, section.batch, section.seed, structured=False)
        runs["mobo (plain kernel)"], seconds["mobo (plain kernel)"] = plain.plans, plain.seconds
        clocks["mobo (plain kernel)"] = plain.history_s
    print(f"scenario {scenario.name}: {scenario.load_qps} req/s, ${scenario.budget_per_hour}/h, GPUs "
          f"{scenario.gpus}; models {problem.models}; candidates per model "
          f"{[len(problem.candidates[m]) for m in problem.models]}")
    front = pareto(truth)
    print(f"reference front (exhaustive, decomposed per fraction vector): {counted.plans} plans within budget and "
          f"GPUs, {counted.cannot_carry} of them ({counted.infeasible_share:.1%}) cannot carry the load; "
          f"{exhaustive_s:.2f} s; front of {len(front)} spanning {front[-1].latency / front[0].latency:.2f}x in P95")
    print(f"Q(f) (router, held-out) from {routing.values.min():.3f} to {routing.values.max():.3f}")
    print(f"{'P95 s':>9}{'quality':>9}{'$/h':>7}  plan")
    for plan in front:
        print(f"{plan.latency:>9.3f}{plan.quality:>9.3f}{plan.cost:>7.2f}  {describe_plan(problem, plan)}")
    to95 = search_table(runs, clocks, seconds, hv_true, ref, budget,
                        lambda n: random_seconds(params, scenario, routing, n))
    order = np.argsort(routing.grid[:, -1])
    slo = floor or float(np.interp(0.5, routing.grid[order, -1], routing.values[order]))
    found = baselines(problem, slo, steps=section.fraction_steps)
    homo_gpu = args.homo_gpu
    homo = found["homogeneous"] if homo_gpu is None else best_under(
        fastest(problem, fraction_grid(len(problem.models), section.fraction_steps), on_one_type(problem, homo_gpu)),
        min_quality=slo)
    ours = best_under(mobo.plans, min_quality=slo)
    single = found[f"single-{problem.models[-1]}"]
    print(f"\nP95 at the SLO Q >= {slo:.3f} (${scenario.budget_per_hour}/h, {scenario.load_qps} req/s):")
    print(f"  {'MOBO (chosen plan)':<46}" + ("none meets it" if ours is None else
                                             f"{ours.latency:.3f} s  {describe_plan(problem, ours)}"))
    shown = {**found, **({f"homogeneous-{homo_gpu}": homo} if homo_gpu else {})}
    for name, plan in shown.items():
        print(f"  {name:<46}" + ("cannot meet it" if plan is None else f"{plan.latency:.3f} s  ratio "
                                 f"{ratio(ours, plan):.2f}  {describe_plan(problem, plan)}"))
    if not args.quick:
        sweep(params, scenario, routing.quality, slo)
    hv_ratio = hypervolume(mobo.plans, *ref) / hv_true
    rand95 = to95["random"] or len(rand)
    mobo95 = to95["mobo (constraint)"] or budget
    print(f"RESULT hv_ratio={hv_ratio:.3f} seconds={mobo.seconds:.1f} evals_vs_random={rand95 / mobo95:.2f} "
          f"p95_vs_routellm={ratio(ours, found['routellm-uniform']):.3f} p95_vs_homo={ratio(ours, homo):.3f} "
          f"p95_vs_single={ratio(ours, single):.3f} infeasible_share={counted.infeasible_share:.3f}")


if __name__ == "__main__":
    main()
