"""The routing model a plan travels with, as JSON: embedder, models, ridge weights and score window.

JSON (never pickle): a coordinator reads this file from the plan folder, a deploy bundle or an MLflow artifact,
and a format that can run code on load must not be one a user or a crafted artifact can hand it. A pickle (the old
``router.pkl``) is refused with what to do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from exitplan.artifacts import ROUTER_FILE
from exitplan.errors import ExitplanError
from exitplan.routing.scores import EmbeddingScorer

FORMAT = "exitplan-router/1"


class RouterRecord(BaseModel):
    """The file's schema."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    format: Literal["exitplan-router/1"]
    """Format tag."""

    embedder: str = Field(min_length=1)
    """Fetched sentence embedder whose vectors the weights read."""

    models: list[str] = Field(min_length=2)
    """Models the score orders, smallest first."""

    coef: list[list[float]] = Field(min_length=2)
    """Ridge weights, one row per model."""

    intercept: list[float] = Field(min_length=2)
    """Ridge intercepts, one per model."""

    window: list[float] = Field(min_length=1)
    """Scores the plan's thresholds were cut from."""


@dataclass
class RoutingModel:
    """What a plan routes with.

    Attributes:
        embedder: Embedder id (a fetched checkpoint).
        models: Models the scores order, smallest first.
        scorer: The ridge scorer.
        window: Scores the plan's thresholds were cut from (the first recalibration window).
    """

    embedder: str
    models: list[str]
    scorer: EmbeddingScorer
    window: np.ndarray


def dump_router(routing: RoutingModel) -> bytes:
    """The routing model as the file's bytes."""
    record = RouterRecord(format=FORMAT, embedder=routing.embedder, models=list(routing.models),
                          coef=routing.scorer.coef.tolist(), intercept=routing.scorer.intercept.tolist(),
                          window=np.asarray(routing.window, float).tolist())
    return json.dumps(record.model_dump()).encode("utf-8")


def load_router(blob: bytes, where: str) -> RoutingModel:
    """Read a routing model file.

    Raises:
        ExitplanError: naming ``where`` for a pickle (refused), a file that is not the format, or weights whose shape
            does not match its models.
    """
    if blob[:1] == b"\x80":
        raise ExitplanError(f"{where} is a pickle (the old router.pkl format) and is refused: loading it could run "
                            f"code. Re-run the plan stage (`dvc repro plan`) to write {ROUTER_FILE}")
    try:
        record = RouterRecord.model_validate_json(blob)
    except ValidationError as exc:
        problem = exc.errors()[0]
        at = ".".join(str(p) for p in problem["loc"]) or "file"
        raise ExitplanError(f"{where}: not an exitplan routing model ({at}: {problem['msg']})") from None
    coef = np.asarray(record.coef, float)
    if coef.ndim != 2 or len(coef) != len(record.models) or len(record.intercept) != len(record.models):
        raise ExitplanError(f"{where}: {len(record.models)} models but weights of shape {coef.shape} and "
                            f"{len(record.intercept)} intercepts")
    scorer = EmbeddingScorer.from_weights(coef, np.asarray(record.intercept, float))
    return RoutingModel(record.embedder, record.models, scorer, np.asarray(record.window, float))
