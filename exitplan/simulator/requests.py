"""Request sets for the simulator: generated (fixed lengths, an arrival process) or read from a trace file."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from exitplan.errors import SimulationError
from exitplan.simulator.replica import RequestSet
from exitplan.workload.arrivals import make_arrivals

TRACE_COLUMNS = ("arrival_s", "prompt_len", "output_len")


def generate_requests(num_requests: int, qps: float, prompt_len: int | np.ndarray, output_len: int | np.ndarray,
                      seed: int = 0, arrival: str = "poisson", burstiness: float = 1.0) -> RequestSet:
    """``num_requests`` requests arriving at ``qps`` by the given process, with fixed or given lengths.

    Raises:
        SimulationError: for QPS <= 0 or lengths < 1.
    """
    if not (np.isfinite(qps) and qps > 0):
        raise SimulationError(f"qps must be a finite number > 0 (got {qps})")
    if not (np.isfinite(burstiness) and burstiness > 0):
        raise SimulationError(f"burstiness must be a finite number > 0 (got {burstiness})")
    if num_requests < 1:
        raise SimulationError(f"requests must be >= 1 (got {num_requests})")
    rng = np.random.default_rng(seed)
    arrivals = make_arrivals(arrival, num_requests, qps, rng, burstiness)
    prompts = np.broadcast_to(np.asarray(prompt_len, dtype=np.int64), (num_requests,)).copy()
    outputs = np.broadcast_to(np.asarray(output_len, dtype=np.int64), (num_requests,)).copy()
    return RequestSet(np.asarray(arrivals, dtype=float), prompts, outputs)


def sample_lengths(prompt_len: np.ndarray, output_len: np.ndarray, num_requests: int,
                   seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Draw ``num_requests`` (prompt, output) length pairs, with replacement, from observed pairs."""
    rng = np.random.default_rng([seed, 17])
    pick = rng.integers(len(prompt_len), size=num_requests)
    return np.asarray(prompt_len)[pick], np.asarray(output_len)[pick]


def read_trace(path: Path, limit: int | None = None) -> RequestSet:
    """A trace file (Parquet or CSV, e.g. ``data/workload/trace_<name>.parquet``) as a request set.

    Raises:
        SimulationError: naming the file if it is missing, empty, unreadable (corrupt, truncated, not UTF-8), lacks
            a column of :data:`TRACE_COLUMNS`, or holds values that are not finite numbers or whole token counts.
    """
    import pandas as pd

    from exitplan.files import read_table

    frame = read_table(path, "trace file", TRACE_COLUMNS, SimulationError)
    if frame.empty:
        raise SimulationError(f"trace file {path} has no requests")
    frame = frame.sort_values("arrival_s", kind="stable").head(limit)
    try:
        arrivals = pd.to_numeric(frame["arrival_s"], errors="raise").to_numpy(float)
        lengths = [pd.to_numeric(frame[c], errors="raise").to_numpy(float) for c in ("prompt_len", "output_len")]
    except (ValueError, TypeError) as exc:
        raise SimulationError(f"trace file {path}: a column is not numeric ({exc})") from exc
    if any(not np.all(np.isfinite(v)) or np.any(v != np.round(v)) for v in lengths):
        raise SimulationError(f"trace file {path}: prompt_len and output_len must be whole numbers of tokens")
    try:
        return RequestSet(arrivals, lengths[0].astype(np.int64), lengths[1].astype(np.int64))
    except SimulationError as exc:
        raise SimulationError(f"trace file {path}: {exc}") from exc
