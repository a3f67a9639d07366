"""BOUTE's evaluation, figure by figure: Fig. 4 (P95 against the quality requirement, every system), Table 1 (the
chosen plans), Table 2 (time to converge, and the ablations), and MOBO's hypervolume over five seeds.

The cluster is BOUTE's: 4 GPU types x 8 GPUs (H100, RTX PRO 6000, RTX 5090, RTX 4090 at the catalog's prices), a
$30/h budget, 100 req/s, the Llama-2 7B (small) and 70B (large) of the ``llama2-boute`` scenario. The quality
signal on every workload is the AlpacaEval labels the scenario's router is trained on (BOUTE scores GSM8K and
MT-Bench with their own metrics; those labels are not here). The workloads differ in their lengths:

- ``alpacaeval``: the models' own AlpacaEval answers (the pipeline's perf DB, ``make run``);
- ``gsm8k`` and ``mtbench``: the prompt and answer lengths of those data sets (``prepare_workload``, counted with
  the Qwen tokenizer), for which a perf DB of the two models on the four GPU types is simulated here.

For each workload, three quality requirements: the router's held-out quality when 25%, 50% and 70% of the load
goes to the 70B. Systems: BOUTE (exitplan's plan: MOBO's best plan meeting the requirement; the exhaustive optimum
beside it), Stand-Alone-Homo (the 70B alone on H100s), Stand-Alone-Hetero (the 70B alone on any GPUs), RouteLLM
(the same router; each model on 1/2 of the GPUs of each type, or within 1/2 of the budget; deployment tuned within
that share) and BOUTE-Homo (routing and deployment on H100s only): ``exitplan.planner.baselines.paper_baselines``.
A system that cannot meet a requirement is listed apart, never averaged. P95, mean and P99 are the perf DB's
(each at the deployment's best load split for that metric); the throughput at saturation is the load the plan's
replicas carry before one of them saturates (``load x exp(headroom)``).

Table 2: MOBO on 2, 3 and 4 GPU types (16, 24, 32 GPUs), stopped when its solution is unchanged for 20
evaluations (BOUTE's rule, ``exitplan.planner.convergence``) or at a cap; the same without BOUTE's structural
information (:data:`ABLATIONS`: S1 the load-share encoding - routing coordinates read as score thresholds instead -,
S4 the log/logit output transforms, S5 the GPU-preference weight; one at a time on 4 types x 32 GPUs, all three as
the paper's "w/o structural info" everywhere), each also without exitplan's feasible design, and without the perf
DB (each evaluation a simulation of the plan's replicas: its seconds per evaluation are measured on a few plans and
multiplied by the evaluations to converge). Seeds: MOBO's hypervolume ratio against the exhaustive front for five
seeds, on the ``llama2-boute`` scenario (``--quick``) or on every scenario.

Usage:
    python benchmarks/boute_eval.py --quick   # 300 requests per simulated point; Table 2 at 4 types only, with
                                              # and without structure and design; seeds on llama2-boute with
                                              # exitplan's design only (~9 min)
    python benchmarks/boute_eval.py           # 1,000 requests per point, the 3x3 cluster grid and every ablation,
                                              # every scenario, seeds with and without the feasible design

Needs ``make run`` (the perf DB, the AlpacaEval labels). Writes ``benchmarks/out/boute_fig4_<workload>.png``.
Last line: ``RESULT cut_vs_routellm_avg=... cut_vs_routellm_max=... cut_vs_homo_avg=... cut_vs_single_avg=...
hv_median_5seeds=... hv_worst_5seeds=... converge_s_4types=... ablation_evals_ratio=...
ablation_evals_ratio_nodesign=...`` (a cut is ``1 - P95 of BOUTE / P95 of the baseline``, averaged over the
requirements both meet; vs RouteLLM the better of its two readings, vs single model Stand-Alone-Hetero; the
ablation ratios are the evaluations to converge "w/o structural info" over the structured MOBO's, with exitplan's
design and without it).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pandas as pd
from common import start  # benchmarks/ is the script's folder, so on sys.path

from exitplan.artifacts import perf_db_path
from exitplan.catalog import load_catalog
from exitplan.config import Params, PlanScenario
from exitplan.errors import ExitplanError
from exitplan.planner.baselines import paper_baselines
from exitplan.planner.build import deployment_curves, problem_from
from exitplan.planner.convergence import PATIENCE, convergence
from exitplan.planner.encoding import threshold_problem
from exitplan.planner.mobo import optimise
from exitplan.planner.problem import MIN_SHARE, Plan, PlanProblem, best_under, hypervolume
from exitplan.planner.search import exhaustive
from exitplan.simulator.perf_db import build_perf_db
from exitplan.stages.plan import router
from exitplan.vllm.simulate import planning_catalog

OUT = Path(__file__).resolve().parent / "out"
CLUSTER = {"h100-sxm": 8, "rtx-pro-6000": 8, "rtx-5090": 8, "rtx-4090": 8}
"""BOUTE's cluster (section 6.1): four server types of 8 GPUs each."""
BUDGET, LOAD, HOMO_GPU = 30.0, 100.0, "h100-sxm"
LARGE_SHARES = (0.25, 0.5, 0.7)
"""The quality requirements: the router's quality at these shares of the load on the 70B."""
PAPER = {"stand-alone-hetero": (0.57, 0.91), "routellm": (0.50, 0.66), "boute-homo": (0.14, 0.15)}
"""BOUTE's reported average and maximum P95 cuts (section 6.2; BOUTE-Homo's on GSM8K)."""
WORKLOADS = ("gsm8k", "mtbench")
"""The data sets whose lengths get a perf DB of their own here (BOUTE's traces)."""
SYSTEMS = ("boute", "boute-exact", "stand-alone-homo", "stand-alone-hetero", "routellm-count", "routellm-budget",
           "boute-homo")


def scenario(params: Params) -> PlanScenario:
    """The ``llama2-boute`` scenario on BOUTE's cluster, budget and load."""
    found = {s.name: s for s in params.plan.scenarios}
    if "llama2-boute" not in found:
        sys.exit("params.yaml has no llama2-boute scenario")
    return found["llama2-boute"].model_copy(update={"gpus": CLUSTER, "budget_per_hour": BUDGET, "load_qps": LOAD})


def workload_dbs(params: Params, db: pd.DataFrame, models: list[str], requests: int) -> dict[str, pd.DataFrame]:
    """Perf DB rows of ``models`` per workload: the pipeline's perf DB ``db`` (AlpacaEval lengths), and GSM8K's and
    MT-Bench's lengths simulated here."""
    section = params.build_perf_db
    queries = pd.read_parquet(params.path(params.prepare_workload.output_dir) / "queries.parquet")
    catalog = load_catalog(params.path(params.catalog))
    dbs = {"alpacaeval": db[db["model"].isin(models)]}
    for name in WORKLOADS:
        rows = queries[queries["dataset"] == name]
        started = time.perf_counter()
        dbs[name] = build_perf_db(catalog, models, list(CLUSTER), params.simulator.engine, section.qps,
                                  (rows["prompt_len"].to_numpy(), rows["output_len"].to_numpy()), requests,
                                  section.seed, section.max_gpus_per_replica, [1.0], params.dask)
        print(f"perf DB for {name} lengths (prompt {rows['prompt_len'].mean():.0f}, answer "
              f"{rows['output_len'].mean():.0f} tokens on average): {len(dbs[name])} rows in "
              f"{time.perf_counter() - started:.0f} s")
    return dbs


def make_problem(params: Params, db: pd.DataFrame, sc: PlanScenario, quality: Callable,
                 gpus: Mapping[str, int] | None = None) -> PlanProblem:
    """The co-optimisation problem of ``sc`` on ``db`` (optionally on other GPUs), priced as the plan stage prices
    it (the catalog and this machine's vLLM device)."""
    catalog = planning_catalog(params)
    available = dict(gpus or sc.gpus)
    prices = {g: catalog.gpu(g).price_per_hour for g in available}
    section = params.plan
    return problem_from(db, prices, available, sc.models, quality, sc.load_qps, sc.budget_per_hour,
                        section.metric, section.budget_points, sc.max_p95_s, section.load_shares)


def requirements(routing: Any) -> list[float]:
    """The router's held-out quality at each share of :data:`LARGE_SHARES` on the large model."""
    order = np.argsort(routing.grid[:, -1])
    return [float(np.interp(s, routing.grid[order, -1], routing.values[order])) for s in LARGE_SHARES]


def figures(problem: PlanProblem, db: pd.DataFrame, plan: Plan | None) -> dict[str, float]:
    """P95, mean, P99 and saturation throughput of ``plan`` (empty when there is none)."""
    if plan is None:
        return {}
    out = {"p95": plan.latency}
    for key, metric in (("mean", "e2e_mean_s"), ("p99", "e2e_p99_s")):
        worst = 0.0
        for m, c, f in zip(problem.models, plan.choice, plan.fractions, strict=True):
            if f >= MIN_SHARE:
                curves = deployment_curves(db, m, list(problem.available), metric)
                worst = max(worst, problem.candidates[m][c].latency(f * problem.load, curves))
        out[key] = worst
    out["sat_qps"] = problem.load * float(np.exp(problem.headroom(np.asarray(plan.fractions), plan.choice)))
    return out


def describe(problem: PlanProblem, plan: Plan) -> str:
    """Load share, budget share and GPUs per loaded model."""
    parts = []
    for m, c, f in zip(problem.models, plan.choice, plan.fractions, strict=True):
        if f >= MIN_SHARE:
            cand = problem.candidates[m][c]
            groups = " + ".join(f"{g.dp}x{g.gpu} tp{g.tp} pp{g.pp}" for g in cand.groups)
            parts.append(f"{m.split('/')[-1]}: load {f:.0%}, budget {cand.cost / plan.cost:.0%} on {groups}")
    return "; ".join(parts)


def evaluate_workload(params: Params, name: str, db: pd.DataFrame, sc: PlanScenario, routing: Any,
                      floors: list[float]) -> list[dict[str, Any]]:
    """Every system at every requirement on one workload; prints Table 1's rows; returns one row per cell."""
    problem = make_problem(params, db, sc, routing.quality)
    section = params.plan
    truth = exhaustive(problem, section.fraction_steps)
    rows = []
    for share, floor in zip(LARGE_SHARES, floors, strict=True):
        exact = best_under(truth, min_quality=floor)
        mobo = None if exact is None else optimise(  # as the plan stage runs it: the floor as outcome constraint
            problem, section.evaluations, section.initial, section.batch, section.seed, beta=section.beta,
            min_quality=floor)
        plans = {"boute": mobo and best_under(mobo.plans, min_quality=floor), "boute-exact": exact,
                 **paper_baselines(problem, floor, HOMO_GPU, section.fraction_steps)}
        for system, plan in plans.items():
            rows.append({"workload": name, "share": share, "floor": floor, "system": system,
                         **figures(problem, db, plan)})
        chosen = plans["boute"]
        print(f"  {name:<10} Q>={floor:.3f} ({share:.0%} on 70B): " +
              (describe(problem, chosen) + f", ${chosen.cost:.2f}/h" if chosen else "no plan meets it"))
    return rows


def plot(table: pd.DataFrame, name: str) -> Path:
    """Fig. 4 for one workload: P95 against the requirement, one line per system (feasible points only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from exitplan.atomic import write_atomic

    fig, ax = plt.subplots(figsize=(6, 4))
    rows = table[table["workload"] == name]
    for system in SYSTEMS:
        line = rows[(rows["system"] == system) & rows["p95"].notna()]
        ax.plot(line["floor"], line["p95"], marker="o", label=system, linestyle="--" if system == "boute-exact"
                else "-")
    ax.set(xlabel="quality requirement (held-out AlpacaEval quality)", ylabel="P95 end-to-end latency (s)",
           yscale="log", title=f"{name} lengths, 4 types x 8 GPUs, ${BUDGET:.0f}/h, {LOAD:.0f} req/s")
    ax.legend(fontsize=7)
    path = OUT / f"boute_fig4_{name}.png"
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=90, format="png"))
    plt.close(fig)
    return path


def cuts(table: pd.DataFrame) -> dict[str, tuple[float, float, int]]:
    """Average and maximum P95 cut of BOUTE vs each baseline over the cells both meet, and how many cells."""
    wide = table.pivot_table(index=["workload", "share"], columns="system", values="p95").reindex(
        columns=list(SYSTEMS))
    wide["routellm"] = wide[["routellm-count", "routellm-budget"]].min(axis=1)
    out = {}
    for base in ("stand-alone-homo", "stand-alone-hetero", "routellm", "routellm-count", "routellm-budget",
                 "boute-homo"):
        both = wide[["boute", base]].dropna()
        cut = 1 - both["boute"] / both[base]
        out[base] = (float(cut.mean()), float(cut.max()), len(both)) if len(both) else (float("nan"),) * 2 + (0,)
    return out


def print_fig4(table: pd.DataFrame) -> None:
    """Fig. 4's numbers: P95 / mean / P99 / saturation req/s per system and requirement; infeasible apart."""
    print(f"\n{'workload':<11}{'70B share':>10}{'system':>20}{'P95 s':>9}{'mean s':>9}{'P99 s':>9}{'sat req/s':>11}")
    missing = []
    for _, r in table.iterrows():
        if pd.isna(r.get("p95")):
            missing.append(f"{r['system']} at {r['workload']} {r['share']:.0%}")
            continue
        print(f"{r['workload']:<11}{r['share']:>10.0%}{r['system']:>20}{r['p95']:>9.3f}{r['mean']:>9.3f}"
              f"{r['p99']:>9.3f}{r['sat_qps']:>11.1f}")
    print("cannot meet the requirement within the budget and GPUs: " + (", ".join(missing) or "none"))


ABLATIONS: dict[str, dict[str, Any]] = {
    "structured": {},
    "no load-share enc. (S1)": {"thresholds": True},
    "no output transf. (S4)": {"transforms": False},
    "no GPU preference (S5)": {"beta": 0.0},
    "w/o structural info": {"thresholds": True, "transforms": False, "beta": 0.0},
    "structured, no design": {"feasible_start": False},
    "w/o struct., no design": {"thresholds": True, "transforms": False, "beta": 0.0, "feasible_start": False},
}
"""Table 2's variants: MOBO's options switched off (BOUTE's S1 load-share encoding - the routing coordinates read
as score thresholds instead, :mod:`exitplan.planner.encoding`; S4 log/logit output transforms; S5 the GPU-preference
weight), all three (BOUTE's "w/o structural info"), and each of those without exitplan's feasible design (the
corners and Sobol points only), which finds most plans before the kernel is asked anything."""
PAPER_ABLATION = {"w/o structural info": "structured", "w/o struct., no design": "structured, no design"}
"""The variants whose evaluations are reported over those of the structured MOBO with the same design (the
paper's ~8x: the first)."""


def variant_run(params: Params, problem: PlanProblem, routing: Any, floor: float, cap: int,
                options: Mapping[str, Any], seed: int) -> tuple[int, float, bool]:
    """MOBO with one of :data:`ABLATIONS`' options until BOUTE's rule stops it (or ``cap``): the evaluations,
    the seconds, and whether it converged."""
    section = params.plan
    kwargs = {"beta": section.beta, **options}
    if kwargs.pop("thresholds", False):
        problem = threshold_problem(problem, routing.window)
    problem._cache.clear()
    run = optimise(problem, cap, section.initial, section.batch, seed, min_quality=floor, patience=PATIENCE,
                   **kwargs)
    conv = convergence(run.plans, floor)
    evals = conv.stop_at or len(run.plans)
    return evals, run.history_s[evals - 1] if run.history_s else float("nan"), conv.converged


ABLATION_SEEDS = {True: 3, False: 5}
"""Seeds per variant on 4 types x 32 GPUs (quick, full): whether a design-less search meets the plan early is
luck of its Sobol points (seed 0 of the structured one: evaluation 57, of the unstructured one: 2), so the table
gives the median."""


def convergence_table(params: Params, db: pd.DataFrame, lengths: tuple[np.ndarray, np.ndarray], sc: PlanScenario,
                      routing: Any, floor: float, quick: bool, cap: int) -> dict[str, float]:
    """Table 2: MOBO to convergence on 2-4 GPU types x 16-32 GPUs (the full grid unless ``quick``; the plan
    stage's seed), BOUTE's own variants everywhere and every ablation on 4 types x 32 GPUs (the median over
    :data:`ABLATION_SEEDS`), and without the perf DB; returns the median evaluations and seconds of each variant on
    4 types x 32 (``<variant>_evals``, ``<variant>_s``)."""
    types = list(CLUSTER)
    grid = [(4, 32)] if quick else [(n, g) for n in (2, 3, 4) for g in (16, 24, 32)]
    print(f"\nTable 2: MOBO until its plan is unchanged for {PATIENCE} evaluations (cap {cap}), GSM8K lengths, "
          f"Q >= {floor:.3f}; on 4 types x 32 the median of seeds 0-{ABLATION_SEEDS[quick] - 1}")
    print(f"{'types':>6}{'GPUs':>6}{'variant':>26}{'evals':>8}{'seconds':>10}  evaluations per seed")
    out: dict[str, float] = {}
    for n, total in grid:
        gpus = {g: total // n + (1 if i < total % n else 0) for i, g in enumerate(types[:n])}
        try:
            problem = make_problem(params, db, sc, routing.quality, gpus)
        except ExitplanError as exc:
            print(f"{n:>6}{total:>6}  no plan: {exc}")
            continue
        every = n == 4 and total == 32
        if quick:
            names = [name for pair in PAPER_ABLATION.items() for name in reversed(pair)]
        else:
            names = [v for v in ABLATIONS if every or v in ("structured", "w/o structural info")]
        seeds = range(ABLATION_SEEDS[quick]) if every else [params.plan.seed]
        for name in names:
            runs = [variant_run(params, problem, routing, floor, cap, ABLATIONS[name], seed) for seed in seeds]
            evals, seconds = float(np.median([r[0] for r in runs])), float(np.median([r[1] for r in runs]))
            capped = sum(not r[2] for r in runs)
            print(f"{n:>6}{total:>6}{name:>26}{evals:>8.0f}{seconds:>10.1f}  " + " ".join(str(r[0]) for r in runs) +
                  (f" ({capped} at the cap)" if capped else ""))
            if every:
                out[f"{name}_evals"], out[f"{name}_s"] = evals, seconds
        if every:
            per_eval = simulated_eval_seconds(params, problem, optimise(
                problem, 3, 3, 1, params.plan.seed, beta=params.plan.beta).plans, lengths)
            print(f"{n:>6}{total:>6}{'no perf DB (sim.)':>26}{out['structured_evals']:>8.0f}"
                  f"{out['structured_s'] + per_eval * out['structured_evals']:>10.1f}  (MOBO's own seconds plus "
                  f"{per_eval:.2f} s per simulated evaluation, measured on 3 plans)")
    return out


def simulated_eval_seconds(params: Params, problem: PlanProblem, plans: list[Plan],
                           lengths: tuple[np.ndarray, np.ndarray]) -> float:
    """Seconds per plan evaluated by simulating its replicas (no perf DB): each loaded model's layouts swept at its
    share of the load, as ``build_perf_db`` sweeps one layout."""
    from exitplan.simulator.perf_db import Layout, sweep_layout

    catalog = load_catalog(params.path(params.catalog))
    started = time.perf_counter()
    for plan in plans:
        for m, c, f in zip(problem.models, plan.choice, plan.fractions, strict=True):
            if f < MIN_SHARE:
                continue
            for g in problem.candidates[m][c].groups:
                sweep_layout(catalog.model(m), catalog.gpu(g.gpu), Layout(g.gpu, g.tp, g.pp, g.layers),
                             params.simulator.engine, [f * problem.load / g.dp], lengths,
                             params.build_perf_db.requests_per_point, 0)
    return (time.perf_counter() - started) / max(1, len(plans))


def seed_table(params: Params, db: pd.DataFrame, quick: bool) -> list[float]:
    """MOBO's hypervolume ratio (vs the exhaustive front) on the pipeline's perf DB ``db`` for seeds 0-4 on each
    scenario; returns all ratios."""
    names = ["llama2-boute"] if quick else [s.name for s in params.plan.scenarios]
    section = params.plan
    ratios = []
    print(f"\nMOBO's hypervolume share of the exhaustive front, {section.evaluations} evaluations, seeds 0-4 (the "
          "feasible design is exitplan's; without it, the design before issue 30)")
    for sc in [s for s in params.plan.scenarios if s.name in names]:
        try:
            routing = router(params, sc)
            problem = make_problem(params, db, sc, routing.quality)
        except ExitplanError as exc:
            print(f"  {sc.name}: skipped ({exc})")
            continue
        truth = exhaustive(problem, section.fraction_steps)
        finite = [p for p in truth if np.isfinite(p.latency)]
        ref = (max(p.latency for p in finite) * 1.05, min(p.quality for p in finite) - 0.005)
        hv = hypervolume(truth, *ref)
        for label, feasible in (("feasible design", True), ("Sobol + corners", False))[:1 if quick else 2]:
            row = []
            for seed in range(5):
                problem._cache.clear()
                run = optimise(problem, section.evaluations, section.initial, section.batch, seed,
                               beta=section.beta, feasible_start=feasible)
                row.append(hypervolume(run.plans, *ref) / hv)
            if feasible:
                ratios.extend(row)
            print(f"  {sc.name:<14}{label:<17}" + " ".join(f"{r:.3f}" for r in row) +
                  f"   median {np.median(row):.3f}, worst {min(row):.3f}")
    return ratios


def main() -> None:
    args, params = start(__doc__)
    sc = scenario(params)
    try:
        routing = router(params, sc)
        db = pd.read_parquet(perf_db_path(params))
        dbs = workload_dbs(params, db, sc.models, 300 if args.quick else params.build_perf_db.requests_per_point)
    except (ExitplanError, FileNotFoundError) as exc:
        sys.exit(f"{exc} (run `make run` first)")
    floors = requirements(routing)
    print(f"quality requirements (held-out AlpacaEval quality at {', '.join(f'{s:.0%}' for s in LARGE_SHARES)} of "
          f"the load on the 70B): {', '.join(f'{q:.3f}' for q in floors)}")
    print("\nTable 1: BOUTE's plans (MOBO's best meeting the requirement)")
    table = pd.DataFrame([row for name, db in dbs.items()
                          for row in evaluate_workload(params, name, db, sc, routing, floors)])
    print_fig4(table)
    plots = [plot(table, name) for name in dbs]
    print("plots: " + ", ".join(str(p.relative_to(OUT.parent.parent)) for p in plots))
    found = cuts(table)
    print(f"\n{'P95 cut of BOUTE vs':<22}{'avg':>8}{'max':>8}{'cells':>7}{'paper avg':>11}{'paper max':>11}")
    for base, (avg, top, n) in found.items():
        paper = PAPER.get(base, (float("nan"), float("nan")))
        print(f"{base:<22}{avg:>8.1%}{top:>8.1%}{n:>7}{paper[0]:>11.0%}{paper[1]:>11.0%}")
    queries = pd.read_parquet(params.path(params.prepare_workload.output_dir) / "queries.parquet")
    gsm8k = queries[queries["dataset"] == "gsm8k"]
    conv = convergence_table(params, dbs["gsm8k"], (gsm8k["prompt_len"].to_numpy(), gsm8k["output_len"].to_numpy()),
                             sc, routing, floors[1], args.quick, 80 if args.quick else 160)
    ratios = seed_table(params, db, args.quick)
    ratios_ab = [conv.get(f"{off}_evals", float("nan")) / conv.get(f"{on}_evals", float("nan"))
                 for off, on in PAPER_ABLATION.items()]
    print(f"RESULT cut_vs_routellm_avg={found['routellm'][0]:.3f} cut_vs_routellm_max={found['routellm'][1]:.3f} "
          f"cut_vs_homo_avg={found['boute-homo'][0]:.3f} cut_vs_single_avg={found['stand-alone-hetero'][0]:.3f} "
          f"hv_median_5seeds={np.median(ratios):.3f} hv_worst_5seeds={min(ratios):.3f} "
          f"converge_s_4types={conv.get('structured_s', float('nan')):.1f} ablation_evals_ratio={ratios_ab[0]:.2f} "
          f"ablation_evals_ratio_nodesign={ratios_ab[1]:.2f}")


if __name__ == "__main__":
    main()
