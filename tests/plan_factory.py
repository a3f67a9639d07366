"""Typed plans built by hand for tests (tests/ is on sys.path: its conftest.py has no package)."""

from __future__ import annotations

from exitplan.planner.plan_file import Plan


def plan_of(models: list[dict], thresholds: list[float] | None = None) -> Plan:
    """A typed plan (:class:`exitplan.planner.plan_file.Plan`) of ``models`` (dicts of ``ModelPlan`` fields), with
    placeholder objectives; groups may leave out ``tp``/``pp`` (1) and ``gpus`` (their product with ``dp``)."""
    def filled(group: dict) -> dict:
        full = {"gpu": "rtx-4090", "tp": 1, "pp": 1, **group}
        return {**full, "gpus": full["tp"] * full["pp"] * full["dp"]}

    entries = [{**m, "groups": [filled(g) for g in m.get("groups", [])]} for m in models]
    return Plan.model_validate({"models": entries, "thresholds": thresholds or [], "predicted_p95_s": 1.0,
                                "predicted_quality": 0.5, "cost_per_hour": 1.0, "load_qps": 1.0,
                                "budget_per_hour": 2.0})
