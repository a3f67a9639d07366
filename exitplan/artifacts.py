"""Where the pipeline's artifacts lie: one function per artifact, for the stage that writes it and every reader.

The folders are params (each stage's ``output_dir``); the file names inside them are fixed here, so no module
rebuilds a path from a string literal. The formats have typed models elsewhere (:mod:`exitplan.planner.plan_file`,
:mod:`exitplan.routing.router_file`, ...); this module imports nothing heavy, so anything can use it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from exitplan.config import Params

PLAN_FILE = "plan.json"
"""A scenario's plan (:class:`exitplan.planner.plan_file.Plan`), in ``plan.output_dir/<scenario>/`` and in the
MLflow model version."""

ROUTER_FILE = "router.json"
"""The routing model a plan's thresholds belong to (:mod:`exitplan.routing.router_file`), next to the plan and in
the MLflow model version."""

DEVICE_FILE = "device.yaml"
"""A fitted device (:class:`exitplan.profiling.device_file.DeviceProfile`), in a profiling stage's output folder."""

QUERIES_FILE = "queries.parquet"
"""The labelled-query table (``prepare_workload``; ``import_labels`` writes one of the same shape)."""

LABELS_FILE = "labels.parquet"
"""Per-query quality labels (``label_quality``, ``import_labels``)."""

LENGTHS_FILE = "lengths.parquet"
"""Each imported model's real answer lengths (``import_labels``)."""

PERF_DB_FILE = "perf_db.parquet"
"""The simulator's performance database (``build_perf_db``)."""

EXIT_PROFILE_FILE = "profile.parquet"
"""Per token: model, data set, first confident exit per threshold (``exit_profile``)."""

EXIT_CURVES_FILE = "curves.parquet"
"""Per model, head kind, data set and exit: agreement with the final layer and perplexity (``exit_profile``)."""

GATE_FILE = "gate.json"
"""The gate's report: every suite and its verdict (``gate``)."""

TELEMETRY_FILE = "telemetry.parquet"
"""The HELIOS engine's per-request telemetry while the gate served (``gate``)."""


def queries_path(params: Params) -> Path:
    """The workload's labelled queries, written by ``prepare_workload``."""
    return params.path(params.prepare_workload.output_dir) / QUERIES_FILE


def labels_path(params: Params) -> Path:
    """The Qwen pair's per-query quality labels, written by ``label_quality``."""
    return params.path(params.label_quality.output_dir) / LABELS_FILE


def imported_path(params: Params, file: str) -> Path:
    """A table of ``import_labels`` (:data:`QUERIES_FILE`, :data:`LABELS_FILE` or :data:`LENGTHS_FILE`)."""
    return params.path(params.import_labels.output_dir) / file


def perf_db_path(params: Params) -> Path:
    """The perf DB, written by ``build_perf_db``."""
    return params.path(params.build_perf_db.output_dir) / PERF_DB_FILE


def engine_device_path(params: Params) -> Path:
    """The device of our engine on this machine, fitted by ``profile_device``."""
    return params.path(params.profile_device.output_dir) / DEVICE_FILE


def vllm_device_path(params: Params) -> Path:
    """The device of vLLM on this machine, fitted by ``profile_vllm``."""
    return params.path(params.profile_vllm.output_dir) / DEVICE_FILE


def calibration_path(params: Params, stage: str) -> Path:
    """The calibration of the device ``stage`` fitted (``exitplan calibrate``)."""
    return params.path(params.calibrate.output_dir) / f"{stage}.yaml"


def exit_profile_path(params: Params) -> Path:
    """The per-token exit profile, written by ``exit_profile``."""
    return params.path(params.exit_profile.output_dir) / EXIT_PROFILE_FILE


def exit_curves_path(params: Params) -> Path:
    """The exit profile's agreement-by-depth table, written by ``exit_profile`` (the plan's quality by depth)."""
    return params.path(params.exit_profile.output_dir) / EXIT_CURVES_FILE


def plan_dir(params: Params, scenario: str) -> Path:
    """The folder of ``scenario``'s plan, router and front, written by ``plan``."""
    return params.path(params.plan.output_dir) / scenario


def plan_path(params: Params, scenario: str) -> Path:
    """``scenario``'s plan file."""
    return plan_dir(params, scenario) / PLAN_FILE


def router_path(params: Params, scenario: str) -> Path:
    """``scenario``'s routing model (the one its thresholds belong to)."""
    return plan_dir(params, scenario) / ROUTER_FILE


def gate_path(params: Params) -> Path:
    """The gate's report, written by ``gate``."""
    return params.path(params.gates.output_dir) / GATE_FILE


def telemetry_path(params: Params) -> Path:
    """The engine's telemetry from the gate's serving run."""
    return params.path(params.gates.output_dir) / TELEMETRY_FILE
