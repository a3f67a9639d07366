"""exitplan.summary: the screen ``make run`` ends with lists every scenario's plan and the champion (or why none)."""

from __future__ import annotations

import shutil
from pathlib import Path

from plan_factory import plan_of

from exitplan import REPO_ROOT
from exitplan.artifacts import plan_path
from exitplan.config import load_params
from exitplan.planner.plan_file import write_plan
from exitplan.summary import outputs, scenario_plans


def test_every_scenario_is_listed_with_its_plan_or_why_it_has_none(tmp_path: Path) -> None:
    shutil.copy(REPO_ROOT / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / "model_repository").mkdir()
    shutil.copy(REPO_ROOT / "model_repository" / "catalog.yaml", tmp_path / "model_repository" / "catalog.yaml")
    params = load_params(tmp_path / "params.yaml")
    params = params.model_copy(update={"tracking": params.tracking.model_copy(update={"enabled": False})})
    first, second = (s.name for s in params.plan.scenarios[:2])
    plan = plan_of([{"model": "org/small", "fraction": 0.75}, {"model": "org/large", "fraction": 0.25}])
    write_plan(plan_path(params, first), plan)
    plan_path(params, second).parent.mkdir(parents=True)
    plan_path(params, second).write_text("{not json")
    lines = scenario_plans(params).splitlines()
    assert lines[1] == (f"    {first}: P95 1.000 s, quality 0.500, $1.00/h (small 75%, large 25%); plot "
                        f"reports/plan/{first}/front.png")
    assert lines[2].startswith(f"    {second}: ") and "plan.json" in lines[2]
    assert all("no plan" in line for line in lines[3:]) and len(lines) == 1 + len(params.plan.scenarios)
    screen = outputs(params)
    assert "plans (predicted):" in screen and "no champion plan yet" in screen
