"""prefect.yaml: every deployment's entrypoint is a real flow; re-profiling runs on an interval schedule."""

from __future__ import annotations

import importlib

import yaml

from exitplan import REPO_ROOT
from exitplan.config import load_params


def test_deployments_point_at_flows_and_reprofiling_is_scheduled() -> None:
    config = yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())
    by_name = {d["name"]: d for d in config["deployments"]}
    assert {"plan-fleet", "reprofile-fleet"} <= set(by_name)
    for deployment in by_name.values():
        path, name = deployment["entrypoint"].split(":")
        flow = getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), name)
        assert flow.name == name
    (schedule,) = by_name["reprofile-fleet"]["schedules"]
    params = load_params(REPO_ROOT / "params.yaml")
    assert schedule["interval"] == params.reprofile.interval_minutes * 60 and schedule["active"]
