"""Stage plan: a ``traffic: workload`` scenario's window is the workload's scores, and its end models are simulated on
the lengths they are routed."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from exitplan.routing.trainer import TrainedRouter
from exitplan.stages import plan as stage


@pytest.fixture
def params(params):
    """The stage tests' parameters, with a small workload sample and two routed shares."""
    return params.model_copy(update={
        "plan": params.plan.model_copy(update={"workload_sample": 4, "routed_shares": [0.5, 1.0]})})


class _LengthScorer:
    """Scores a prompt by its first embedding coordinate."""

    def score(self, vectors: np.ndarray) -> np.ndarray:
        return vectors[:, 0]


def _router() -> TrainedRouter:
    return TrainedRouter(scorer=_LengthScorer(), quality=lambda f: 0.0, grid=np.zeros((0, 2)), values=np.zeros(0),
                         oracle=np.zeros(0), random=np.zeros(0), window=np.array([0.0, 1.0]), train=1, held_out=1)


def test_the_window_is_a_sample_of_the_servable_workload(params, tmp_path, monkeypatch) -> None:
    pd.DataFrame({"prompt": [f"p{n}" for n in (30, 2000, 400, 10, 700, 80)],
                  "prompt_len": [30, 2000, 400, 10, 700, 80], "output_len": [10, 5, 500, 3, 0, 7]}
                 ).to_parquet(tmp_path / "queries.parquet")
    monkeypatch.setattr("exitplan.routing.scores.embed",
                        lambda _path, texts: np.array([[float(t[1:]), 0.0] for t in texts]))
    routing = stage.workload_window(params, _router())
    assert len(routing.window) == 4 and len(routing.window_lengths) == 4
    assert routing.window.tolist() == routing.window_lengths[:, 0].tolist()  # each score beside its own lengths
    assert 2000 not in routing.window_lengths[:, 0]  # 2000 + 64 does not fit 1000 tokens
    assert routing.window_lengths[:, 1].max() <= 64 and routing.window_lengths[:, 1].min() >= 1
    again = stage.workload_window(params, _router())
    assert again.window.tolist() == routing.window.tolist()  # seeded by plan.seed


def test_routed_rows_only_for_a_workload_window_on_the_vllm_device(params, monkeypatch) -> None:
    scenario = next(s for s in params.plan.scenarios if s.name == "qwen-local")
    device = SimpleNamespace(gpu=SimpleNamespace(id="vllm-cpu"))
    monkeypatch.setattr("exitplan.vllm.simulate.read_vllm_device", lambda _path: device)
    calls = []

    def rows(_params, own, partial, _dask):
        calls.append(({m: sorted(p.tolist()) for m, (p, _) in own.items()}, partial))
        return pd.DataFrame({"model": list(own), "qps": 1.0})

    monkeypatch.setattr("exitplan.stages.build_perf_db.vllm_rows", rows)
    assert stage.routed_perf(params, scenario, _router()) is None  # labelled: lengths unknown
    routing = TrainedRouter(**{**vars(_router()), "window": np.array([0.3, 0.1, 0.9, 0.5]),
                               "window_lengths": np.array([[30, 3], [10, 1], [90, 9], [50, 5]])})
    db = stage.routed_perf(params, scenario, routing)
    small, large = scenario.models
    assert calls[0] == ({small: [10, 30], large: [50, 90]}, False)
    assert sorted(set(db["share"])) == [0.5, 1.0]
    elsewhere = scenario.model_copy(update={"gpus": {"h100-sxm": 2}})
    assert stage.routed_perf(params, elsewhere, routing) is None
