"""``gate.json``: the gate's report, as one typed model that the gate writes and promotion, the CLI and the tests
read.

A report is for exactly one plan (its SHA-256): promotion refuses a challenger whose plan is not the one the report
checked. Wall times are not in it (they are the gate's metrics), so the same inputs give the same bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from exitplan.atomic import write_json
from exitplan.errors import ExitplanError
from exitplan.files import as_model, read_json

HINT = "re-run `dvc repro gate`"


class _Record(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class SuiteRecord(_Record):
    """One suite's result."""

    suite: str
    """What was validated (``trace:mixed-gamma``, ``perf_db``, ``quality``, ...)."""

    success: bool
    """Every expectation held."""

    failures: list[str] = Field(default_factory=list)
    """One line per failed expectation: its type, arguments and what was observed."""

    evaluated: int = Field(default=0, ge=0)
    """Expectations evaluated."""


class ScenarioReport(_Record):
    """The data suites of a scenario that is not promoted."""

    plan: str
    """Its plan file, relative to the repository."""

    plan_sha256: str
    """SHA-256 of that file."""

    data_passed: bool
    """Every data suite passed."""

    suites: list[SuiteRecord]
    """Each suite's result."""

    not_served: str | None = None
    """What the served-quality gate cannot check for its models (``None``: all run here)."""


class GateReport(_Record):
    """The gate's verdict on the promoted scenario's plan."""

    scenario: str = ""
    """The promoted scenario."""

    plan: str
    """Its plan file, relative to the repository."""

    plan_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    """SHA-256 of that file: the plan this report is for."""

    passed: bool
    """Every suite passed."""

    suites: list[SuiteRecord]
    """Each suite's result (data suites, then ``quality``)."""

    quality: list[dict[str, Any]] = Field(default_factory=list)
    """Per served model: exit layer, perplexity with HELIOS and in full, ROUGE-2 and exact match, breach rate."""

    not_served: str | None = None
    """What the served-quality gate cannot check (``None``: every deployed model runs here)."""

    other_scenarios: dict[str, ScenarioReport | None] = Field(default_factory=dict)
    """The other scenarios' data suites (``None``: the plan stage skipped it)."""

    @property
    def failures(self) -> list[str]:
        """Every failed expectation, ``suite: failure``."""
        return [f"{s.suite}: {f}" for s in self.suites for f in s.failures]


def write_gate_report(path: Path, report: GateReport) -> Path:
    """Write the report (JSON, atomically)."""
    return write_json(path, report.model_dump(mode="json"))


def read_gate_report(path: Path) -> GateReport:
    """The report at ``path``.

    Raises:
        ExitplanError: it is missing (run the gate), or not a gate report (re-run it).
    """
    if not path.is_file():
        raise ExitplanError(f"no gate report at {path}: run `dvc repro gate` first")
    return as_model(read_json(path, "gate report", hint=HINT), GateReport, str(path), "a gate report", hint=HINT)
