"""The one exception hierarchy of exitplan.

Every error a user can cause (bad params, a bad catalog, a corrupted package part, bad workload input) is an
:class:`ExitplanError` whose message says what was wrong and how to fix it. The CLI prints these messages without a
traceback and exits non-zero.
"""

from __future__ import annotations


class ExitplanError(Exception):
    """Base class of every error exitplan raises on purpose."""


class ConfigError(ExitplanError):
    """``params.yaml`` is unreadable or does not match the typed config tree.

    Attributes:
        problems: One line per problem, each starting with the YAML key path (``a.b.0.c``).
    """

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        if len(problems) == 1:
            super().__init__(f"{source}: {problems[0]}")
        else:
            lines = "\n".join(f"  - {p}" for p in problems)
            super().__init__(f"{source}: {len(problems)} errors\n{lines}")


class CatalogError(ConfigError):
    """``model_repository/catalog.yaml`` is invalid, or a look-up names a GPU or model it does not hold."""


class FetchError(ExitplanError):
    """A package or one of its parts could not be fetched, or failed its SHA-256 check."""


class WorkloadError(ExitplanError):
    """A data set could not be read, or a request set could not be built from it."""


class PipelineError(ExitplanError):
    """A DVC stage or the orchestration around it failed."""


class SimulationError(ExitplanError):
    """A simulation cannot run as asked: the model does not fit, TP does not divide the heads, QPS <= 0, ..."""


class GateFailed(ExitplanError):
    """A challenger plan failed its promotion gates; the champion was left as it was.

    Attributes:
        failures: One line per failed expectation (suite, expectation, what was observed).
    """

    def __init__(self, what: str, failures: list[str]) -> None:
        self.failures = failures
        lines = "\n".join(f"  - {f}" for f in failures)
        super().__init__(f"{what}: {len(failures)} failed expectation(s); the champion is unchanged\n{lines}")


class LabelsNotFound(ExitplanError):
    """A scenario's models have no quality labels (an optional scenario is then skipped, naming what to supply)."""


class InfraError(ExitplanError):
    """A service of the production profile (PostgreSQL, the Prefect or MLflow server, the worker) could not be
    started, reached or stopped."""


class TrackingError(ExitplanError):
    """The MLflow tracking server in use cannot be reached."""


class MissingInput(PipelineError):
    """A file an earlier stage writes is missing: the message names the stage to run first. Retrying cannot help."""
