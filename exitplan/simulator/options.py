"""The inputs of ``exitplan simulate``, checked at the edge: every number finite and in range, by name.

The command line hands its flags to :func:`check_options`; a NaN, an infinity, a zero or negative count, or a value
beyond what the simulator can run in bounded time is a :class:`~exitplan.errors.SimulationError` naming the flag,
before any work. Engine overrides are validated by :class:`~exitplan.config.EngineParams` itself (its bounds).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError

from exitplan.config import EngineParams
from exitplan.errors import SimulationError
from exitplan.kinds import SyntheticArrivalKind
from exitplan.simulator.replica import MAX_TOKENS
from exitplan.yaml_model import StrictModel, format_validation_error

MAX_REQUESTS = 1_000_000
"""Most requests one simulate run takes (a run of that size takes minutes, not hours)."""


class SimulateOptions(StrictModel):
    """What one ``exitplan simulate`` run is asked to do."""

    tp: int = Field(default=1, ge=1, le=1024)
    """Tensor-parallel degree."""

    pp: int = Field(default=1, ge=1, le=1024)
    """Pipeline-parallel degree."""

    replicas: int = Field(default=1, ge=1, le=4096)
    """Data-parallel replicas."""

    qps: float = Field(default=1.0, gt=0, le=1e6)
    """Mean arrival rate, requests per second."""

    requests: int = Field(default=1000, ge=1, le=MAX_REQUESTS)
    """Number of requests."""

    prompt_len: int = Field(default=512, ge=1, le=MAX_TOKENS)
    """Prompt tokens of every request."""

    output_len: int = Field(default=128, ge=1, le=MAX_TOKENS)
    """Output tokens of every request."""

    seed: int = Field(default=0, ge=0, le=2**63 - 1)
    """Seed of the arrival process."""

    arrival: SyntheticArrivalKind = "poisson"
    """Arrival process."""

    burstiness: float = Field(default=1.0, gt=0, le=1000)
    """Gamma shape (1 = Poisson)."""

    layers: int | None = Field(default=None, ge=1, le=10_000)
    """Layers held (a partial early-exit model)."""


def _check(model: type[StrictModel], values: dict[str, Any]) -> Any:
    """``values`` as ``model``; errors name the flags (``--max-num-seqs: ...``)."""
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        flags = []
        for line in format_validation_error(exc, model):
            key, _, problem = line.partition(":")
            flags.append(f"--{key.replace('_', '-')}:{problem}")
        raise SimulationError("; ".join(flags)) from exc


def check_options(values: dict[str, Any]) -> SimulateOptions:
    """Validate the flags of one run.

    Raises:
        SimulationError: naming every bad flag.
    """
    return _check(SimulateOptions, values)


def engine_with(engine: EngineParams, overrides: dict[str, Any]) -> EngineParams:
    """``engine`` with ``overrides`` applied and validated (a ``model_copy`` would skip validation).

    Raises:
        SimulationError: naming every bad override.
    """
    return _check(EngineParams, {**engine.model_dump(), **overrides})
