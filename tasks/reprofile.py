"""Tasks of re-profiling and promotion: read telemetry, test for drift, record the check, write the snapshot,
promote."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
from prefect import task

from exitplan.config import Params
from exitplan.profiling.drift import DriftReport

REPORT = Path("reports") / "reprofile" / "drift.json"
"""The last drift check, relative to the checkout (also each check's MLflow artifact)."""


def retry_unless_missing(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect retry condition: retry what may pass next time, not a missing input (an earlier stage must run)."""
    from exitplan.errors import MissingInput

    try:
        state.result()
    except MissingInput:
        return False
    except Exception:  # noqa: BLE001 - any other failure (a URL that did not answer) may be transient
        return True
    return True


@task(name="read-telemetry", retries=2, retry_delay_seconds=10, retry_condition_fn=retry_unless_missing)
def read_telemetry(source: str, window: int, api_key_env: str = "EXITPLAN_API_KEY") -> pd.DataFrame:
    """The live window of per-request telemetry (a file, or a running engine's URL, with the key in
    ``$api_key_env``)."""
    import os

    from exitplan.profiling.drift import read_telemetry as read

    return read(source, window, os.environ.get(api_key_env))


@task(name="detect-drift")
def detect_drift(params: Params, current: pd.DataFrame) -> DriftReport:
    """Test the live window against the reference telemetry the PHT was profiled on."""
    from exitplan.profiling.drift import detect, read_reference

    section = params.reprofile
    reference = read_reference(params.path(params.online_profile.reference_telemetry))
    return detect(reference, current, params.helios.threshold, section.alpha, section.min_effect,
                  section.min_requests)


@task(name="record-check")
def record_check(params: Params, report: DriftReport, source: str) -> str | None:
    """Write the check to reports/reprofile/drift.json and log it to MLflow (run ``reprofile``)."""
    from exitplan.profiling.drift import record_check as record

    return record(report, source, params.path(REPORT), params.tracking, params.root)


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
