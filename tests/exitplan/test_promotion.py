"""Promotion and rollback move the MLflow alias as expected, in a temporary store; a failed gate moves nothing."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from exitplan import REPO_ROOT, tracking
from exitplan.config import Params, load_params
from exitplan.errors import ExitplanError, GateFailed
from exitplan.promotion import promote, rollback

MODEL = "exitplan-plan"


@pytest.fixture
def params(tmp_path: Path) -> Params:
    tree = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    tree["tracking"]["tracking_uri"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tree["catalog"] = str(REPO_ROOT / "model_repository" / "catalog.yaml")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
    return load_params(tmp_path / "params.yaml")


def challenger(params: Params, p95: float, ppl: dict[str, float] | None = None, failures: list[str] = ()) -> str:
    """Register a plan as the challenger and write its gate report; returns the version."""
    plan = {"predicted_p95_s": p95, "models": [{"model": "a", "fraction": 1.0}]}
    path = params.root / "plans" / f"{p95}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(plan))
    version = tracking.register_plan(params.tracking, params.root, "plan", path, MODEL, {}, {"p95": p95})
    quality = [{"model": m, "ppl_helios": v} for m, v in (ppl or {"a": 2.0}).items()]
    report = {"plan": str(path), "plan_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
              "passed": not failures, "quality": quality,
              "suites": [{"suite": "quality", "success": not failures, "failures": list(failures), "evaluated": 3}]}
    gate = params.path(params.gates.output_dir) / "gate.json"
    gate.parent.mkdir(parents=True, exist_ok=True)
    gate.write_text(json.dumps(report))
    return version


def champion(params: Params) -> str | None:
    found = tracking.alias_version(params.tracking, params.root, MODEL, "champion")
    return found and found["version"]


def test_a_passing_challenger_becomes_champion_with_its_lineage(params: Params) -> None:
    v1 = challenger(params, 0.5)
    dry = promote(params, dry_run=True)
    assert dry.champion_after == v1 and champion(params) is None  # a dry run changes nothing
    result = promote(params)
    assert result.champion_before is None and champion(params) == v1
    tags = tracking.alias_version(params.tracking, params.root, MODEL, "champion")["tags"]
    assert tags["gate_passed"] == "true" and "git_commit" in tags and "dvc_inputs" in tags
    assert json.loads(tags["gate_quality"]) == [{"model": "a", "ppl_helios": 2.0}]


def test_a_failed_gate_names_its_failures_and_leaves_the_champion(params: Params) -> None:
    v1 = challenger(params, 0.5)
    promote(params)
    challenger(params, 0.4, failures=["expect_column_values_to_be_between(column=ppl_increase_rel): 1 unexpected"])
    with pytest.raises(GateFailed, match="ppl_increase_rel") as caught:
        promote(params)
    assert len(caught.value.failures) == 1 and champion(params) == v1


def test_a_worse_perplexity_than_the_champions_fails(params: Params) -> None:
    v1 = challenger(params, 0.5, {"a": 2.0})
    promote(params)
    challenger(params, 0.4, {"a": 2.1})  # +5% > 1%
    with pytest.raises(GateFailed, match="vs champion"):
        promote(params)
    assert champion(params) == v1


def test_a_report_for_another_plan_does_not_promote(params: Params) -> None:
    challenger(params, 0.5)
    gate = params.path(params.gates.output_dir) / "gate.json"
    report = json.loads(gate.read_text())
    gate.write_text(json.dumps({**report, "plan_sha256": "0" * 64}))
    with pytest.raises(GateFailed, match="dvc repro gate"):
        promote(params)
    assert champion(params) is None


def test_rollback_returns_to_the_previous_champion(params: Params) -> None:
    v1 = challenger(params, 0.5)
    promote(params)
    v2 = challenger(params, 0.4)
    promote(params)
    assert champion(params) == v2
    assert rollback(params).champion_after == v1 and champion(params) == v1
    assert rollback(params, to=v2).champion_after == v2 and champion(params) == v2
    with pytest.raises(ExitplanError, match="no version 99"):
        rollback(params, to="99")


def test_promotion_without_a_challenger_or_report_is_refused(params: Params) -> None:
    with pytest.raises(ExitplanError, match="no 'challenger'"):
        promote(params)


def test_a_clone_with_pulled_outputs_registers_their_plan_and_promotes_it(params: Params) -> None:
    plan = params.path(params.plan.output_dir) / params.plan.scenarios[0].name / "plan.json"
    plan.parent.mkdir(parents=True)
    plan.write_text(json.dumps({"predicted_p95_s": 0.5, "models": [{"model": "a", "fraction": 1.0}]}))
    report = {"plan": str(plan), "plan_sha256": hashlib.sha256(plan.read_bytes()).hexdigest(), "passed": True,
              "quality": [{"model": "a", "ppl_helios": 2.0}],
              "suites": [{"suite": "quality", "success": True, "failures": [], "evaluated": 3}]}
    gate = params.path(params.gates.output_dir) / "gate.json"
    gate.parent.mkdir(parents=True)
    gate.write_text(json.dumps(report))
    result = promote(params)  # an empty store: nothing was registered here
    assert result.champion_after == "1" and champion(params) == "1"
    version = tracking.alias_version(params.tracking, params.root, MODEL, "challenger")
    assert version["tags"]["registered_from"] == "dvc_outputs"
    assert json.loads(tracking.plan_artifact(params.tracking, params.root, MODEL, "1")) == json.loads(
        plan.read_text())
