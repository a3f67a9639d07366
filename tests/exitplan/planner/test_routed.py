"""Each model read from the curves of the lengths the router sends it: the routed subsets, the rows by share, and the
planner's blend between two shares."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from exitplan.errors import ExitplanError, SimulationError
from exitplan.planner.routed import curves_at, routed_db, routed_lengths, share_curves
from exitplan.simulator.curve import LatencyCurve
from tests.exitplan.planner.conftest import make_problem

SCORES = np.array([0.9, 0.1, 0.5, 0.3, 0.7])
LENGTHS = (np.array([90, 10, 50, 30, 70]), np.array([9, 1, 5, 3, 7]))


def test_the_smallest_model_gets_the_lowest_scores_and_the_largest_the_highest() -> None:
    prompts, answers = routed_lengths(SCORES, LENGTHS, 0.4, last=False)
    assert sorted(prompts.tolist()) == [10, 30] and sorted(answers.tolist()) == [1, 3]
    assert sorted(routed_lengths(SCORES, LENGTHS, 0.4, last=True)[0].tolist()) == [70, 90]
    assert sorted(routed_lengths(SCORES, LENGTHS, 0.5, last=True)[0].tolist()) == [50, 70, 90]  # ceil(2.5)
    assert routed_lengths(SCORES, LENGTHS, 0.01, last=False)[0].tolist() == [10]  # never empty
    assert len(routed_lengths(SCORES, LENGTHS, 1.0, last=True)[0]) == 5


@pytest.mark.parametrize(("scores", "share", "match"), [
    (SCORES[:3], 0.5, "a length pair per scored query"),
    (np.array([]), 0.5, "a length pair per scored query"),
    (SCORES, 0.0, r"share must lie in \(0, 1\]"),
    (SCORES, 1.5, r"share must lie in \(0, 1\]"),
])
def test_bad_routed_inputs_are_named(scores, share, match) -> None:
    with pytest.raises(ExitplanError, match=match):
        routed_lengths(scores, LENGTHS, share, last=False)


def _rows(model: str, mean_prompt: float) -> pd.DataFrame:
    qps = [1.0, 2.0, 3.0]
    return pd.DataFrame({"model": model, "gpu": "cpu", "tp": 1, "pp": 1, "layers": 24, "qps": qps,
                         "e2e_p95_s": [mean_prompt / 10 * q for q in qps], "e2e_p99_s": [mean_prompt / 5] * 3,
                         "saturated": False, "busy_fraction": [0.1, 0.2, 0.3], "mean_batch": [1.0, 1.5, 2.0]})


def test_rows_by_share_are_simulated_on_each_end_models_routed_lengths() -> None:
    seen = []

    def simulate(own):
        seen.append({m: sorted(p.tolist()) for m, (p, _) in own.items()})
        return pd.concat([_rows(m, float(np.mean(p))) for m, (p, _) in own.items()], ignore_index=True)

    db = routed_db(SCORES, LENGTHS, ["a", "mid", "z"], [1.0, 0.4], simulate)
    assert seen == [{"a": [10, 30], "z": [70, 90]}, {"a": [10, 30, 50, 70, 90], "z": [10, 30, 50, 70, 90]}]
    assert sorted(set(db["share"])) == [0.4, 1.0] and set(db["model"]) == {"a", "z"}  # the middle model: whole mix
    curves = share_curves(db, "z", ["cpu"], "e2e_p95_s")
    assert curves[0.4][("cpu", 1, 1, 24)](2.0) == pytest.approx(80 / 10 * 2)
    assert share_curves(db, "mid", ["cpu"], "e2e_p95_s") == {} and share_curves(None, "z", ["cpu"], "x") == {}


def _curve(scale: float, points: int = 3) -> LatencyCurve:
    q = np.arange(1.0, points + 1)
    return LatencyCurve.from_points(q, scale * q, None, 0.1 * q, np.ones(points) * scale)


def test_between_two_shares_the_curves_are_blended_linearly() -> None:
    base = {"a": _curve(100.0), "b": _curve(7.0)}
    by_share = {0.2: {"a": _curve(1.0)}, 0.6: {"a": _curve(3.0, points=2)}}
    mid = curves_at(base, by_share, 0.5)
    assert mid["b"] is base["b"]  # no routed curves: as the perf DB has it
    assert mid["a"](2.0) == pytest.approx(0.25 * 2 + 0.75 * 6)
    assert mid["a"].capacity == 2.0  # the smaller capacity of the two
    assert mid["a"].batch_at(1.0) == pytest.approx(0.25 * 1 + 0.75 * 3)
    assert curves_at(base, by_share, 0.05)["a"](1.0) == pytest.approx(1.0)  # below the grid: its first share
    assert curves_at(base, by_share, 0.6)["a"](1.0) == pytest.approx(3.0)


def test_curves_of_different_load_grids_are_not_blended() -> None:
    other = LatencyCurve.from_points(np.array([1.0, 5.0]), np.array([1.0, 2.0]))
    with pytest.raises(SimulationError, match="different grids"):
        _curve(1.0).blend(other, 0.5)


def test_the_planner_reads_a_model_at_its_routed_share() -> None:
    problem = make_problem()
    key = problem.candidates["large"][0].groups[0]
    layout = (key.gpu, key.tp, key.pp, key.layers)
    base = problem.curves["large"][layout]
    faster = LatencyCurve(base.qps, base.latency / 2, base.capacity)
    routed = replace(problem, routed={"large": {0.25: {layout: faster}, 1.0: {layout: base}}}, _cache={})
    at = 0.25
    alone = [c for c in range(len(problem.candidates["large"]))
             if all((g.gpu, g.tp, g.pp, g.layers) == layout for g in problem.candidates["large"][c].groups)]
    assert alone, "a candidate of that one layout"
    c = alone[0]
    plain, read = problem.model_latency(1, c, at), routed.model_latency(1, c, at)
    assert np.isfinite(plain) and read == pytest.approx(plain / 2, rel=0.05)
    assert routed.model_latency(1, c, 1.0) == pytest.approx(problem.model_latency(1, c, 1.0))
    assert routed.curves_at(0, 0.5) is problem.curves["small"]  # the small model has none
