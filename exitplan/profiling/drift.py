"""Drift of live traffic against the profiled reference: HELIOS step 4's trigger, as statistical tests.

Both windows are per-request telemetry frames (``exitplan.engine.telemetry.REQUEST_COLUMNS``): each generated
token's exit layer and confidence. Three two-sample tests, each at level ``alpha`` and each needing an effect of at
least ``min_effect`` besides significance (a large window makes a tiny shift significant; a shift of a few points is
not worth a re-plan):

- exit distribution: chi-square test of homogeneity on token counts per exit layer; effect = total-variation
  distance of the two distributions;
- breach rate (quality): Mann-Whitney U on the per-request share of tokens under the confidence threshold; effect =
  shift of the mean share;
- confidence (quality): two-sample Kolmogorov-Smirnov on the per-request mean confidence; effect = shift of the mean.

Requests, not tokens, are the unit of the quality tests: tokens of one request are correlated, and counting them as
independent would make every window look drifted.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from exitplan.config import TrackingParams
from exitplan.errors import ExitplanError, MissingInput

REQUIRED = ("request_id", "exit_layers", "confidences", "output_tokens")
"""Columns the tests read."""


@dataclass(frozen=True)
class DriftTest:
    """One test's outcome.

    Attributes:
        name: ``exit_distribution``, ``breach_rate`` or ``confidence``.
        statistic: The test statistic.
        p_value: Its p-value.
        effect: The effect size (see the module docstring).
        drifted: ``p_value < alpha`` and ``effect >= min_effect``.
    """

    name: str
    statistic: float
    p_value: float
    effect: float
    drifted: bool


@dataclass(frozen=True)
class DriftReport:
    """All tests of one comparison.

    Attributes:
        reference_requests: Requests in the reference window.
        current_requests: Requests in the current window.
        tests: Each test (empty when a window was too small to test).
        reason: Why no test ran, if none did.
    """

    reference_requests: int
    current_requests: int
    tests: list[DriftTest] = field(default_factory=list)
    reason: str = ""

    @property
    def drifted(self) -> bool:
        """Whether any test found drift."""
        return any(t.drifted for t in self.tests)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {**asdict(self), "drifted": self.drifted}

    def describe(self) -> str:
        """One line per test."""
        if not self.tests:
            return f"no drift test: {self.reason}"
        lines = [f"{t.name}: statistic {t.statistic:.3f}, p {t.p_value:.3g}, effect {t.effect:.3f}"
                 f"{' -> DRIFT' if t.drifted else ''}" for t in self.tests]
        return "\n".join(lines)


def _check(frame: pd.DataFrame, which: str) -> pd.DataFrame:
    missing = [c for c in REQUIRED if c not in frame.columns]
    if missing:
        raise ExitplanError(f"{which} telemetry lacks columns {missing} (has {list(frame.columns)})")
    return frame[frame["output_tokens"] > 0]


def breach_shares(frame: pd.DataFrame, threshold: float) -> np.ndarray:
    """Per request: share of its generated tokens whose confidence was under ``threshold``."""
    return np.array([float(np.mean(np.asarray(c, float) < threshold)) for c in frame["confidences"]])


def mean_confidences(frame: pd.DataFrame) -> np.ndarray:
    """Per request: mean confidence of its generated tokens."""
    return np.array([float(np.mean(np.asarray(c, float))) for c in frame["confidences"]])


def _exit_test(reference: pd.DataFrame, current: pd.DataFrame, alpha: float, min_effect: float) -> DriftTest:
    from scipy.stats import chi2_contingency

    ref = pd.Series(np.concatenate([np.asarray(x, int) for x in reference["exit_layers"]])).value_counts()
    cur = pd.Series(np.concatenate([np.asarray(x, int) for x in current["exit_layers"]])).value_counts()
    table = pd.concat([ref, cur], axis=1).fillna(0).to_numpy().T
    effect = 0.5 * float(np.abs(table[0] / table[0].sum() - table[1] / table[1].sum()).sum())
    if table.shape[1] < 2:  # every token of both windows exited at one layer: nothing to test
        return DriftTest("exit_distribution", 0.0, 1.0, effect, False)
    statistic, p_value, _, _ = chi2_contingency(table)
    return DriftTest("exit_distribution", float(statistic), float(p_value), effect,
                     bool(p_value < alpha and effect >= min_effect))


def _sample_test(name: str, ref: np.ndarray, cur: np.ndarray, alpha: float, min_effect: float) -> DriftTest:
    from scipy.stats import ks_2samp, mannwhitneyu

    effect = abs(float(cur.mean() - ref.mean()))
    if np.ptp(np.concatenate([ref, cur])) == 0:  # identical constant samples
        return DriftTest(name, 0.0, 1.0, effect, False)
    if name == "breach_rate":
        statistic, p_value = mannwhitneyu(ref, cur, alternative="two-sided")
    else:
        statistic, p_value = ks_2samp(ref, cur)
    return DriftTest(name, float(statistic), float(p_value), effect, bool(p_value < alpha and effect >= min_effect))


def _tests(reference: pd.DataFrame, current: pd.DataFrame, threshold: float, alpha: float, min_effect: float,
           prefix: str) -> list[DriftTest]:
    tests = [_exit_test(reference, current, alpha, min_effect),
             _sample_test("breach_rate", breach_shares(reference, threshold), breach_shares(current, threshold),
                          alpha, min_effect),
             _sample_test("confidence", mean_confidences(reference), mean_confidences(current), alpha, min_effect)]
    return [DriftTest(f"{prefix}{t.name}", t.statistic, t.p_value, t.effect, t.drifted) for t in tests]


def detect(reference: pd.DataFrame, current: pd.DataFrame, threshold: float, alpha: float = 0.01,
           min_effect: float = 0.05, min_requests: int = 8) -> DriftReport:
    """Compare the current window of per-request telemetry with the reference, model by model.

    Each model's live requests are compared with its own reference (a small and a large model differ in depth and
    confidence without any drift); models without enough requests on either side are not tested.

    Args:
        reference: Telemetry the PHT was profiled on.
        current: Recent live telemetry.
        threshold: Confidence under which a token is a breach (``helios.threshold``).
        alpha: Significance level of each test.
        min_effect: Smallest effect that counts as drift.
        min_requests: Fewer requests with output than this for a model on either side: no test for it.

    Raises:
        ExitplanError: when a frame lacks a column the tests read.
    """
    reference, current = _check(reference, "reference"), _check(current, "current")
    sizes = (len(reference), len(current))
    by_model = "model" in reference.columns and "model" in current.columns
    groups = ([(f"{m}: ", reference[reference["model"] == m], current[current["model"] == m])
               for m in dict.fromkeys(reference["model"]) if m in set(current["model"])]
              if by_model else [("", reference, current)])
    tests = [t for prefix, ref, cur in groups if min(len(ref), len(cur)) >= min_requests
             for t in _tests(ref, cur, threshold, alpha, min_effect, prefix)]
    if not tests:
        return DriftReport(*sizes, reason=f"no model has {min_requests} requests with output in both windows "
                                          f"(reference {sizes[0]}, current {sizes[1]})")
    return DriftReport(*sizes, tests=tests)


def read_reference(path: Path) -> pd.DataFrame:
    """The reference telemetry the PHT was profiled on (``online_profile``'s output).

    Raises:
        MissingInput: if ``online_profile`` has not run (naming the command that makes it).
    """
    from exitplan.files import read_table

    if not path.is_file():
        raise MissingInput(f"no reference telemetry at {path}: it is online_profile's output; run "
                           f"`dvc repro online_profile` (or `make run`) first")
    return read_table(path, "reference telemetry")


def record_check(report: DriftReport, source: str, out: Path, tracking: TrackingParams, root: Path) -> str | None:
    """Write one drift check to ``out`` (JSON, atomically) and log it as an MLflow run ``reprofile`` with the file
    as its artifact: the history of every scheduled check, drifted or not.

    Returns:
        The MLflow run id (None with tracking off).
    """
    from exitplan.atomic import write_json
    from exitplan.tracking import log_stage_run

    write_json(out, {**report.as_dict(), "source": source})
    metrics = {"drifted": float(report.drifted), "current_requests": report.current_requests,
               "reference_requests": report.reference_requests,
               **{f"p_value.{t.name}": t.p_value for t in report.tests},
               **{f"effect.{t.name}": t.effect for t in report.tests}}
    return log_stage_run("reprofile", tracking, root, {"source": source}, metrics, [out])


def read_telemetry(source: str, window: int, api_key: str | None = None) -> pd.DataFrame:
    """The last ``window`` requests of per-request telemetry from a Parquet file or a running engine's URL.

    Args:
        source: A path or glob (several engines' files are joined), or an ``http(s)://`` URL answering JSON rows
            (the API server's ``/telemetry``, asked for the prompt token ids a snapshot needs).
        window: Most recent requests kept.
        api_key: Bearer token of the engine server (its ``/telemetry`` needs it when the server has one).

    Raises:
        ExitplanError: when the file is missing or the URL does not answer.
    """
    from exitplan.files import parse_json, read_table

    if source.startswith(("http://", "https://")):
        import urllib.request

        url = source if "include_prompts" in source else f"{source}{'&' if '?' in source else '?'}include_prompts=true"
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as reply:
                raw = reply.read()
        except OSError as exc:
            raise ExitplanError(f"telemetry URL {source} did not answer: {exc}") from exc
        try:
            frame = pd.DataFrame(parse_json(raw, f"telemetry from {source}"))
        except ValueError as exc:  # JSON, but not rows
            raise ExitplanError(f"telemetry URL {source} did not answer JSON rows: {exc}") from exc
    else:
        import glob

        paths = sorted(glob.glob(source))
        if not paths:
            raise MissingInput(f"no telemetry at {source}: point reprofile.telemetry at a serving engine's "
                               f"persisted telemetry (a glob joins several) or its /telemetry URL, or serve "
                               f"traffic first (`exitplan deploy --keep` writes data/telemetry/live-*.parquet)")
        frame = pd.concat([read_table(Path(p), "telemetry") for p in paths], ignore_index=True)
        if "finish_s" in frame.columns and len(paths) > 1:
            frame = frame.sort_values("finish_s", kind="stable")
    return frame.tail(window).reset_index(drop=True)
