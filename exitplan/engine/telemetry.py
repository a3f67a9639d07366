"""What the engine records per step and per event, for the benchmarks, re-profiling and the API."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class StepRecord:
    """One engine step.

    Attributes:
        at_s: Engine clock at the end of the step.
        seconds: Duration of the step.
        model: Serving candidate.
        phase: ``profiling`` or ``serving``.
        exit_layer: Layer every token of the step exited after.
        batch: Sequences in the step.
        prefill_tokens: Prompt (or re-prefilled context) tokens run.
        decode_tokens: Decode tokens run.
        breaches: Tokens generated under the confidence threshold.
        memory_bytes: Weights + KV pool + layers being loaded (the engine's accounting).
        kv_blocks_used: Blocks held by sequences.
        kv_blocks_total: Blocks of the pool.
    """

    at_s: float
    seconds: float
    model: str
    phase: str
    exit_layer: int
    batch: int
    prefill_tokens: int
    decode_tokens: int
    breaches: int
    memory_bytes: int
    kv_blocks_used: int
    kv_blocks_total: int


@dataclass(frozen=True)
class Event:
    """A change of what is served: ``profile`` (a candidate profiled), ``select``, ``load_start``, ``load``,
    ``switch``, ``preempt``, ``reprofile``.

    Attributes:
        at_s: Engine clock.
        kind: Event kind.
        model: Model concerned.
        detail: Figures (costs compared, seconds measured, requests moved).
    """

    at_s: float
    kind: str
    model: str
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class Telemetry:
    """Steps and events of one engine."""

    steps: list[StepRecord] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)

    def count(self, kind: str) -> int:
        """Events of ``kind``."""
        return sum(e.kind == kind for e in self.events)

    def peak_memory(self) -> int:
        """Largest accounted memory of any step."""
        return max((s.memory_bytes for s in self.steps), default=0)

    def max_batch(self) -> int:
        """Largest batch of any step."""
        return max((s.batch for s in self.steps), default=0)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"steps": [asdict(s) for s in self.steps], "events": [asdict(e) for e in self.events]}


REQUEST_COLUMNS = ("request_id", "model", "finish_s", "prompt", "max_new_tokens", "output_tokens", "exit_layers",
                   "confidences", "breaches")
"""Columns of the per-request telemetry (what re-profiling reads; see ``exitplan.profiling.drift``)."""


def request_rows(requests: list[Any]) -> list[dict[str, Any]]:
    """Per-request telemetry of finished requests: prompt ids, exit layer and confidence of every generated token.

    Args:
        requests: Finished :class:`~exitplan.engine.request.Request` objects.
    """
    return [{"request_id": r.request_id, "model": r.model, "finish_s": float(r.finish_s or 0.0),
             "prompt": list(r.prompt), "max_new_tokens": int(r.max_new_tokens), "output_tokens": len(r.output),
             "exit_layers": list(r.exit_layers), "confidences": [float(c) for c in r.confidences],
             "breaches": int(r.breaches)} for r in requests if r.finished]
