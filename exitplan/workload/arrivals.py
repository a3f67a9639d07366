"""Arrival processes: when each request of a trace arrives, in seconds from the start."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from exitplan.errors import WorkloadError
from exitplan.kinds import ARRIVAL_KINDS, ArrivalKind


def poisson_arrivals(n: int, qps: float, rng: np.random.Generator) -> np.ndarray:
    """``n`` arrival times of a Poisson process of rate ``qps`` (exponential gaps); shape ``n``."""
    return np.cumsum(rng.exponential(1.0 / qps, size=n))


def gamma_arrivals(n: int, qps: float, rng: np.random.Generator, burstiness: float = 1.0) -> np.ndarray:
    """Arrival times with gamma-distributed gaps of mean ``1/qps`` and shape ``burstiness`` (vLLM's convention).

    ``burstiness = 1`` is Poisson; smaller values give burstier traffic (gap CV = 1/sqrt(burstiness)).
    """
    return np.cumsum(rng.gamma(shape=burstiness, scale=1.0 / (qps * burstiness), size=n))


def burst_arrivals(n: int) -> np.ndarray:
    """Every request at t = 0 (the capacity test)."""
    return np.zeros(n)


def read_timestamps(path: Path) -> np.ndarray:
    """Arrival times from a CSV or Parquet file with an ``arrival_s`` column.

    Raises:
        WorkloadError: if the file is missing, has no ``arrival_s`` column, or holds negative or NaN times.
    """
    import pandas as pd

    from exitplan.files import read_table

    frame = read_table(path, "timestamps file", ["arrival_s"], WorkloadError)
    times = pd.to_numeric(frame["arrival_s"], errors="coerce").to_numpy(dtype=float)
    if len(times) == 0 or not np.isfinite(times).all() or (times < 0).any():
        raise WorkloadError(f"{path}: 'arrival_s' must be non-empty, finite, non-negative numbers")
    return np.sort(times)


def replay_arrivals(n: int, timestamps: np.ndarray, qps: float | None = None) -> np.ndarray:
    """The first ``n`` of the given timestamps (cycled if fewer), shifted to start at 0 and rescaled to ``qps``.

    Cycling repeats the recorded pattern after its last arrival, so a short recording can drive a long trace.
    """
    times = timestamps - timestamps[0]
    span = times[-1] + (np.mean(np.diff(times)) if len(times) > 1 else 1.0)
    reps = -(-n // len(times))
    cycled = np.concatenate([times + k * span for k in range(reps)])[:n]
    if qps is not None and len(cycled) > 1 and cycled[-1] > 0:
        cycled = cycled * ((len(cycled) - 1) / qps) / cycled[-1]
    return cycled




def _replay(n: int, qps: float, rng: np.random.Generator, burstiness: float,
            timestamps: np.ndarray | None) -> np.ndarray:
    if timestamps is None:
        raise WorkloadError("replay arrivals need timestamps")
    return replay_arrivals(n, timestamps, qps)


ArrivalFn = Callable[[int, float, np.random.Generator, float, "np.ndarray | None"], np.ndarray]
"""``(n, qps, rng, burstiness, timestamps) -> arrival times``: one signature for every arrival process."""

ARRIVALS: dict[ArrivalKind, ArrivalFn] = {
    "poisson": lambda n, qps, rng, burstiness, timestamps: poisson_arrivals(n, qps, rng),
    "gamma": lambda n, qps, rng, burstiness, timestamps: gamma_arrivals(n, qps, rng, burstiness),
    "replay": _replay,
    "burst": lambda n, qps, rng, burstiness, timestamps: burst_arrivals(n),
}
"""Arrival kind (:data:`exitplan.kinds.ArrivalKind`) -> its process."""


def make_arrivals(kind: str, n: int, qps: float, rng: np.random.Generator, burstiness: float = 1.0,
                  timestamps: np.ndarray | None = None) -> np.ndarray:
    """Arrival times of ``n`` requests for an arrival kind of :data:`exitplan.kinds.ArrivalKind`.

    Raises:
        WorkloadError: an unknown kind, or ``replay`` without timestamps.
    """
    process = ARRIVALS.get(kind)  # type: ignore[call-overload]
    if process is None:
        raise WorkloadError(f"unknown arrival kind '{kind}'; known: {', '.join(ARRIVAL_KINDS)}")
    return process(n, qps, rng, burstiness, timestamps)
