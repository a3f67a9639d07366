"""One local-fleet session: started, smoke-tested, reported, stopped, even when the smoke request fails."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from exitplan import local_fleet
from exitplan.errors import ExitplanError


class _Fleet:
    coordinator_url = "http://127.0.0.1:8000"
    replica_urls = {"m": ["http://127.0.0.1:8100"]}

    def __init__(self) -> None:
        self.stopped = 0

    def stop(self) -> None:
        self.stopped += 1


def _params(tmp_path):
    deploy = SimpleNamespace(output_dir="out", fleet_name="fleet", api_key_env="EXITPLAN_TEST_KEY")
    return SimpleNamespace(deploy=deploy, path=lambda p: tmp_path / p)


def test_a_session_smokes_reports_and_stops(monkeypatch, tmp_path) -> None:
    fleet, seen = _Fleet(), []
    monkeypatch.setenv("EXITPLAN_TEST_KEY", "secret")
    monkeypatch.setattr(local_fleet, "start_local", lambda params, plan, router, out: fleet)
    monkeypatch.setattr(local_fleet, "smoke", lambda url, model, key: {"url": url, "model": model, "key": key})
    rendered = SimpleNamespace(plan={"models": []}, router=None)
    result = local_fleet.serve(_params(tmp_path), rendered, on_ready=lambda f, answer: seen.append((f, answer)))
    assert result["smoke"] == {"url": fleet.coordinator_url, "model": "fleet", "key": "secret"}
    assert result["local_replicas"] == fleet.replica_urls and seen == [(fleet, result["smoke"])]
    assert fleet.stopped == 1


def test_a_failed_smoke_request_still_stops_the_fleet(monkeypatch, tmp_path) -> None:
    fleet = _Fleet()
    monkeypatch.setattr(local_fleet, "start_local", lambda params, plan, router, out: fleet)

    def refuse(url, model, key):
        raise ExitplanError("the coordinator did not answer")

    monkeypatch.setattr(local_fleet, "smoke", refuse)
    with pytest.raises(ExitplanError, match="did not answer"):
        local_fleet.serve(_params(tmp_path), SimpleNamespace(plan={}, router=None), keep=True)
    assert fleet.stopped == 1
