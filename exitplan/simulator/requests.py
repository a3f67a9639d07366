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
    if qps <= 0:
        raise SimulationError(f"qps must be > 0 (got {qps})")
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
        SimulationError: if the file is missing or lacks a column of :data:`TRACE_COLUMNS`.
    """
    import pandas as pd

    if not path.is_file():
        raise SimulationError(f"trace file {path} not found")
    frame = pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path)
    missing = [c for c in TRACE_COLUMNS if c not in frame.columns]
    if missing:
        raise SimulationError(f"trace file {path} lacks columns {missing}")
    frame = frame.sort_values("arrival_s", kind="stable").head(limit)
    return RequestSet(frame["arrival_s"].to_numpy(float), frame["prompt_len"].to_numpy(np.int64),
                      frame["output_len"].to_numpy(np.int64))
