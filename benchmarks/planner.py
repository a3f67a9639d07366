"""BOUTE's co-optimiser on the default scenario: MOBO vs the exhaustive front, random search and the baselines.

The problem is the ``plan`` stage's first scenario (the real Qwen pair: perf DB of simulated GPUs, quality labels
measured by running the models, the router trained on them). The true front is the exhaustive search over the
candidate set (fractions on a 1/20 grid x every candidate per model). MOBO (BOUTE's kernel, qLogNEHVI) and random
search get the same budget of evaluations; the hypervolume (log latency x quality) of their fronts is reported as a
share of the true one, with the evaluations and seconds each needs to reach 95% of it (a random evaluation is one
uncached perf-DB look-up; a MOBO round also fits the GPs and maximises the acquisition). The SLO for the P95 comparison is the
scenario's quality floor (``min_quality``; if it has none, the quality that routing half the load to the large model
gives). The full run adds the plain-kernel ablation and a sweep of loads x budgets: the best plan's P95 against the
RouteLLM-uniform and homogeneous baselines at the same SLO, so the default scenario can be read against its
neighbours.

Usage:
    python benchmarks/planner.py --quick   # 40 MOBO evaluations (~1-2 min)
    python benchmarks/planner.py           # 60 evaluations, the plain-kernel ablation, the load x budget sweep

Needs ``make run`` (perf DB, labels). Last line:
``RESULT hv_ratio=... seconds=... evals_vs_random=... p95_vs_routellm=... p95_vs_homo=...``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
from common import start  # benchmarks/ is the script's folder, so on sys.path

from exitplan.catalog import load_catalog
from exitplan.config import Params, PlanScenario
from exitplan.errors import ExitplanError
from exitplan.planner.baselines import baselines
from exitplan.planner.build import problem_from
from exitplan.planner.mobo import optimise
from exitplan.planner.problem import PlanProblem, best_under, hypervolume, pareto
from exitplan.planner.search import exhaustive, random_search
from exitplan.stages.plan import params_db, router


def evals_to(plans, target: float, ref) -> int | None:
    """Evaluations after which the front's hypervolume first reaches ``target`` (None if never)."""
    for k in range(1, len(plans) + 1):
        if hypervolume(plans[:k], *ref) >= target:
            return k
    return None


def scenario_problem(params: Params, scenario: PlanScenario, quality: Callable, load: float,
                     budget: float) -> PlanProblem:
    """The scenario's problem at another load and budget (same GPUs, perf DB and Q(f))."""
    catalog = load_catalog(params.path(params.catalog))
    prices = {g: catalog.gpu(g).price_per_hour for g in scenario.gpus}
    section = params.plan
    return problem_from(params_db(params), prices, scenario.gpus, scenario.models, quality, load, budget,
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


def random_seconds(params: Params, scenario: PlanScenario, routing: dict, evaluations: int) -> float:
    """Seconds random search takes for its first ``evaluations`` plans (seeded, so the same plans), on a fresh
    problem so that its perf-DB look-ups are not served from another search's cache."""
    fresh = scenario_problem(params, scenario, routing["quality"], scenario.load_qps, scenario.budget_per_hour)
    started = time.perf_counter()
    random_search(fresh, evaluations, seed=params.plan.seed)
    return time.perf_counter() - started


def main() -> None:
    args, params = start(__doc__)
    scenario, section = params.plan.scenarios[0], params.plan
    try:
        routing = router(params, scenario)
    except ExitplanError as exc:
        sys.exit(f"{exc} (run `make run` first)")
    problem = scenario_problem(params, scenario, routing["quality"], scenario.load_qps, scenario.budget_per_hour)
    started = time.perf_counter()
    truth = exhaustive(problem, section.fraction_steps)
    exhaustive_s = time.perf_counter() - started
    finite = [p for p in truth if np.isfinite(p.latency)]
    ref = (max(p.latency for p in finite) * 1.05, min(p.quality for p in finite) - 0.005)
    hv_true = hypervolume(truth, *ref)
    budget = 40 if args.quick else 60
    mobo = optimise(problem, budget, section.initial, section.batch, section.seed, beta=section.beta)
    rand = random_search(problem, budget * 10, seed=section.seed)
    runs = {"mobo (BOUTE kernel)": mobo.plans, "random": rand}
    seconds = {"mobo (BOUTE kernel)": mobo.seconds, "random": random_seconds(params, scenario, routing, budget)}
    clocks = {"mobo (BOUTE kernel)": mobo.history_s}
    if not args.quick:
        plain = optimise(problem, budget, section.initial, section.batch, section.seed, structured=False)
        runs["mobo (plain kernel)"] = plain.plans
        seconds["mobo (plain kernel)"] = plain.seconds
        clocks["mobo (plain kernel)"] = plain.history_s
    print(f"scenario {scenario.name}: {scenario.load_qps} req/s, ${scenario.budget_per_hour}/h, GPUs "
          f"{scenario.gpus}; candidates per model {[len(problem.candidates[m]) for m in problem.models]}")
    front = pareto(truth)
    print(f"exhaustive: {len(truth)} plans in {exhaustive_s:.1f} s, front of {len(front)} spanning "
          f"{front[-1].latency / front[0].latency:.2f}x in P95; "
          f"Q(f) from {routing['values'].min():.3f} to {routing['values'].max():.3f} (router, held-out)")
    print(f"\n{'search':<22}{'evals':>7}{'HV share':>10}{'evals to 95%':>14}{'s to 95%':>10}{'seconds':>9}")
    to95 = {}
    for name, plans in runs.items():
        shown = plans[:budget]
        to95[name] = evals_to(plans, 0.95 * hv_true, ref)
        reached = clocks[name][to95[name] - 1] if name in clocks and to95[name] else None
        if name == "random" and to95[name]:
            reached = random_seconds(params, scenario, routing, to95[name])
        at = f"{reached:.3f}" if reached is not None else "-"
        print(f"{name:<22}{len(shown):>7}{hypervolume(shown, *ref) / hv_true:>10.3f}"
              f"{str(to95[name]) if to95[name] else '>' + str(len(plans)):>14}{at:>10}{seconds[name]:>9.3f}")
    order = np.argsort(routing["grid"][:, -1])
    slo = scenario.min_quality or float(np.interp(0.5, routing["grid"][order, -1], routing["values"][order]))
    found = baselines(problem, slo, steps=section.fraction_steps)
    ours = best_under(mobo.plans, min_quality=slo)
    print(f"\nP95 at the SLO Q >= {slo:.3f} (${scenario.budget_per_hour}/h): MOBO {ours.latency:.3f} s "
          f"(fractions {np.round(ours.fractions, 2).tolist()}, ${ours.cost:.2f}/h)")
    for name, plan in found.items():
        print(f"  {name:<46}" + ("cannot meet it" if plan is None else
                                 f"{plan.latency:.3f} s  ratio {ours.latency / plan.latency:.2f}"))
    if not args.quick:
        sweep(params, scenario, routing["quality"], slo)
    hv_ratio = hypervolume(mobo.plans, *ref) / hv_true
    rand95 = to95["random"] or len(rand)
    mobo95 = to95["mobo (BOUTE kernel)"] or budget
    routellm, homo = found["routellm-uniform"], found["homogeneous"]
    p95_r = ours.latency / routellm.latency if routellm else float("nan")
    p95_h = ours.latency / homo.latency if homo else float("nan")
    print(f"RESULT hv_ratio={hv_ratio:.3f} seconds={mobo.seconds:.1f} evals_vs_random={rand95 / mobo95:.2f} "
          f"p95_vs_routellm={p95_r:.3f} p95_vs_homo={p95_h:.3f}")


if __name__ == "__main__":
    main()
