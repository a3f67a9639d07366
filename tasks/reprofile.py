"""Tasks of re-profiling and promotion: read telemetry, test for drift, write the snapshot, promote."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from prefect import task

from exitplan.config import Params
from exitplan.profiling.drift import DriftReport


@task(name="read-telemetry", retries=2, retry_delay_seconds=10)
def read_telemetry(source: str, window: int, api_key_env: str = "EXITPLAN_API_KEY") -> pd.DataFrame:
    """The live window of per-request telemetry (a file, or a running engine's URL, with the key in
    ``$api_key_env``)."""
    import os

    from exitplan.profiling.drift import read_telemetry as read

    return read(source, window, os.environ.get(api_key_env))


@task(name="detect-drift")
def detect_drift(params: Params, current: pd.DataFrame) -> DriftReport:
    """Test the live window against the reference telemetry the PHT was profiled on."""
    from exitplan.profiling.drift import detect

    section = params.reprofile
    reference = pd.read_parquet(params.path(params.online_profile.reference_telemetry))
    return detect(reference, current, params.helios.threshold, section.alpha, section.min_effect,
                  section.min_requests)


@task(name="write-snapshot")
def write_snapshot(params: Params, current: pd.DataFrame) -> Path:
    """Write the drifted window where ``online_profile`` depends on it (atomically)."""
    from exitplan.atomic import write_parquet

    return write_parquet(params.path(params.reprofile.snapshot), current)


@task(name="promote")
def promote_plan(params: Params) -> str:
    """Gate the challenger and move ``champion`` to it (raises, naming every failure, if the gate failed)."""
    from exitplan.promotion import promote

    result = promote(params)
    return "; ".join(result.changes)
