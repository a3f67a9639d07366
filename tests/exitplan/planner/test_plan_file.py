"""plan.json through its typed model: written and read back the same, bad files named, old files still read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from plan_factory import plan_of

from exitplan.artifacts import PLAN_FILE
from exitplan.errors import ExitplanError
from exitplan.planner.plan_file import parse_plan, read_plan, write_plan


def _plan():
    return plan_of([{"model": "small", "fraction": 0.7, "load_qps": 0.7, "cost_per_hour": 1.0,
                     "groups": [{"gpu": "rtx-4090", "dp": 2, "layers": 12}], "replica_weights": [0.5, 0.5]},
                    {"model": "large", "fraction": 0.3, "load_qps": 0.3, "groups": [{"gpu": "h100-sxm", "dp": 1,
                                                                                     "tp": 2}]},
                    {"model": "unused", "fraction": 0.0, "deployed": False}], [0.25, 0.75])


def test_a_plan_round_trips_byte_for_byte(tmp_path: Path) -> None:
    plan = _plan()
    first = write_plan(tmp_path / "a" / PLAN_FILE, plan).read_bytes()
    again = read_plan(tmp_path / "a" / PLAN_FILE)
    assert again == plan and write_plan(tmp_path / "b" / PLAN_FILE, again).read_bytes() == first
    assert "seconds" not in first.decode()  # no wall time: the same inputs give the same bytes


def test_what_readers_ask_of_a_plan() -> None:
    plan = _plan()
    assert [m.model for m in plan.served] == ["small", "large"] and plan.model_ids == ["small", "large", "unused"]
    small = plan.entry("small")
    assert small is not None and small.replicas == 2 and small.layers == 12
    assert plan.entry("large").layers is None and plan.entry("unused").replicas == 1  # type: ignore[union-attr]
    assert plan.entry("nothing") is None


def test_a_plan_with_depths_round_trips_with_its_quality_sources(tmp_path: Path) -> None:
    plan = _plan().model_copy(update={"plans_depth": True, "depth_agreement": {"small": {12: 0.43, 24: 1.0}}})
    plan.models[0] = plan.models[0].model_copy(update={"full_layers": 24, "quality_source": "exit_profile rule"})
    again = read_plan(write_plan(tmp_path / PLAN_FILE, plan))
    assert again == plan and again.depth_agreement == {"small": {12: 0.43, 24: 1.0}}
    small = again.entry("small")
    assert small is not None
    assert (small.layers, small.full_layers, small.quality_source) == (12, 24, "exit_profile rule")


@pytest.mark.parametrize(("text", "problem"), [
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (b"[]", "expected a JSON object"),
    (b'{"models": []}', "models"),
    (json.dumps({**_plan().model_dump(), "predicted_p95_s": "fast"}), "predicted_p95_s"),
    (json.dumps({**_plan().model_dump(), "models": [{"model": "a", "fraction": 1.5}]}), "models.0.fraction"),
    (json.dumps({**_plan().model_dump(), "models": [{"model": "a", "fraction": 1.0, "groups": [
        {"gpu": "g", "tp": 2, "pp": 1, "dp": 2, "gpus": 3}]}]}), "tp x pp x dp"),
])
def test_a_bad_plan_is_named_with_its_problem(text, problem: str) -> None:
    with pytest.raises(ExitplanError, match="plan x") as caught:
        parse_plan(text, "plan x")
    assert problem in str(caught.value)


def test_a_missing_file_names_the_stage_to_run(tmp_path: Path) -> None:
    with pytest.raises(ExitplanError, match="dvc repro plan"):
        read_plan(tmp_path / PLAN_FILE)


def test_a_plan_written_by_an_older_version_still_reads(tmp_path: Path) -> None:
    """Registered plans outlive the code: keys dropped since (wall times) are ignored, keys added since default."""
    old = {k: v for k, v in _plan().model_dump().items() if k not in ("found_by", "mobo_p95_s", "scenario")}
    old.update(seconds=12.5, mobo_seconds=9.0)
    plan = parse_plan(json.dumps(old), "old plan")
    assert plan.found_by == "" and plan.models == _plan().models
