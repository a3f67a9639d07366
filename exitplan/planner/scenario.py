"""One scenario planned end to end: problem, MOBO, the exact front, the baselines, the chosen plan and its files.

The ``plan`` stage (the pipeline's scenarios) and ``exitplan plan`` (a user's fleet file, :mod:`exitplan.fleet`) both
call :func:`plan_scenario` once they have a perf DB, a catalog and a trained router; only where those come from
differs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from exitplan.artifacts import PLAN_FILE, ROUTER_FILE
from exitplan.atomic import write_atomic, write_parquet
from exitplan.catalog import Catalog
from exitplan.config import PlanParams, PlanScenario
from exitplan.errors import ExitplanError
from exitplan.planner.plan_file import Baseline, GroupPlan, ModelPlan, Plan, write_plan
from exitplan.planner.problem import PlanProblem
from exitplan.routing.router_file import RoutingModel, dump_router
from exitplan.routing.trainer import TrainedRouter
from exitplan.simulator.colocation import HostSharing

FRONT_FILE = "front.parquet"
"""The MOBO evaluations, the exhaustive front and the baselines of a scenario (one row per plan)."""

ROUTED_FILE = "routed_perf.parquet"
"""The perf-DB rows a scenario's models were read from by routed share, when it has them (one row per model x
layout x share x load)."""

PLOT_FILE = "front.png"
"""P95 vs quality of a scenario's plans."""


def binding_constraint(truth: list, scenario: PlanScenario) -> str:
    """Which SLO constraint no plan meets, with the best that is feasible."""
    from exitplan.planner.problem import best_under

    best_q = max((p.quality for p in truth if np.isfinite(p.latency)), default=float("nan"))
    if not truth or best_q < scenario.min_quality:
        return (f"the quality floor binds: Q >= {scenario.min_quality} is out of reach within "
                f"${scenario.budget_per_hour}/h at {scenario.load_qps} req/s; the best quality that is feasible is "
                f"{best_q:.3f}")
    fastest = best_under(truth, min_quality=scenario.min_quality)
    if fastest is None:
        return f"no plan within ${scenario.budget_per_hour}/h meets Q >= {scenario.min_quality}"
    return (f"the latency cap binds: P95 <= {scenario.max_p95_s} s is out of reach with Q >= "
            f"{scenario.min_quality} within ${scenario.budget_per_hour}/h; the lowest feasible P95 is "
            f"{fastest.latency:.3f} s (${fastest.cost:.2f}/h)")


def describe(problem: Any, plan: Any, window: np.ndarray, db: Any, routed: Any = None, **extra: Any) -> Plan:
    """The plan file: per model its fraction, threshold, GPU groups, replica load weights, predicted P95 and P99
    (co-located replicas slowed by their neighbours, as the plan was evaluated; ``db``: the perf DB the P99 curves
    come from, ``routed`` its rows by routed share where the problem has them; ``extra``: the scenario's other fields
    of :class:`Plan`)."""
    from exitplan.planner.build import deployment_curves
    from exitplan.planner.problem import MIN_SHARE, slowed_replicas
    from exitplan.planner.routed import curves_at, share_curves
    from exitplan.routing.fractions import thresholds
    from exitplan.simulator.curve import best_split

    cuts = thresholds(window, plan.fractions)
    models = []
    slowed = iter(problem.colocated_slowdowns(np.asarray(plan.fractions), plan.choice) or [])
    for i, (m, c, f) in enumerate(zip(problem.models, plan.choice, plan.fractions, strict=True)):
        cand = problem.candidates[m][c]
        load = f * problem.load
        entry: dict[str, Any] = {"model": m, "fraction": f, "load_qps": load, "deployed": f >= MIN_SHARE,
                                 "full_layers": problem.depths(i)[-1], "quality_source": quality_source(problem, i, c)}
        if f >= MIN_SHARE:
            slowdown = next(slowed, None)  # replicas slowed by host neighbours, P95 and P99 alike
            weights, p95 = best_split(load, slowed_replicas(cand.replica_curves(problem.curves_at(i, f)), slowdown))
            gpus, layers = [g.gpu for g in cand.groups], [g.layers for g in cand.groups]
            p99_curves = curves_at(deployment_curves(db, m, gpus, "e2e_p99_s", layers),
                                   share_curves(routed, m, gpus, "e2e_p99_s", layers), f)
            _, p99 = best_split(load, slowed_replicas(cand.replica_curves(p99_curves), slowdown))
            entry.update(cost_per_hour=cand.cost, predicted_p95_s=p95, predicted_p99_s=p99,
                         replica_weights=list(np.asarray(weights) / load),
                         groups=[GroupPlan(gpu=g.gpu, tp=g.tp, pp=g.pp, dp=g.dp, gpus=g.gpus, layers=g.layers)
                                 for g in cand.groups])
        models.append(ModelPlan(**entry))
    return Plan(models=models, thresholds=[float(x) for x in cuts], predicted_p95_s=plan.latency,
                predicted_quality=plan.quality, cost_per_hour=plan.cost, load_qps=problem.load,
                budget_per_hour=problem.budget, **extra)


def quality_source(problem: Any, model: int, cand: int) -> str:
    """Where the quality of a model at its candidate's depth comes from, for ``plan.json``."""
    layers, full = problem.layers_of(model, cand), problem.depths(model)[-1]
    if layers == full:
        return "labels (full depth)"
    sources = getattr(problem.depth_quality, "sources", {})
    return f"at {layers} of {full} layers: {sources.get(problem.models[model], '')}"


def plot_front(path: Path, title: str, mobo: list, truth: list, marks: dict[str, Any], chosen: Any) -> Path:
    """P95 latency vs quality: every MOBO evaluation, the exhaustive front, the baselines and the chosen plan."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from exitplan.planner.problem import pareto

    fig, ax = plt.subplots(figsize=(7, 4.5))
    finite = [p for p in mobo if np.isfinite(p.latency)]
    ax.scatter([p.latency for p in finite], [p.quality for p in finite], s=12, alpha=0.4, label="MOBO evaluations")
    front = pareto(truth)
    ax.step([p.latency for p in front], [p.quality for p in front], where="post", color="black", linewidth=1,
            label="exhaustive front")
    for name, plan in marks.items():
        if plan is not None:
            ax.scatter([plan.latency], [plan.quality], marker="x", s=50, label=name)
    if chosen is not None:
        ax.scatter([chosen.latency], [chosen.quality], marker="*", s=160, color="red", label="chosen plan")
    ax.set(xscale="log", xlabel="P95 end-to-end latency (s)", ylabel="quality Q(f)", title=title)
    ax.legend(fontsize=7)
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    plt.close(fig)
    return path


def save_router(path: Path, embedder: str, models: list[str], scorer: Any, window: np.ndarray) -> Path:
    """Persist the routing model the plan's thresholds belong to (JSON, atomically; see
    :mod:`exitplan.routing.router_file`)."""
    blob = dump_router(RoutingModel(embedder, list(models), scorer, np.asarray(window, float)))
    return write_atomic(path, lambda tmp: Path(tmp).write_bytes(blob))


def train_on_labels(section: PlanParams, labels: Any, queries: Any, models: list[str],
                    embedder: Path) -> TrainedRouter:
    """The router of ``models``, trained on the queries labelled for all of them.

    Args:
        section: The planner's knobs (seed, train share, fraction grid).
        labels: Rows (model, dataset, query_id, quality).
        queries: Rows (dataset, query_id, prompt) holding the prompt of every labelled query.
        models: The scenario's models, smallest first.
        embedder: The fetched sentence embedder's checkpoint.

    Raises:
        ExitplanError: a model has no labels, too few queries are labelled for all, or a prompt is missing.
    """
    from exitplan.planner.build import depth_labels, quality_table
    from exitplan.routing.scores import embed
    from exitplan.routing.trainer import train_router

    wide = quality_table(labels, models)
    texts = queries.drop_duplicates(["dataset", "query_id"]).set_index(["dataset", "query_id"])["prompt"]
    missing = wide.index.difference(texts.index)
    if len(missing):
        raise ExitplanError(f"no prompt for {len(missing)} labelled queries, e.g. {list(missing[0])}: every "
                            f"labelled (dataset, query_id) needs its prompt text")
    vectors = embed(embedder, texts.loc[wide.index].tolist())
    routing = train_router(vectors, wide.to_numpy(), section.seed, section.routing_train_share, section.fraction_steps)
    at_depth = depth_labels(labels, models, wide.index)
    return replace(routing, held_depth={key: column[routing.held_rows] for key, column in at_depth.items()})


def _depth_figures(problem: PlanProblem) -> dict[str, dict[int, float]]:
    """Per model, the agreement figures Q(f, depths) was built with (none when the problem plans no depth)."""
    if not problem.plans_depth:
        return {}
    return {m: dict(row) for m, row in getattr(problem.depth_quality, "agreement", {}).items()}


def _front_frame(mobo: list, truth: list, marks: dict[str, Any]) -> Any:
    import pandas as pd

    from exitplan.planner.problem import pareto

    rows = [{"source": "mobo", "order": i, **vars(p)} for i, p in enumerate(mobo)]
    rows += [{"source": "exhaustive-front", "order": i, **vars(p)} for i, p in enumerate(pareto(truth))]
    rows += [{"source": name, "order": 0, **vars(p)} for name, p in marks.items() if p is not None]
    frame = pd.DataFrame(rows)
    frame["fractions"] = frame["fractions"].map(list)
    frame["choice"] = frame["choice"].map(list)
    frame["layers"] = frame["layers"].map(list)
    return frame


def scenario_depths(scenario: PlanScenario, db: Any, catalog: Catalog, routing: TrainedRouter,
                    agreement: Mapping[str, Mapping[int, float]]) -> tuple[dict[str, list[int]], Any]:
    """The depths each model of a depth-planning scenario may be cut to, and Q(f, depths) on the router's held-out
    queries: per query where the model was labelled at that depth (``label_quality.depths``, in ``routing``), else
    by the rule from its agreement at that exit: ``scenario.depth_agreement``'s (a published table) when given
    there, the exit profile's (identity exits, ``agreement``) otherwise.

    Raises:
        ExitplanError: naming a depth the perf DB holds whose quality was never measured.
    """
    from exitplan.planner.depth import build_depth_quality, check_depths

    depths, used, sources = {}, {}, {}
    measured: dict[str, dict[int, np.ndarray]] = {}
    for (m, layers), column in routing.held_depth.items():
        measured.setdefault(m, {})[layers] = column
    for m in scenario.models:
        rows = db[(db["model"] == m) & db["gpu"].isin(list(scenario.gpus))]
        published = m in scenario.depth_agreement
        used[m] = dict(scenario.depth_agreement[m] if published else agreement.get(m, {}))
        known = {**used[m], **dict.fromkeys(measured.get(m, {}), 1.0)}
        depths[m] = check_depths(m, sorted({int(x) for x in rows["layers"]}), catalog.llm(m).num_layers, known)
        rule = f"q = {scenario.quality_floor} + a (q_full - {scenario.quality_floor})"
        source = (f"published agreement by exit (params: plan.scenarios[{scenario.name}].depth_agreement), {rule}"
                  if published else f"exit_profile: identity-exit agreement on held-out text, {rule}")
        labelled = sorted(set(measured.get(m, {})) & set(depths[m]))
        sources[m] = (f"label_quality per query at {labelled} layers; other depths: {source}" if labelled
                      else source)
    quality = build_depth_quality(scenario.models, routing.held_scores, routing.held_qualities, routing.grid, depths,
                                  used, sources, scenario.quality_floor, measured)
    return depths, quality


def scenario_problem(section: PlanParams, scenario: PlanScenario, db: Any, catalog: Catalog,
                     routing: TrainedRouter, agreement: Mapping[str, Mapping[int, float]] | None = None,
                     routed: Any = None) -> PlanProblem:
    """The scenario's co-optimisation problem: deployment candidates per model from ``db`` (knapsack per model,
    load share and depth) within its GPUs and budget, with the router's quality function (Q(f, depths) when the
    scenario plans depth: :func:`scenario_depths`, ``agreement`` the exit profile's); replicas on a GPU type whose
    replicas share a host (the catalog's ``neighbour_slowdown``, ``host_slots`` and the coordinator's costs: this
    machine's vLLM device) slow each other; ``routed``: perf-DB rows by routed share (:mod:`exitplan.planner.
    routed`), read instead of ``db``'s where they exist."""
    from exitplan.planner.build import problem_from

    prices = {g: catalog.gpu(g).price_per_hour for g in scenario.gpus}
    sharing = {g: HostSharing.of(catalog.gpu(g)) for g in scenario.gpus}
    shared = {g: host for g, host in sharing.items() if host.shared}
    depths, quality = (scenario_depths(scenario, db, catalog, routing, agreement or {}) if scenario.depths
                       else (None, None))
    return problem_from(db, prices, scenario.gpus, scenario.models, routing.quality, scenario.load_qps,
                        scenario.budget_per_hour, section.metric, section.budget_points, scenario.max_p95_s,
                        section.load_shares, shared, depths, quality, routed)


def plan_scenario(section: PlanParams, scenario: PlanScenario, db: Any, catalog: Catalog, routing: TrainedRouter,
                  out: Path, reports: Path, progress: Callable[[str], None] | None = None,
                  agreement: Mapping[str, Mapping[int, float]] | None = None, routed: Any = None) -> dict[str, Any]:
    """Optimise one scenario on ``db`` and write its plan, front, router (under ``out``) and plot (``reports``).

    Args:
        section: The planner's knobs (``plan`` in params).
        scenario: Models, GPUs, budget, load and SLO.
        db: The perf DB covering every (model, GPU) of the scenario.
        catalog: GPUs (their prices) and models.
        routing: The router trained on the scenario's labelled queries.
        out: Folder of ``plan.json``, ``front.parquet`` and ``router.json``.
        reports: Folder of ``front.png``.
        progress: Called with a line as each part starts.
        agreement: The exit profile's agreement by exit per model (for a scenario that plans depth).
        routed: Perf-DB rows simulated on the lengths each model is routed, by share (:mod:`exitplan.planner.routed`;
            none: every model is read from ``db``).

    Returns:
        ``plan`` (the typed plan), the paths written, and ``times`` (``mobo_seconds``, ``seconds``).

    Raises:
        ExitplanError: no plan meets the SLO within the budget (naming the constraint that binds), or a model has no
            deployment within the GPUs and budget.
    """
    from exitplan.planner.baselines import baselines
    from exitplan.planner.mobo import optimise
    from exitplan.planner.problem import best_under
    from exitplan.planner.search import exhaustive

    say = progress or (lambda _line: None)
    started = time.perf_counter()
    say("deployment candidates (knapsack per model and load share)")
    problem = scenario_problem(section, scenario, db, catalog, routing, agreement, routed)
    say(f"MOBO, {section.evaluations} evaluations")
    mobo = optimise(problem, section.evaluations, section.initial, section.batch, section.seed, beta=section.beta,
                    max_latency=scenario.max_p95_s, min_quality=scenario.min_quality or None,
                    feasibility=section.feasibility)
    say("the exhaustive front and the baselines")
    truth = exhaustive(problem, section.fraction_steps)
    cap = scenario.max_p95_s or float("inf")
    marks = baselines(problem, scenario.min_quality, cap, section.fraction_steps)
    # The exhaustive front is exact and takes well under a second here (decomposed per fraction vector), so the
    # chosen plan is the best of MOBO's evaluations and the grid's: MOBO adds plans between the grid's fractions.
    from_mobo = best_under(mobo.plans, cap, scenario.min_quality)
    chosen = best_under([p for p in (from_mobo, best_under(truth, cap, scenario.min_quality)) if p], cap,
                        scenario.min_quality)
    if chosen is None:
        raise ExitplanError(f"plan {scenario.name}: {binding_constraint(truth, scenario)}")
    write_parquet(out / FRONT_FILE, _front_frame(mobo.plans, truth, marks))
    if routed is not None:
        write_parquet(out / ROUTED_FILE, routed)
    plan = describe(problem, chosen, routing.window, db, routed, scenario=scenario.name,
                    slo={"max_p95_s": scenario.max_p95_s, "min_quality": scenario.min_quality},
                    baselines={k: (None if p is None else Baseline(p95_s=p.latency, quality=p.quality, cost=p.cost))
                               for k, p in marks.items()},
                    quality_curve={"f_large": routing.grid[:, -1].tolist(), "router": routing.values.tolist(),
                                   "oracle": routing.oracle.tolist(), "random": routing.random.tolist()},
                    evaluations=len(mobo.plans), found_by="mobo" if chosen is from_mobo else "exhaustive",
                    mobo_p95_s=None if from_mobo is None else from_mobo.latency, plans_depth=problem.plans_depth,
                    depth_agreement=_depth_figures(problem))
    write_plan(out / PLAN_FILE, plan)
    save_router(out / ROUTER_FILE, section.embedder, scenario.models, routing.scorer, routing.window)
    png = plot_front(reports / PLOT_FILE, f"{scenario.name}: {scenario.load_qps} req/s, "
                     f"${scenario.budget_per_hour}/h", mobo.plans, truth, marks, chosen)
    return {"name": scenario.name, "plan": plan, "plan_path": out / PLAN_FILE, "png": png,
            "front": out / FRONT_FILE, "router": out / ROUTER_FILE,
            "times": {"mobo_seconds": mobo.seconds, "seconds": time.perf_counter() - started}}
