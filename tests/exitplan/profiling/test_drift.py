"""Drift tests: quiet on two windows of the same traffic, firing on shifted confidences or exit layers."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from exitplan.errors import ExitplanError
from exitplan.profiling.drift import detect, read_telemetry


def window(n: int, seed: int, confidence: tuple[float, float] = (8.0, 2.0), exits: tuple[int, ...] = (24,),
           shares: tuple[float, ...] = (1.0,)) -> pd.DataFrame:
    """``n`` requests of 16-40 tokens: confidences ~ Beta(a, b), exit layers drawn with ``shares``."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        tokens = int(rng.integers(16, 40))
        rows.append({"request_id": f"r{i}", "output_tokens": tokens, "prompt": [1, 2, 3], "max_new_tokens": 40,
                     "confidences": rng.beta(*confidence, tokens).tolist(),
                     "exit_layers": rng.choice(exits, tokens, p=shares).tolist()})
    return pd.DataFrame(rows)


def test_two_windows_of_the_same_traffic_do_not_drift() -> None:
    quiet = [detect(window(60, 0), window(60, seed), threshold=0.8).drifted for seed in range(1, 11)]
    assert sum(quiet) <= 1  # each test at 1%: at most a rare false alarm over 10 comparisons


def test_lower_confidence_drifts_on_quality() -> None:
    report = detect(window(60, 0), window(60, 1, confidence=(4.0, 2.0)), threshold=0.8)
    fired = {t.name for t in report.tests if t.drifted}
    assert report.drifted and {"breach_rate", "confidence"} <= fired  # frames without a model column: one group


def test_a_shifted_exit_distribution_drifts() -> None:
    ref = window(60, 0, exits=(12, 24), shares=(0.5, 0.5))
    cur = window(60, 1, exits=(12, 24), shares=(0.2, 0.8))
    report = detect(ref, cur, threshold=0.8)
    test = next(t for t in report.tests if t.name == "exit_distribution")
    assert test.drifted and test.effect == pytest.approx(0.3, abs=0.05)


def test_a_significant_but_tiny_shift_is_not_drift() -> None:
    ref = window(2000, 0, exits=(12, 24), shares=(0.50, 0.50))
    cur = window(2000, 1, exits=(12, 24), shares=(0.47, 0.53))
    test = next(t for t in detect(ref, cur, threshold=0.8, min_effect=0.05).tests if t.name == "exit_distribution")
    assert test.p_value < 0.01 and not test.drifted


def test_too_few_requests_run_no_test() -> None:
    report = detect(window(60, 0), window(3, 1), threshold=0.8, min_requests=8)
    assert not report.drifted and not report.tests and "8 requests" in report.reason


def test_each_model_is_compared_with_its_own_reference() -> None:
    small = window(40, 0, confidence=(8.0, 2.0), exits=(24,)).assign(model="small")
    large = window(40, 1, confidence=(3.0, 2.0), exits=(28,)).assign(model="large")
    both = pd.concat([small, large], ignore_index=True)
    live = pd.concat([window(40, 2, confidence=(8.0, 2.0), exits=(24,)).assign(model="small"),
                      window(40, 3, confidence=(3.0, 2.0), exits=(28,)).assign(model="large")], ignore_index=True)
    assert not detect(both, live, threshold=0.8).drifted  # mixed models, same traffic: no drift
    assert detect(small, live[live["model"] == "large"].assign(model="small"), threshold=0.8).drifted
    only_new = detect(small, live[live["model"] == "large"], threshold=0.8)
    assert not only_new.tests and "no model" in only_new.reason


def test_a_frame_without_the_columns_is_refused() -> None:
    with pytest.raises(ExitplanError, match="lacks columns"):
        detect(window(10, 0).drop(columns=["confidences"]), window(10, 1), threshold=0.8)


def test_telemetry_is_read_from_a_file_keeping_the_last_window(tmp_path) -> None:
    path = tmp_path / "live.parquet"
    window(30, 0).to_parquet(path)
    frame = read_telemetry(str(path), 10)
    assert len(frame) == 10 and frame["request_id"].iloc[-1] == "r29"
    with pytest.raises(ExitplanError, match="no telemetry"):
        read_telemetry(str(tmp_path / "missing.parquet"), 10)


def test_a_missing_reference_names_the_stage_that_makes_it(tmp_path) -> None:
    from exitplan.errors import MissingInput
    from exitplan.profiling.drift import read_reference

    with pytest.raises(MissingInput, match="dvc repro online_profile"):
        read_reference(tmp_path / "reference_telemetry.parquet")
