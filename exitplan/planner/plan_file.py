"""``plan.json``: the plan the ``plan`` stage chooses, as one typed model that every reader and writer goes through.

The stage writes it (beside its front and routing model), MLflow registers it as the model version's artifact, and
the gate, promotion, deployment, the partial checkpoints and the summary read it. Nothing reads it as a raw dict.
Wall times are not in it (they are the stage's metrics), so the same inputs give the same bytes.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from exitplan.errors import ExitplanError
from exitplan.files import as_model, parse_json


class _Record(BaseModel):
    """Base of the file's parts: keys this version does not know are ignored (a plan registered by an older
    version still deploys and rolls back), types and bounds are checked."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class GroupPlan(_Record):
    """One group of identical replicas of a model: a GPU type, its parallelism and how many."""

    gpu: str = Field(min_length=1)
    """GPU type (a catalog id)."""

    tp: int = Field(ge=1)
    """Tensor-parallel degree."""

    pp: int = Field(ge=1)
    """Pipeline-parallel degree."""

    dp: int = Field(ge=1)
    """Replicas (data-parallel ranks)."""

    gpus: int = Field(ge=1)
    """GPUs of the group: ``tp * pp * dp``."""

    layers: int | None = Field(default=None, ge=1)
    """Decoder layers each replica holds (``None``: the whole model; fewer: a partial early-exit replica)."""

    @model_validator(mode="after")
    def _gpus_add_up(self) -> GroupPlan:
        if self.gpus != self.tp * self.pp * self.dp:
            raise ValueError(f"gpus {self.gpus} is not tp x pp x dp = {self.tp * self.pp * self.dp}")
        return self


class ModelPlan(_Record):
    """One model of the plan: its share of the traffic and where it runs."""

    model: str = Field(min_length=1)
    """Model id (a catalog id)."""

    fraction: float = Field(ge=0, le=1)
    """Share of the requests routed to it."""

    load_qps: float = Field(default=0.0, ge=0)
    """Requests per second it carries."""

    deployed: bool = True
    """Whether it gets replicas (a model with a negligible share does not)."""

    cost_per_hour: float = Field(default=0.0, ge=0)
    """Dollars per hour of its GPUs."""

    groups: list[GroupPlan] = Field(default_factory=list)
    """Its replica groups."""

    replica_weights: list[float] = Field(default_factory=list)
    """Share of its load each replica takes (the min-max split), in replica order."""

    predicted_p95_s: float | None = None
    """Simulated P95 end-to-end latency of its replicas at its load."""

    predicted_p99_s: float | None = None
    """Simulated P99 end-to-end latency."""

    full_layers: int | None = Field(default=None, ge=1)
    """Layers of the whole model (its groups' ``layers`` below this: the plan cut it to an exit)."""

    quality_source: str = ""
    """Where its quality figure at its depth comes from (labels at full depth, or an exit's agreement and the
    rule that turns it into quality)."""

    @property
    def serves(self) -> bool:
        """Whether it is deployed with a positive share."""
        return self.deployed and self.fraction > 0

    @property
    def replicas(self) -> int:
        """Its replicas over all groups (at least one)."""
        return max(1, sum(g.dp for g in self.groups))

    @property
    def layers(self) -> int | None:
        """Layers its (first) group holds (``None``: the whole model)."""
        return self.groups[0].layers if self.groups else None


class Baseline(_Record):
    """A baseline plan's objectives."""

    p95_s: float
    """P95 end-to-end latency."""

    quality: float
    """Quality Q(f)."""

    cost: float
    """Dollars per hour."""


class Plan(_Record):
    """A scenario's chosen plan."""

    models: list[ModelPlan] = Field(min_length=1)
    """The scenario's models, smallest first."""

    thresholds: list[float] = Field(default_factory=list)
    """Routing-score cuts between consecutive models."""

    predicted_p95_s: float
    """Simulated P95 end-to-end latency of the worst model."""

    predicted_quality: float
    """Quality Q(f) of the fractions."""

    cost_per_hour: float = Field(ge=0)
    """Dollars per hour of every GPU of the plan."""

    load_qps: float = Field(ge=0)
    """Requests per second the plan carries."""

    budget_per_hour: float = Field(ge=0)
    """The scenario's budget."""

    scenario: str = ""
    """Scenario name."""

    slo: dict[str, float | None] = Field(default_factory=dict)
    """``max_p95_s`` and ``min_quality`` of the scenario."""

    baselines: dict[str, Baseline | None] = Field(default_factory=dict)
    """Baselines by name (``None``: none within the constraints)."""

    quality_curve: dict[str, list[float]] = Field(default_factory=dict)
    """Q(f) of the router, the oracle and random routing over the large model's fraction ``f_large``."""

    evaluations: int = Field(default=0, ge=0)
    """MOBO evaluations."""

    found_by: str = ""
    """``mobo`` or ``exhaustive``: which search found the chosen plan."""

    mobo_p95_s: float | None = None
    """P95 of MOBO's best plan under the constraints (``None``: none)."""

    plans_depth: bool = False
    """Whether the planner chose each model's depth too (``False``: full depth only)."""

    depth_agreement: dict[str, dict[int, float]] = Field(default_factory=dict)
    """Model -> exit layer -> agreement with the full model: the figures its quality by depth came from."""

    @property
    def served(self) -> list[ModelPlan]:
        """The models deployed with a positive share."""
        return [m for m in self.models if m.serves]

    @property
    def model_ids(self) -> list[str]:
        """Every model of the plan, smallest first."""
        return [m.model for m in self.models]

    def entry(self, model: str) -> ModelPlan | None:
        """The entry of ``model`` (``None``: not in the plan)."""
        return next((m for m in self.models if m.model == model), None)


def parse_plan(raw: bytes | str, where: str) -> Plan:
    """A plan from the file's text.

    Raises:
        ExitplanError: naming ``where`` and every problem when it is not JSON or not a plan.
    """
    hint = "re-run the plan stage (`dvc repro plan`)"
    return as_model(parse_json(raw, where, hint=hint), Plan, where, "a plan", hint=hint)


def read_plan(path: Path) -> Plan:
    """The plan at ``path``.

    Raises:
        ExitplanError: naming the file when it is missing, unreadable or not a plan.
    """
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ExitplanError(f"plan {path} cannot be read ({exc.strerror or exc}); run the plan stage first "
                            f"(`dvc repro plan`)") from exc
    return parse_plan(raw, f"plan {path}")


def write_plan(path: Path, plan: Plan) -> Path:
    """Write ``plan`` to ``path`` atomically."""
    from exitplan.atomic import write_json

    return write_json(path, plan.model_dump())
