"""The reference probe: a few seconds' timing of one decoder layer of the profiled model, to tell machine drift from
model error.

A profiling stage (``profile_vllm``, ``profile_device``) fits the simulator's device to step times measured at one
moment; the machines of this kind are shared and their speed moves. The probe times the same fixed work with the same
threads right after the stage has profiled, and again whenever a prediction is checked (``exitplan calibrate``, the
fleet and engine benchmarks, before and after each measured point). The ratio of the two is the machine's drift since
profiling: what is left of a prediction's error once the device is rescaled by it (:func:`rescale`) is the
simulator's own.

The work is one decoder layer's seven projections (q, k, v, o, gate, up, down) at the model's shape and precision,
with seeded random weights: ``PREFILL_ROWS`` rows (a prefill chunk, compute-bound) and ``DECODE_ROWS`` rows (a small
decode batch, bound by reading the weights), the median of ``repeats`` runs each. These are the kernels (oneDNN
matmuls) every step of both engines spends most of its time in; attention and the engines' own overheads are not in
it (their drift is taken to follow the decode probe's).
"""

from __future__ import annotations

import statistics
import time

from pydantic import Field

from exitplan.catalog import Catalog, Model
from exitplan.kinds import Dtype
from exitplan.yaml_model import StrictModel

PREFILL_ROWS = 128
"""Rows of the prefill probe (tokens of one prefill chunk)."""

DECODE_ROWS = 8
"""Rows of the decode probe (sequences of one decode step)."""


class Probe(StrictModel):
    """One probe's timing, and what it ran, so that only like is compared with like."""

    model: str
    """Catalog name of the model whose layer shape was timed."""

    dtype: Dtype
    """Precision it ran in (the profiled replicas')."""

    threads: int = Field(ge=1)
    """Torch threads it ran on."""

    prefill_s: float = Field(gt=0)
    """Median seconds of the layer over :data:`PREFILL_ROWS` rows."""

    decode_s: float = Field(gt=0)
    """Median seconds of the layer over :data:`DECODE_ROWS` rows."""

    measured_at: float = Field(gt=0)
    """When it was taken (seconds since the epoch)."""

    def comparable(self, other: Probe) -> bool:
        """Whether ``other`` timed the same work (model, precision, threads)."""
        return (self.model, self.dtype, self.threads) == (other.model, other.dtype, other.threads)


class Drift(StrictModel):
    """How much slower the machine runs the probe now than at the reference (1.0: the same; 1.2: 20% slower)."""

    prefill: float = Field(gt=0)
    """Ratio of prefill probe times, now over reference."""

    decode: float = Field(gt=0)
    """Ratio of decode probe times, now over reference."""

    @classmethod
    def between(cls, reference: Probe, now: Probe) -> Drift:
        """The drift from ``reference`` to ``now`` (two probes of the same work)."""
        return cls(prefill=now.prefill_s / reference.prefill_s, decode=now.decode_s / reference.decode_s)

    @classmethod
    def mean(cls, drifts: list[Drift]) -> Drift:
        """The mean of several drifts (the probes before and after a measured point)."""
        return cls(prefill=statistics.fmean(d.prefill for d in drifts),
                   decode=statistics.fmean(d.decode for d in drifts))

    @property
    def worst(self) -> float:
        """The larger departure from 1 of the two ratios, signed (``0.12``: 12% slower; ``-0.05``: 5% faster)."""
        return max(self.prefill - 1, self.decode - 1, key=abs)


def run_probe(model: Model, dtype: Dtype, repeats: int, threads: int = 1) -> Probe:
    """Time one decoder layer of ``model`` in ``dtype`` here, on ``threads`` torch threads (this process's count is
    restored after).

    Args:
        model: The catalog entry whose shape is timed.
        dtype: The precision (as the profiled replicas ran; resolve it with :mod:`exitplan.cpu_features` first).
        repeats: Timed runs of each kind (median taken), after one warm-up.
        threads: Torch threads (as many as one profiled replica had).
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        timings = _timings(model, dtype, repeats)
    finally:
        torch.set_num_threads(before)
    return Probe(model=model.name, dtype=dtype, threads=threads, prefill_s=timings[PREFILL_ROWS],
                 decode_s=timings[DECODE_ROWS], measured_at=time.time())


def _timings(model: Model, dtype: Dtype, repeats: int) -> dict[int, float]:
    """Median seconds of the layer at :data:`PREFILL_ROWS` and :data:`DECODE_ROWS` rows."""
    import torch

    generator = torch.Generator().manual_seed(0)
    hidden, kv = model.hidden_size, model.num_kv_heads * (model.hidden_size // model.num_attention_heads)
    dt = getattr(torch, dtype)

    def weight(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=generator).to(dt)

    wq, wk, wv, wo = weight(hidden, hidden), weight(kv, hidden), weight(kv, hidden), weight(hidden, hidden)
    wg, wu, wd = weight(model.intermediate_size, hidden), weight(model.intermediate_size, hidden), \
        weight(hidden, model.intermediate_size)

    def layer(rows: int) -> float:
        x = torch.randn(rows, hidden, generator=generator).to(dt)
        began = time.perf_counter()
        with torch.inference_mode():
            q, _, _ = x @ wq.T, x @ wk.T, x @ wv.T
            h = q @ wo.T
            (h @ wg.T * (h @ wu.T)) @ wd.T
        return time.perf_counter() - began

    timings = {}
    for rows in (PREFILL_ROWS, DECODE_ROWS):
        layer(rows)
        timings[rows] = statistics.median(layer(rows) for _ in range(repeats))
    return timings


def reference_model(catalog: Catalog, names: list[str]) -> Model:
    """The model whose layer a profiling stage probes: the widest of those it profiled (``names``)."""
    return max((catalog.llm(n) for n in names), key=lambda m: (m.hidden_size * m.intermediate_size, m.name))
