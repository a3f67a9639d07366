"""Stage ``gate``: every expectation a challenger plan must meet before promotion, in one report.

Data suites (workload traces, perf DB, quality labels, PHT, the plan itself; the suites are
:mod:`validation.suites`) and the served-quality gate (:mod:`exitplan.engine.served_quality`) write
``<gates.output_dir>/gate.json``: the plan's SHA-256, each suite's result and every failed expectation by name.
The stage itself never fails on a failed gate (its report is the output DVC keeps); ``exitplan promote`` reads the
report and refuses, naming the failures, when it did not pass. Wall times go to ``metrics.json``, not the report.

Run by DVC: ``exitplan stage gate``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pandas as pd

from exitplan.artifacts import (
    LABELS_FILE,
    LENGTHS_FILE,
    gate_path,
    imported_path,
    labels_path,
    perf_db_path,
    plan_path,
    telemetry_path,
)
from exitplan.atomic import write_json, write_parquet
from exitplan.config import Params
from exitplan.engine.telemetry import REQUEST_COLUMNS
from exitplan.gate_report import GateReport, ScenarioReport, SuiteRecord, write_gate_report
from exitplan.planner.plan_file import Plan, read_plan
from exitplan.tracking import log_stage_run
from validation import suites
from validation.check import SuiteResult, validate


def promoted_plan_path(params: Params) -> Path:
    """The promoted scenario's plan (the first scenario's)."""
    return plan_path(params, params.plan.scenarios[0].name)


def sha256(path: Path) -> str:
    """SHA-256 of a file."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def pht_frame(path: Path) -> pd.DataFrame:
    """The PHT as one row per candidate (exit shares summed); no rows when there is none."""
    from dataclasses import asdict

    from exitplan.profiling.pht import PerformanceHistoryTable

    entries = PerformanceHistoryTable(path).entries.values()
    return pd.DataFrame([{**{k: v for k, v in asdict(e).items() if k not in ("exit_distribution", "exit_layers")},
                          "exit_share_sum": sum(e.exit_distribution.values())} for e in entries])


def plan_frame(plan: Plan) -> pd.DataFrame:
    """The plan as one row per model."""
    return pd.DataFrame([m.model_dump(include={"model", "fraction", "predicted_p95_s", "predicted_p99_s",
                                               "cost_per_hour"}) for m in plan.models])


def data_suites(params: Params, plan: Plan) -> list[SuiteResult]:
    """Every input of the plan against its suite."""
    gates = params.gates
    workload = params.path(params.prepare_workload.output_dir)
    results = [validate(f"trace:{t.name}", pd.read_parquet(workload / f"trace_{t.name}.parquet"), suites.trace(gates))
               for t in params.prepare_workload.traces]
    results.append(validate("perf_db", pd.read_parquet(perf_db_path(params)), suites.perf_db(gates)))
    results.append(validate("labels", pd.read_parquet(labels_path(params)), suites.labels(gates)))
    results.append(validate("pht", pht_frame(params.path(params.helios.pht_path)), suites.pht(gates)))
    results.append(validate("plan", plan_frame(plan), suites.plan(gates)))
    return results


def not_served(params: Params, deployed: list[str]) -> str | None:
    """What the served-quality gate cannot check for these models (None when every one runs here)."""
    from exitplan.engine.served_quality import runnable

    missing = [m for m in deployed if m not in runnable(params, deployed)]
    if not missing:
        return None
    return (f"served quality not measured for {missing}: no checkpoint runs here (simulated only); the gate vouches "
            f"for their inputs, not for how they serve")


def imported_suites(params: Params) -> list[SuiteResult]:
    """The imported labels and answer lengths the other scenarios rest on (validated once for all of them)."""
    gates = params.gates
    return [validate("imported_labels", pd.read_parquet(imported_path(params, LABELS_FILE)),
                     suites.imported_labels(gates)),
            validate("imported_lengths", pd.read_parquet(imported_path(params, LENGTHS_FILE)),
                     suites.imported_lengths(gates))]


def record(result: SuiteResult) -> SuiteRecord:
    """A suite's result as the report keeps it."""
    return SuiteRecord(suite=result.suite, success=result.success, failures=list(result.failures),
                       evaluated=result.evaluated)


def other_scenario(params: Params, name: str, inputs: list[SuiteResult]) -> ScenarioReport | None:
    """The data suites of a scenario that is not promoted: its plan, with the imported ``inputs`` (the perf DB is
    in the promoted scenario's suites); ``None`` when the plan stage skipped it."""
    path = plan_path(params, name)
    if not path.is_file():
        return None
    plan = read_plan(path)
    results = [*inputs, validate("plan", plan_frame(plan), suites.plan(params.gates))]
    deployed = [m.model for m in plan.served]
    return ScenarioReport(plan=str(path.relative_to(params.root)), plan_sha256=sha256(path),
                          data_passed=all(r.success for r in results), suites=[record(r) for r in results],
                          not_served=not_served(params, deployed))


def other_scenarios(params: Params) -> dict[str, ScenarioReport | None]:
    """:func:`other_scenario` of every scenario after the first."""
    names = [sc.name for sc in params.plan.scenarios[1:]]
    planned = [n for n in names if plan_path(params, n).is_file()]
    inputs = imported_suites(params) if planned else []
    return {n: other_scenario(params, n, inputs) for n in names}


def run(params: Params) -> tuple[GateReport, dict[str, float]]:
    """Run every suite and the quality gate; write the report and the HELIOS runs' telemetry.

    Returns:
        The report, and the seconds each model took to serve (a metric: wall times stay out of the report).
    """
    from exitplan.engine.served_quality import measure

    path = promoted_plan_path(params)
    plan = read_plan(path)
    results = data_suites(params, plan)
    deployed = [m.model for m in plan.served]
    table, telemetry = measure(params, deployed)
    results.append(validate("quality", table, suites.quality(params.gates)))
    write_parquet(telemetry_path(params), telemetry if not telemetry.empty else
                  pd.DataFrame(columns=list(REQUEST_COLUMNS)))
    seconds = dict(zip(table["model"], table.pop("serve_seconds"), strict=True)) if len(table) else {}
    report = GateReport(scenario=params.plan.scenarios[0].name, plan=str(path.relative_to(params.root)),
                        plan_sha256=sha256(path), passed=all(r.success for r in results),
                        suites=[record(r) for r in results], quality=json.loads(table.to_json(orient="records")),
                        not_served=not_served(params, deployed), other_scenarios=other_scenarios(params))
    write_gate_report(gate_path(params), report)
    return report, seconds


def metrics(report: GateReport) -> dict[str, Any]:
    """Numbers for ``dvc metrics show`` and MLflow."""
    out: dict[str, Any] = {"passed": int(report.passed), "failed_expectations": len(report.failures)}
    for name, other in report.other_scenarios.items():
        if other is not None:
            out[f"{name}.data_passed"] = int(other.data_passed)
    for row in report.quality:
        for key in ("exit_layer", "ppl_helios", "ppl_full", "ppl_increase_rel", "rouge2_vs_full", "em_helios",
                    "em_full", "breach_rate"):
            out[f"{row['model']}.{key}"] = row[key]
    return out


def main(params: Params) -> GateReport:
    """Run the stage and record it."""
    report, seconds = run(params)
    figures = metrics(report)
    out = params.path(params.gates.output_dir)
    write_json(out / "metrics.json", figures)
    log_stage_run("gate", params.tracking, params.root, params.gates.model_dump(), figures, [gate_path(params)],
                  wall_s={f"{model}.serve_seconds": float(s) for model, s in seconds.items()})
    return report


def describe(report: GateReport) -> str:
    """The verdict and every failed expectation."""
    lines = [f"gate {'PASSED' if report.passed else 'FAILED'} for {report.plan}"]
    lines += [f"  {failure}" for failure in report.failures]
    if report.not_served:
        lines.append(f"  note: {report.not_served}")
    for name, other in report.other_scenarios.items():
        if other is None:
            lines.append(f"{name}: no plan (skipped by the plan stage)")
            continue
        lines.append(f"{name}: data suites {'passed' if other.data_passed else 'FAILED'} for {other.plan}")
        lines += [f"  {suite.suite}: {f}" for suite in other.suites for f in suite.failures]
        if other.not_served:
            lines.append(f"  note: {other.not_served}")
    return "\n".join(lines)

