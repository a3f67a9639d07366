"""Every stage of dvc.yaml lists the project code it runs, so that changing that code re-runs the stage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from exitplan import REPO_ROOT
from exitplan.codedeps import NEUTRAL, closure, entry_module, uncovered


def _stages() -> dict[str, dict[str, Any]]:
    tree = yaml.safe_load((REPO_ROOT / "dvc.yaml").read_text())
    return {name: stage.get("do", stage) for name, stage in tree["stages"].items()}


def _code_deps(stage: dict[str, Any]) -> list[str]:
    return [d for d in stage.get("deps", []) if isinstance(d, str) and "${" not in d]


STAGES = _stages()


@pytest.mark.parametrize("name", sorted(STAGES))
def test_a_stage_lists_every_project_module_it_runs(name: str) -> None:
    stage = STAGES[name]
    missing = uncovered(REPO_ROOT, stage["cmd"], _code_deps(stage))
    assert not missing, f"dvc.yaml stage '{name}' runs {missing} but its deps do not list them"


@pytest.mark.parametrize("name", sorted(STAGES))
def test_a_stage_lists_no_module_it_does_not_run(name: str) -> None:
    """The other direction: a module the stage no longer imports would re-run it for nothing."""
    stage = STAGES[name]
    runs = {p.as_posix() for p in closure(REPO_ROOT, entry_module(stage["cmd"]) or "")}
    stale = [d for d in _code_deps(stage) if d.endswith(".py") and d not in runs]
    assert not stale, f"dvc.yaml stage '{name}' lists {stale} but does not run them"


def test_every_stage_runs_a_project_module_and_every_code_dep_exists() -> None:
    for name, stage in STAGES.items():
        assert entry_module(stage["cmd"]) is not None, name
        for dep in _code_deps(stage):
            assert (REPO_ROOT / dep).exists(), f"stage '{name}' lists {dep}, which does not exist"


def test_dropping_a_folder_from_a_stages_deps_is_caught_naming_the_module() -> None:
    """The mutation the guard exists for: build_perf_db without exitplan/simulator."""
    stage = STAGES["build_perf_db"]
    deps = [d for d in _code_deps(stage) if d != "exitplan/simulator"]
    assert len(deps) < len(_code_deps(stage))
    missing = uncovered(REPO_ROOT, stage["cmd"], deps)
    assert "exitplan/simulator/replica.py" in missing and all(m.startswith("exitplan/simulator/") for m in missing)


def test_lazy_imports_inside_functions_are_followed(tmp_path: Path) -> None:
    package = tmp_path / "exitplan"
    (package / "stages").mkdir(parents=True)
    (package / "__init__.py").write_text('"""Root."""\n')
    (package / "stages" / "__init__.py").write_text("")
    (package / "stages" / "demo.py").write_text("def main():\n    from exitplan.helper import value\n")
    (package / "helper.py").write_text("from .deep import x\nvalue = x\n")
    (package / "deep.py").write_text("x = 1\n")
    found = {p.as_posix() for p in closure(tmp_path, "exitplan.stages.demo")}
    assert {"exitplan/stages/demo.py", "exitplan/helper.py", "exitplan/deep.py"} <= found
    assert uncovered(tmp_path, "exitplan stage demo", ["exitplan/stages/demo.py", "exitplan/helper.py"]) == \
        ["exitplan/deep.py"]


def test_neutral_modules_exist_and_say_why() -> None:
    for path, why in NEUTRAL.items():
        assert (REPO_ROOT / path).is_file() and len(why) > 10, path
