"""What ``make run`` prints at the end: where the outputs are, and the promoted plan."""

from __future__ import annotations

from exitplan.artifacts import gate_path, plan_path
from exitplan.config import Params
from exitplan.planner.plan_file import Plan, parse_plan


def _champion(params: Params) -> tuple[str, Plan] | None:
    """The champion's version and plan, from the MLflow registry (None: no champion yet)."""
    from exitplan import tracking

    if not params.tracking.enabled:
        return None
    name = params.plan.registered_model
    found = tracking.alias_version(params.tracking, params.root, name, "champion")
    if found is None:
        return None
    raw = tracking.plan_artifact(params.tracking, params.root, name, found["version"])
    return found["version"], parse_plan(raw, f"plan.json of {name} version {found['version']}")


def promoted_plan(params: Params) -> str:
    """The champion plan in a few lines (or why there is none yet)."""
    scenario = params.plan.scenarios[0]
    path = plan_path(params, scenario.name)
    champion = _champion(params)
    if champion is None:
        return (f"  no champion plan yet: the challenger ({path}) is promoted once its gates pass "
                f"(report: {gate_path(params)})")
    version, plan = champion
    head = (f"  promoted plan '{scenario.name}' (MLflow model {params.plan.registered_model} v{version}, "
            f"alias champion): "
            f"P95 {plan.predicted_p95_s:.3f} s, quality {plan.predicted_quality:.3f}, "
            f"${plan.cost_per_hour:.2f}/h of ${plan.budget_per_hour}/h at {plan.load_qps} req/s")
    lines = [head]
    for m in plan.models:
        groups = ", ".join(f"{g.dp} x {g.gpu} (tp={g.tp}, pp={g.pp})" for g in m.groups) or "-"
        lines.append(f"    {m.model}: {m.fraction:.0%} of the load -> {groups}")
    lines.append(f"  Pareto plot: reports/plan/{scenario.name}/front.png; plan: {path}")
    return "\n".join(lines)


def scenario_plans(params: Params) -> str:
    """One line per scenario of ``plan``: its plan's P95, quality and cost, and its Pareto plot (or why none)."""
    from exitplan.errors import ExitplanError
    from exitplan.planner.plan_file import read_plan

    lines = ["  plans (predicted):"]
    for scenario in params.plan.scenarios:
        path = plan_path(params, scenario.name)
        if not path.is_file():
            lines.append(f"    {scenario.name}: no plan (skipped or not run; reports/plan/metrics.json says why)")
            continue
        try:
            plan = read_plan(path)
        except ExitplanError as exc:
            lines.append(f"    {scenario.name}: {exc}")
            continue
        shares = ", ".join(f"{m.model.split('/')[-1]} {m.fraction:.0%}" for m in plan.models)
        lines.append(f"    {scenario.name}: P95 {plan.predicted_p95_s:.3f} s, quality {plan.predicted_quality:.3f}, "
                     f"${plan.cost_per_hour:.2f}/h ({shares}); plot reports/plan/{scenario.name}/front.png")
    return "\n".join(lines)


def outputs(params: Params) -> str:
    """Where every output of the pipeline is."""
    return f"""exitplan plan_fleet finished. Outputs:
  model checkpoints  {params.path(params.fetch_models.checkpoint_dir)}
  workloads          {params.path(params.prepare_workload.output_dir)} (queries.parquet, trace_*.parquet)
  perf DB            {params.path(params.build_perf_db.output_dir)} (perf_db.parquet; plots in reports/build_perf_db/)
  exit heads         {params.path(params.train_exits.output_dir)} (agreement vs depth: reports/train_exits/)
  exit profile       {params.path(params.exit_profile.output_dir)} (tables and plots: reports/exit_profile/)
  device profile     {params.path(params.profile_device.output_dir)} (device.yaml: this machine for the simulator)
  HELIOS candidates  {params.path(params.select_candidates.output)}
  quality labels     {params.path(params.label_quality.output_dir)}
  plans              {params.path(params.plan.output_dir)}
  HELIOS PHT         {params.path(params.helios.pht_path)} (online profile: reports/online_profile/)
  gate report        {gate_path(params)} (`exitplan promote --dry-run`)
  metrics            reports/  (`dvc metrics show`, `dvc plots show`)
  runs               MLflow: `mlflow ui --backend-store-uri sqlite:///{params.root / 'mlflow.db'}`
{scenario_plans(params)}
{promoted_plan(params)}"""
