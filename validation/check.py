"""Running a suite on a frame: one ephemeral Great Expectations context per process, results as plain data."""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, field
from functools import cache
from typing import Any

import pandas as pd


@dataclass(frozen=True)
class SuiteResult:
    """One suite on one frame.

    Attributes:
        suite: Suite name (what was validated, e.g. ``trace:mixed-gamma``).
        success: Every expectation held.
        failures: One line per failed expectation: its type, its arguments and what was observed.
        evaluated: Expectations evaluated.
    """

    suite: str
    success: bool
    failures: list[str] = field(default_factory=list)
    evaluated: int = 0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


@cache
def _context() -> Any:
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    logging.getLogger("great_expectations").setLevel(logging.ERROR)
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False, metric_calculations=False)
    return context


def _describe(result: Any) -> str:
    config = result.expectation_config
    args = {k: v for k, v in config.kwargs.items() if k not in ("batch_id", "result_format") and v is not None}
    got = result.result or {}
    examples = got.get("partial_unexpected_list")
    seen = (f"observed {got['observed_value']}" if "observed_value" in got else
            f"{got.get('unexpected_count', '?')} unexpected of {got.get('element_count', '?')}"
            f"{', e.g. ' + str(examples[:3]) if examples else ''}")
    info = result.exception_info or {}
    raised = [info] if "raised_exception" in info else [v for v in info.values() if isinstance(v, dict)]
    messages = sorted({i.get("exception_message", "") for i in raised if i.get("raised_exception")})
    if messages:
        seen = "; ".join(m.splitlines()[0] for m in messages)
    return f"{config.type}({', '.join(f'{k}={v}' for k, v in args.items())}): {seen}"


def validate(suite: str, frame: pd.DataFrame, expectations: list[Any]) -> SuiteResult:
    """Validate ``frame`` against ``expectations`` (a whole-frame batch of an ephemeral pandas source).

    Args:
        suite: Name of the suite (and of what it validates).
        frame: The data.
        expectations: Great Expectations expectation objects (see :mod:`validation.suites`).
    """
    import great_expectations as gx

    context = _context()
    name = f"{suite}-{len(context.suites.all())}"
    asset = context.data_sources.add_pandas(name).add_dataframe_asset(name)
    batch = asset.add_batch_definition_whole_dataframe(name)
    gx_suite = context.suites.add(gx.ExpectationSuite(name=name))
    for expectation in expectations:
        gx_suite.add_expectation(expectation)
    definition = context.validation_definitions.add(gx.ValidationDefinition(name=name, data=batch, suite=gx_suite))
    result = definition.run(batch_parameters={"dataframe": frame}, result_format="SUMMARY")
    failures = [_describe(r) for r in result.results if not r.success]
    return SuiteResult(suite, bool(result.success), failures, len(result.results))
