"""Does the plan exitplan chooses measure best on a real fleet? Several plans of one scenario, each deployed on vLLM
CPU replicas here and fed the same trace, ranked by measured P95 against their predicted P95.

The scenario is the local one (``qwen-local``: the Qwen pair on this machine's vLLM device). The plans:

- ``chosen``: the plan stage's (``data/plan/qwen-local/plan.json``, its router);
- ``front-*``: points of the exhaustive Pareto front at other routing fractions (the fastest, the best quality, and
  those between), rebuilt from the same perf DB, labels and router as the stage;
- ``routellm-uniform``: BOUTE's RouteLLM baseline (fractions optimised, GPUs split evenly between the models);
- ``single-<model>``: all traffic on one model, its deployment chosen freely (no quality floor).

Each is deployed as ``exitplan deploy`` deploys locally (:func:`exitplan.deploy.start_local`, ``deploy.backend: vllm``:
a vLLM CPU replica per replica of the plan, the coordinator with the plan's thresholds in front), the same trace
(``fleet_vs_plan``'s: workload prompts at Poisson arrivals of the scenario's load, answers capped as the perf DB
capped them) is replayed through it, and it is stopped before the next one starts. A plan's predicted P95 is its
``predicted_p95_s`` (the worst served model's, from the perf DB); its measured P95 is the worst served model's E2E
P95 over the trace. Reported: both per plan, Spearman's rank correlation of the two over the plans, the chosen plan's
measured rank, and its measured P95 over the best measured P95 among the plans that meet the scenario's quality floor
(the plans below it are not eligible, however fast).

``--quick``: 20 requests per plan (about 5 minutes per plan with its start-up; a P95 of 20 is their second
slowest); without it 60. Last line: ``RESULT plans=... spearman=... chosen_rank=... chosen_vs_best=...`` (target:
spearman >= 0.8, chosen_vs_best <= 1.10).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pandas as pd
from common import start
from fleet_vs_plan import replay, trace
from sweep import stamp

from exitplan.artifacts import PLAN_FILE, ROUTER_FILE, perf_db_path, plan_dir
from exitplan.deploy import start_local
from exitplan.planner.baselines import even_gpus
from exitplan.planner.plan_file import Plan, read_plan, write_plan
from exitplan.planner.problem import Plan as Point
from exitplan.planner.problem import best_under, pareto
from exitplan.planner.scenario import describe, save_router, scenario_problem
from exitplan.planner.search import exhaustive, fastest, fraction_grid
from exitplan.stages.plan import routed_perf, router
from exitplan.vllm.simulate import planning_catalog

FRONT_POINTS = 3
"""Front points besides the chosen plan."""


def alternatives(params, scenario, out: Path) -> dict[str, tuple[Plan, Path]]:
    """The other plans of the scenario, each written with its router into ``out/<name>/``: front points at other
    fractions, RouteLLM-uniform and each single model."""
    routing, section = router(params, scenario), params.plan
    db = pd.read_parquet(perf_db_path(params))
    routed = routed_perf(params, scenario, routing)  # the stage's: each model's curves on the lengths it is routed
    problem = scenario_problem(section, scenario, db, planning_catalog(params), routing, routed=routed)
    front = sorted(pareto(exhaustive(problem, section.fraction_steps)), key=lambda p: p.latency)
    picks = {f"front-{i}": front[round(j)] for i, j in enumerate(np.linspace(0, len(front) - 1, FRONT_POINTS))}
    k = len(problem.models)
    picks["routellm-uniform"] = best_under(fastest(problem, fraction_grid(k, section.fraction_steps),
                                                   even_gpus(problem)), min_quality=scenario.min_quality)
    for i, m in enumerate(problem.models):
        picks[f"single-{m.split('/')[-1]}"] = best_under(fastest(problem, [np.eye(k)[i]]))
    plans, seen = {}, set()
    for name, point in picks.items():
        if point is None or _key(point) in seen:
            continue
        seen.add(_key(point))
        folder = out / name
        plan = describe(problem, point, routing.window, db, routed, scenario=scenario.name)
        write_plan(folder / PLAN_FILE, plan)
        save_router(folder / ROUTER_FILE, section.embedder, scenario.models, routing.scorer, routing.window)
        plans[name] = (plan, folder / ROUTER_FILE)
    return plans


def _key(point: Point) -> tuple:
    return tuple(np.round(point.fractions, 3)), tuple(point.choice)


def measure(params, plan: Plan, router_path: Path, frame: pd.DataFrame, out: Path) -> tuple[pd.DataFrame, str]:
    """Deploy ``plan`` here, replay ``frame`` through its coordinator, stop it; what the client saw per request, and
    the replicas started per plan model (``a/b``: a plan this machine cannot hold whole runs on fewer, and then it
    is not the plan that was predicted)."""
    fleet = start_local(params, plan, router_path, out)
    try:
        held = "/".join(str(len(fleet.replica_urls.get(m.model, []))) for m in plan.models)
        return pd.DataFrame(asyncio.run(replay(fleet.coordinator_url, params.deploy.fleet_name, frame))), held
    finally:
        fleet.stop()


def main() -> None:
    from scipy.stats import spearmanr

    args, base = start(__doc__, {"--scenario": {"default": "qwen-local", "help": "Scenario whose plans to rank."}})
    params = base.model_copy(update={"deploy": base.deploy.model_copy(update={"backend": "vllm"})})
    scenario = next(s for s in params.plan.scenarios if s.name == args.scenario)
    count, cap = 20 if args.quick else 60, params.build_perf_db.vllm_max_output_len
    stage_dir = plan_dir(params, scenario.name)
    out = params.path(".cache") / "plan_ranking"
    plans = {"chosen": (read_plan(stage_dir / PLAN_FILE), stage_dir / ROUTER_FILE)}
    chosen_key = tuple(round(m.fraction, 3) for m in plans["chosen"][0].models)
    for name, (plan, path) in alternatives(params, scenario, out).items():
        same = tuple(round(m.fraction, 3) for m in plan.models) == chosen_key and \
            [m.groups for m in plan.models] == [m.groups for m in plans["chosen"][0].models]
        if not same:
            plans[name] = (plan, path)
    frame = trace(params, count, scenario.load_qps, cap, 0)
    print(f"{len(plans)} plans of {scenario.name}, each fed the same {count} requests at Poisson "
          f"{scenario.load_qps} req/s{' (--quick)' if args.quick else ''}", flush=True)
    rows = []
    for name, (plan, router_path) in plans.items():
        began = time.perf_counter()
        measured, held = measure(params, plan, router_path, frame, out / name / "deploy")
        p95 = {m: float(np.percentile(part["e2e"], 95)) for m, part in measured.groupby("model")}
        rows.append({"plan": name, "fractions": "/".join(f"{m.fraction:.2f}" for m in plan.models),
                     "replicas": "/".join(str(m.replicas if m.serves else 0) for m in plan.models), "held": held,
                     "quality": plan.predicted_quality, "cost": plan.cost_per_hour,
                     "eligible": plan.predicted_quality >= scenario.min_quality - 1e-9,
                     "predicted": plan.predicted_p95_s, "measured": max(p95.values()),
                     "all_p95": float(np.percentile(measured["e2e"], 95))})
        print(f"{stamp()} {name}: measured worst-model P95 {rows[-1]['measured']:.3f} s, predicted "
              f"{plan.predicted_p95_s:.3f} s; replicas started {held} of {rows[-1]['replicas']} "
              f"({time.perf_counter() - began:.0f} s)", flush=True)
    table = pd.DataFrame(rows)
    table["pred_rank"] = table["predicted"].rank(method="min").astype(int)
    table["meas_rank"] = table["measured"].rank(method="min").astype(int)
    print(f"{'plan':<28}{'fractions':>11}{'replicas':>9}{'started':>8}{'quality':>8}{'$/h':>7}{'floor':>6}"
          f"{'pred P95':>10}{'meas P95':>10}{'all P95':>9}{'pred #':>7}{'meas #':>7}")
    for r in table.itertuples():
        print(f"{r.plan:<28}{r.fractions:>11}{r.replicas:>9}{r.held:>8}{r.quality:>8.3f}{r.cost:>7.3f}"
              f"{'ok' if r.eligible else 'below':>6}{r.predicted:>10.3f}{r.measured:>10.3f}{r.all_p95:>9.3f}"
              f"{r.pred_rank:>7}{r.meas_rank:>7}")
    rho = float(spearmanr(table["predicted"], table["measured"]).statistic)
    chosen = table[table["plan"] == "chosen"].iloc[0]
    best = table[table["eligible"]]["measured"].min()
    print(f"Spearman {rho:.3f} over {len(table)} plans (target >= 0.8); chosen plan measured #{chosen.meas_rank} of "
          f"{len(table)}, {chosen.measured / best:.3f}x the best eligible measured P95 (target <= 1.10)")
    print(f"RESULT plans={len(table)} spearman={rho:.3f} chosen_rank={chosen.meas_rank} "
          f"chosen_vs_best={chosen.measured / best:.3f}")


if __name__ == "__main__":
    main()
