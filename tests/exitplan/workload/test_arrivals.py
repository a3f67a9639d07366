from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from exitplan.errors import WorkloadError
from exitplan.workload.arrivals import make_arrivals, read_timestamps, replay_arrivals


def test_poisson_rate_and_exponential_gaps() -> None:
    times = make_arrivals("poisson", 20_000, 5.0, np.random.default_rng(0))
    gaps = np.diff(times, prepend=0.0)
    assert np.all(gaps >= 0)
    assert 20_000 / times[-1] == pytest.approx(5.0, rel=0.03)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_sets_the_gap_cv(burstiness: float) -> None:
    times = make_arrivals("gamma", 20_000, 10.0, np.random.default_rng(1), burstiness=burstiness)
    gaps = np.diff(times, prepend=0.0)
    assert np.mean(gaps) == pytest.approx(0.1, rel=0.05)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1 / np.sqrt(burstiness), rel=0.06)


def test_seeded_arrivals_repeat() -> None:
    a = make_arrivals("gamma", 100, 2.0, np.random.default_rng(7), burstiness=0.5)
    b = make_arrivals("gamma", 100, 2.0, np.random.default_rng(7), burstiness=0.5)
    assert np.array_equal(a, b)
    assert np.all(make_arrivals("burst", 10, 2.0, np.random.default_rng(0)) == 0)


def test_replay_keeps_the_pattern_and_rescales_to_qps() -> None:
    recorded = np.array([10.0, 10.5, 13.0, 14.0])
    times = replay_arrivals(4, recorded)
    assert np.allclose(times, [0.0, 0.5, 3.0, 4.0])
    scaled = replay_arrivals(4, recorded, qps=1.5)
    assert np.allclose(scaled / scaled[-1], times / times[-1])
    assert (len(scaled) - 1) / scaled[-1] == pytest.approx(1.5)
    assert len(replay_arrivals(10, recorded)) == 10 and np.all(np.diff(replay_arrivals(10, recorded)) >= 0)


def test_timestamp_files_are_checked(tmp_path: Path) -> None:
    good = tmp_path / "t.csv"
    pd.DataFrame({"arrival_s": [2.0, 1.0]}).to_csv(good, index=False)
    assert np.array_equal(read_timestamps(good), [1.0, 2.0])
    bad = tmp_path / "bad.csv"
    pd.DataFrame({"time": [1.0]}).to_csv(bad, index=False)
    with pytest.raises(WorkloadError, match="lacks columns \\['arrival_s'\\]"):
        read_timestamps(bad)
    negative = tmp_path / "neg.parquet"
    pd.DataFrame({"arrival_s": [-1.0]}).to_parquet(negative)
    with pytest.raises(WorkloadError, match="non-negative"):
        read_timestamps(negative)
    with pytest.raises(WorkloadError, match="not found"):
        read_timestamps(tmp_path / "missing.csv")
