"""Flow ``reprofile_fleet``: HELIOS step 4 on a schedule. Drifted traffic -> re-profile -> gates -> promotion.

Reads the live per-request telemetry (a serving engine's persisted file or its ``/telemetry`` URL), tests it against
the reference the PHT was profiled on, records the check (reports/reprofile/drift.json, an MLflow run
``reprofile``), and only on drift writes the window as the telemetry snapshot. The snapshot is
a DVC dependency of ``online_profile``, so the re-plan below is DVC's decision: ``dvc repro gate`` re-runs
``online_profile`` and ``gate`` when the snapshot changed and nothing when it did not (never ``--force``). A passing
gate then moves the ``champion`` alias.

Deployed with an interval schedule in ``prefect.yaml``; by hand: ``python -m flows.reprofile_fleet [telemetry]``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from prefect import flow, get_run_logger

from exitplan.pipeline import ReproResult
from tasks.pipeline import check_config, repro_stage
from tasks.reprofile import detect_drift, promote_plan, read_telemetry, record_check, write_snapshot


@dataclass
class ReprofileOutcome:
    """What one run decided.

    Attributes:
        drifted: Whether any drift test fired.
        report: The drift tests, in words.
        run_id: The MLflow run that recorded the check (None with tracking off).
        repro: The ``dvc repro`` runs (empty without drift).
        promotion: What promotion did (empty without drift).
    """

    drifted: bool
    report: str
    run_id: str | None = None
    repro: list[ReproResult] = field(default_factory=list)
    promotion: str = ""


@flow(name="reprofile_fleet", log_prints=True)
def reprofile_fleet(params_path: str = "params.yaml", telemetry: str | None = None) -> ReprofileOutcome:
    """Test live telemetry for drift; on drift, re-profile and re-gate through DVC, then promote."""
    params = check_config(Path(params_path))
    source = telemetry or params.reprofile.telemetry
    source = source if source.startswith(("http://", "https://")) else str(params.path(source))
    current = read_telemetry(source, params.reprofile.window, params.deploy.api_key_env)
    report = detect_drift(params, current)
    run_id = record_check(params, report, source)
    logger = get_run_logger()
    logger.info("drift tests on %d live vs %d reference requests:\n%s", report.current_requests,
                report.reference_requests, report.describe())
    if not report.drifted:
        print(f"re-profiling: no drift in {source}; nothing to re-plan\n{report.describe()}")
        return ReprofileOutcome(False, report.describe(), run_id)
    write_snapshot(params, current)
    runs = [repro_stage("gate", params.root)]
    promotion = promote_plan(params)
    print(f"re-profiling: drift in {source} -> ran {', '.join(runs[0].ran) or 'nothing'}; {promotion}")
    return ReprofileOutcome(True, report.describe(), run_id, runs, promotion)


if __name__ == "__main__":
    reprofile_fleet(telemetry=sys.argv[1] if len(sys.argv) > 1 else None)
