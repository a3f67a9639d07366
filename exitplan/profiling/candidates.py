"""HELIOS step 1: rank early-exit candidates for an SLO on a device, from their exit profiles and the device's fit.

For each candidate: the shallowest exit whose expected breach rate (share of tokens not yet confident there, from
the ``exit_profile`` stage) the breach counter tolerates; the weights of the partial model at that exit (its exit
block included) against the memory budget; the batch the remaining memory holds for sequences of the workload's
mean length; and the fitted device's predicted decode step at that batch - hence the time per output token (the
SLO) and the throughput (the ranking).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict

from exitplan.atomic import write_json
from exitplan.catalog import Gpu, Model
from exitplan.files import as_model, read_json
from exitplan.simulator.cost_model import CostModel, ReplicaSpec


@dataclass(frozen=True)
class Ranked:
    """One candidate as step 1 sees it.

    Attributes:
        model: HF id.
        exit_layer: Exit the breach counter tolerates (``num_layers``: full depth).
        breach_rate: Expected share of tokens under the threshold there.
        weight_bytes: Weights of the partial model.
        batch: Largest batch of mean-length sequences that fits beside them and keeps the step within the SLO (0:
            the weights alone exceed the budget).
        tpot_ms: Predicted time per output token at that batch.
        tokens_per_s: Predicted decode throughput at that batch.
        meets_slo: Whether it fits and ``tpot_ms`` is within the SLO.
    """

    model: str
    exit_layer: int
    breach_rate: float
    weight_bytes: float
    batch: int
    tpot_ms: float
    tokens_per_s: float
    meets_slo: bool

    def as_dict(self) -> dict:
        """JSON-ready form."""
        return asdict(self)


class Selection(BaseModel):
    """``candidates.json``: what HELIOS step 1 chose (stage ``select_candidates``)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    device: str
    """The fitted device the ranking is for."""

    mean_tokens: float
    """Mean prompt + output tokens of the workload's trace."""

    slo_tpot_ms: float
    """The SLO on the time per output token."""

    candidates: list[str]
    """The chosen candidates (the Top-K that meet the SLO), best first."""

    ranked: list[Ranked]
    """Every candidate as step 1 saw it, best first."""


def write_selection(path: Path, selection: Selection) -> Path:
    """Write ``candidates.json`` atomically."""
    return write_json(path, selection.model_dump())


def read_selection(path: Path) -> Selection:
    """``candidates.json``.

    Raises:
        ExitplanError: it is missing or not a selection (naming the stage to re-run).
    """
    hint = "re-run the select_candidates stage"
    return as_model(read_json(path, "candidate selection", hint=hint), Selection, str(path), "a candidate selection",
                    hint=hint)


def exit_for(first_exits: np.ndarray, exit_layers: Sequence[int], num_layers: int,
             max_breach_rate: float) -> tuple[int, float]:
    """Shallowest exit whose share of tokens first confident deeper is at most ``max_breach_rate``."""
    for layer in sorted(exit_layers):
        rate = float(np.mean(first_exits > layer))
        if rate <= max_breach_rate:
            return layer, rate
    return num_layers, 0.0


def rank(models: Mapping[str, Model], first_exits: Mapping[str, np.ndarray], exit_layers: Mapping[str, list[int]],
         device: Gpu, step_overhead_s: float, seq_overhead_s: float, budget_bytes: float, mean_tokens: float,
         max_breach_rate: float, slo_tpot_ms: float, max_batch: int = 256) -> list[Ranked]:
    """Every candidate, best first (those meeting the SLO first, then by predicted throughput)."""
    ranked = []
    for name, model in models.items():
        layer, rate = exit_for(first_exits[name], exit_layers[name], model.num_layers, max_breach_rate)
        spec = ReplicaSpec(model, device, layers=layer)
        cost = CostModel(spec, step_overhead_s, seq_overhead_s)
        weights = model.weight_bytes(spec.effective_layers)
        fits = int(min(max_batch, max(0.0, budget_bytes - weights) // (spec.kv_bytes_per_token * mean_tokens)))
        if fits == 0:
            ranked.append(Ranked(name, layer, rate, weights, 0, float("inf"), 0.0, False))
            continue

        def step_s(batch: int, cost: CostModel = cost) -> float:
            return cost.step_time(batch, batch * mean_tokens, batch * mean_tokens, batch)

        # the largest batch that both fits the memory and keeps the step within the SLO (step time grows with it)
        batch = max((b for b in range(1, fits + 1) if step_s(b) * 1e3 <= slo_tpot_ms), default=1)
        step = step_s(batch)
        ranked.append(Ranked(name, layer, rate, weights, batch, step * 1e3, batch / step, step * 1e3 <= slo_tpot_ms))
    return sorted(ranked, key=lambda r: (not r.meets_slo, -r.tokens_per_s))
