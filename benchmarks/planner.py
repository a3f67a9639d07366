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
    python benchmarks/planner.py --scenario qwen-pair --quick --depths   # depth as a decision: on vs off

Needs ``make run`` (perf DB, labels). Last line: ``RESULT hv_ratio=... seconds=... evals_vs_random=...
p95_vs_routellm=... p95_vs_homo=... p95_vs_single=... infeasible_share=...`` (a ratio is ``nan`` when the
baseline cannot meet the SLO at all; ``infeasible_share``: the grid's plans within budget that cannot carry the
load).

``--depths`` (issue 31): the exact front with each model at full depth only and with its replicas allowed at every
depth the perf DB swept (``build_perf_db.partial_layers``; quality by depth from the exit profile or the
scenario's published ``depth_agreement``, :mod:`exitplan.planner.depth`), MOBO with the depth coordinates against
the depth front, and the fastest plan meeting the quality floor each way. Last line: ``RESULT hv_ratio=...
depth_on_p95_gain=... chosen_depths=... hv_depth_on_vs_off=...`` (``hv_ratio``: MOBO's share of the depth front's
hypervolume; ``depth_on_p95_gain``: 1 - P95 with depth / P95 at full depth, same floor, budget and load, both the exact
front's on the fraction grid;
``chosen_depths``: layers per model of the chosen plan, smallest model first).
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
from exitplan.planner.scenario import scenario_depths
from exitplan.planner.search import census, exhaustive, fastest, fraction_grid, random_search
from exitplan.routing.trainer import TrainedRouter
from exitplan.stages.plan import exit_agreement, router


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
                     budget: float, routing: TrainedRouter | None = None) -> PlanProblem:
    """The scenario's problem at another load and budget (same GPUs, perf DB and Q(f)); with ``routing``, the
    depth-planning problem (Q(f, depths) on its held-out queries, the exit profile's or the published agreement)."""
    catalog = load_catalog(params.path(params.catalog))
    prices = {g: catalog.gpu(g).price_per_hour for g in scenario.gpus}
    section = params.plan
    db = perf_db(perf_db_path(params))
    depths, by_depth = None, None
    if routing is not None:
        planned = scenario.model_copy(update={"depths": True})
        depths, by_depth = scenario_depths(planned, db, catalog, routing, exit_agreement(params, planned))
    return problem_from(db, prices, scenario.gpus, scenario.models, quality, load, budget, section.metric,
                        section.budget_points, scenario.max_p95_s, section.load_shares, depths=depths,
                        depth_quality=by_depth)


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
    """Fractions and GPU groups per model of a plan (with its depth, layers of the full model, when cut)."""
    parts = []
    for i, (m, c, f) in enumerate(zip(problem.models, plan.choice, plan.fractions, strict=True)):
        if f >= 1e-3:
            groups = " + ".join(f"{g.dp}x{g.gpu} tp{g.tp} pp{g.pp}" for g in problem.candidates[m][c].groups)
            layers, full = problem.layers_of(i, c), problem.depths(i)[-1]
            cut = f" at {layers}/{full} layers" if layers < full else ""
            parts.append(f"{m.split('/')[-1]} {f:.2f}{cut} on {groups}")
    return "; ".join(parts)


def chosen_of(problem: PlanProblem, searched: list, slo: float):
    """The plan the plan stage would choose: the fastest meeting the quality floor over MOBO's and the grid's."""
    return best_under([*searched, *exhaustive(problem, 20)], min_quality=slo)


HYPOTHETICAL = (0.7, 0.8, 0.9, 0.95, 1.0)
"""Agreements tried at the published exits to show what an exit must keep for depth to pay (not a measurement)."""


def what_it_takes(params: Params, scenario: PlanScenario, routing: TrainedRouter, slo: float, best_off) -> None:
    """The P95 cut at the floor if the published exits agreed with the full model this much instead (exact front):
    what an early-exit-trained checkpoint must reach at those depths for the cut to appear."""
    cuts = []
    for a in HYPOTHETICAL:
        table = {m: dict.fromkeys(row, a) for m, row in scenario.depth_agreement.items()}
        problem = scenario_problem(params, scenario.model_copy(update={"depth_agreement": table}), routing.quality,
                                   scenario.load_qps, scenario.budget_per_hour, routing)
        best = best_under(exhaustive(problem, params.plan.fraction_steps), min_quality=slo)
        cuts.append(f"{a:.2f}: {1 - best.latency / best_off.latency:.1%}" if best and best_off else f"{a:.2f}: -")
    print(f"hypothetical, not measured - the P95 cut at Q >= {slo:.3f} if the published exits agreed with the full "
          f"model this much: {'; '.join(cuts)}")


def depth_report(params: Params, scenario: PlanScenario, routing: TrainedRouter, budget: int) -> None:
    """The front with depth off and on (the same perf DB, budget, load and labels), MOBO on the depth-planning
    problem against its exact front, and the P95 depth buys at the quality floor; the RESULT line."""
    section = params.plan
    off = scenario_problem(params, scenario, routing.quality, scenario.load_qps, scenario.budget_per_hour)
    on = scenario_problem(params, scenario, routing.quality, scenario.load_qps, scenario.budget_per_hour, routing)
    order = np.argsort(routing.grid[:, -1])
    slo = scenario.min_quality or float(np.interp(0.5, routing.grid[order, -1], routing.values[order]))
    print(f"scenario {scenario.name}: {scenario.load_qps} req/s, ${scenario.budget_per_hour}/h; depths per model "
          f"{ {m.split('/')[-1]: on.depths(i) for i, m in enumerate(on.models)} }")
    quality = on.depth_quality
    for m in on.models:
        print(f"  {m.split('/')[-1]}: quality by depth from {getattr(quality, 'sources', {}).get(m, '-')}")
    fronts = {}
    for name, problem in (("depth off (full depth)", off), ("depth on", on)):
        started = time.perf_counter()
        truth = exhaustive(problem, section.fraction_steps)
        fronts[name] = truth
        front = pareto(truth)
        print(f"\n{name}: exact front of {len(front)} plans ({time.perf_counter() - started:.1f} s)")
        print(f"{'P95 s':>9}{'quality':>9}{'$/h':>7}  plan")
        for plan in front:
            print(f"{plan.latency:>9.3f}{plan.quality:>9.3f}{plan.cost:>7.2f}  {describe_plan(problem, plan)}")
    finite = [p for t in fronts.values() for p in t if np.isfinite(p.latency)]
    ref = (max(p.latency for p in finite) * 1.05, min(p.quality for p in finite) - 0.005)
    hv_off, hv_on = (hypervolume(fronts[k], *ref) for k in fronts)
    mobo = optimise(on, budget, section.initial, section.batch, section.seed, beta=section.beta,
                    feasibility="constraint", min_quality=slo)
    hv_ratio = hypervolume(mobo.plans, *ref) / hv_on
    best_off, best_on = best_under(fronts["depth off (full depth)"], min_quality=slo), chosen_of(on, mobo.plans, slo)
    grid_on = best_under(fronts["depth on"], min_quality=slo)  # like for like: both on the exact grid
    gain = 1 - grid_on.latency / best_off.latency if grid_on and best_off else float("nan")
    print(f"\nhypervolume (log P95 x quality): depth off {hv_off:.4f}, depth on {hv_on:.4f} "
          f"({hv_on / hv_off:.3f}x); MOBO on the depth problem, {len(mobo.plans)} evaluations: {hv_ratio:.3f} of it "
          f"({mobo.seconds:.1f} s); its plans at a cut depth: "
          f"{sum(any(x < on.depths(i)[-1] for i, x in enumerate(p.layers)) for p in mobo.plans)}")
    print(f"at Q >= {slo:.3f}: full depth {best_off.latency if best_off else float('nan'):.3f} s "
          f"({describe_plan(off, best_off) if best_off else 'none'}); with depth "
          f"{best_on.latency if best_on else float('nan'):.3f} s ({describe_plan(on, best_on) if best_on else 'none'})")
    if scenario.depth_agreement:
        what_it_takes(params, scenario, routing, slo, best_off)
    depths = "/".join(str(x) for x in best_on.layers) if best_on else "none"
    print(f"RESULT hv_ratio={hv_ratio:.3f} depth_on_p95_gain={gain:.3f} chosen_depths={depths} "
          f"hv_depth_on_vs_off={hv_on / hv_off:.3f}")


def ratio(ours, baseline) -> float:
    """Our P95 over the baseline's (nan when the baseline cannot meet the SLO)."""
    return ours.latency / baseline.latency if ours and baseline else float("nan")


def main() -> None:
    args, params = start(__doc__, {
        "--scenario": {"default": None, "help": "scenario name (default: the first)"},
        "--homo-gpu": {"default": None, "help": "GPU type of the homogeneous baseline"},
        "--load": {"type": float, "default": None, "help": "req/s instead of the scenario's"},
        "--budget": {"type": float, "default": None, "help": "$/h instead of the scenario's"},
        "--depths": {"action": "store_true", "help": "depth on and off: the front, MOBO with depth, the P95 gain"}})
    scenario, section = pick_scenario(params, args.scenario), params.plan
    scenario = scenario.model_copy(update={"load_qps": args.load or scenario.load_qps,
                                           "budget_per_hour": args.budget or scenario.budget_per_hour})
    try:
        routing = router(params, scenario)
    except ExitplanError as exc:
        sys.exit(f"{exc} (run `make run` first)")
    if args.depths:
        return depth_report(params, scenario, routing, 40 if args.quick else 60)
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
