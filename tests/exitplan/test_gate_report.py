"""gate.json through its model: the gate's report reads back equal; a bad one names the file and the problem."""

from __future__ import annotations

import json

import pytest

from exitplan.errors import ExitplanError
from exitplan.gate_report import GateReport, ScenarioReport, SuiteRecord, read_gate_report, write_gate_report


def _report(passed: bool = False) -> GateReport:
    suites = [SuiteRecord(suite="perf_db", success=True, evaluated=4),
              SuiteRecord(suite="quality", success=passed, failures=[] if passed else ["ppl +3% > 1%"], evaluated=3)]
    other = ScenarioReport(plan="data/plan/b/plan.json", plan_sha256="b" * 64, data_passed=True, suites=suites[:1])
    return GateReport(scenario="a", plan="data/plan/a/plan.json", plan_sha256="a" * 64, passed=passed,
                      suites=suites, quality=[{"model": "m", "ppl_helios": 2.5}],
                      other_scenarios={"b": other, "c": None})


def test_a_report_reads_back_equal_and_lists_its_failures(tmp_path) -> None:
    path = write_gate_report(tmp_path / "gate.json", _report())
    report = read_gate_report(path)
    assert report == _report()
    assert report.failures == ["quality: ppl +3% > 1%"] and read_gate_report(
        write_gate_report(tmp_path / "ok.json", _report(passed=True))).failures == []


@pytest.mark.parametrize(("change", "problem"), [
    ({"plan_sha256": "short"}, "plan_sha256"),
    ({"passed": "maybe"}, "passed"),
    ({"suites": [{"suite": "x"}]}, "suites.0.success"),
])
def test_a_bad_report_is_named_with_its_problem(tmp_path, change: dict, problem: str) -> None:
    path = tmp_path / "gate.json"
    path.write_text(json.dumps({**_report().model_dump(), **change}))
    with pytest.raises(ExitplanError, match="gate.json is not a gate report") as caught:
        read_gate_report(path)
    assert problem in str(caught.value) and "dvc repro gate" in str(caught.value)


def test_a_missing_report_names_the_stage(tmp_path) -> None:
    with pytest.raises(ExitplanError, match="run `dvc repro gate` first"):
        read_gate_report(tmp_path / "gate.json")
