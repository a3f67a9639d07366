"""Step times of the local device, measured with the engine's own runner, and the simulator's device fitted to them.

HELIOS profiles candidates on the hardware that will serve them; BOUTE's simulator needs a device's effective
compute and memory bandwidth. :func:`measure` times decode steps (over batch sizes and context lengths) and prefill
passes (over prompt lengths) of a model on this machine through :class:`~exitplan.earlyexit.runner.PagedRunner` -
the exact code path of the serving engine. Only shapes matter for the time, so the cached context is not computed:
the KV slots of the context are taken as they are. :func:`fit_device` then fits the simulator's roofline cost model
(effective FLOP/s, bytes/s, and per-step / per-sequence overheads) to those times, giving a catalog ``Gpu`` entry for
this device that the simulator can model like any other.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from exitplan.catalog import Efficiency, Gpu, Link, Model
from exitplan.simulator.cost_model import CostModel, ReplicaSpec


def measure(model: Any, batch_sizes: Sequence[int], contexts: Sequence[int], prefill_lengths: Sequence[int],
            repeats: int = 3, layers: Sequence[int] | None = None, block_size: int = 16) -> list[dict[str, Any]]:
    """Median seconds of decode steps and prefill passes of ``model`` (an EarlyExitLM) on this device.

    Args:
        model: The model (holding at least ``max(layers)`` layers).
        batch_sizes: Decode batch sizes.
        contexts: Cached context per sequence for decode steps.
        prefill_lengths: Prompt lengths of single-sequence prefill passes.
        repeats: Timed repetitions per point (after one warm-up).
        layers: Depths to run (all held layers by default).
        block_size: KV block size.

    Returns:
        One row per point: ``kind`` (decode/prefill), ``layers``, ``batch``, ``context``, ``new_tokens``,
        ``seconds``.
    """
    import torch

    from exitplan.earlyexit.kv_pool import KVPool
    from exitplan.earlyexit.runner import PagedRunner, Work, kv_shape

    depths = list(layers) if layers else [model.held_layers]
    longest = max([*contexts, *prefill_lengths]) + repeats + 2
    blocks_per_seq = -(-longest // block_size)
    pool = KVPool(kv_shape(model), max(depths), blocks_per_seq * max(batch_sizes), block_size)
    runner = PagedRunner(model, pool)
    rows = []

    def timed(works_of: Any, depth: int) -> float:
        times = []
        for r in range(repeats + 1):
            works = works_of(r)
            started = time.perf_counter()
            with torch.no_grad():
                runner.forward(works, depth)
            times.append(time.perf_counter() - started)
        return statistics.median(times[1:])

    for depth in depths:
        for batch in batch_sizes:
            for context in contexts:
                held = [pool.allocate(blocks_per_seq) for _ in range(batch)]
                seconds = timed(lambda r, held=held, c=context: [Work.span([1], c + r, b) for b in held], depth)
                rows.append({"kind": "decode", "layers": depth, "batch": batch, "context": context,
                             "new_tokens": batch, "seconds": seconds})
                for b in held:
                    pool.release(b)
        for length in prefill_lengths:
            blocks = pool.allocate(blocks_per_seq)
            seconds = timed(lambda r, blocks=blocks, n=length: [Work.span([1] * n, 0, blocks)], depth)
            rows.append({"kind": "prefill", "layers": depth, "batch": 1, "context": 0, "new_tokens": length,
                         "seconds": seconds})
            pool.release(blocks)
    return rows


def device_entry(device_id: str, flops_per_s: float, bytes_per_s: float, memory_gib: float,
                 price_per_hour: float, source: str, memory_scale: dict[int, float] | None = None,
                 overlap: bool = True, attention: float = 1.0, kv_memory: float = 1.0,
                 model_compute: dict[str, float] | None = None) -> Gpu:
    """A catalog GPU entry for a fitted device (its peaks are the effective values: efficiency 1; the bandwidth is
    that of the largest decode batch measured, ``memory_scale`` gives it at smaller ones; ``overlap``: whether a
    step costs the larger of compute and memory time or their sum; ``attention`` and ``kv_memory``: the rates of
    attention pairs and KV reads relative to the GEMMs' and the weights', :class:`~exitplan.catalog.Efficiency`;
    ``model_compute``: each model's compute multiplier, :attr:`~exitplan.catalog.Gpu.model_compute`)."""
    efficiency = Efficiency(compute=1.0, memory=1.0, link=1.0, source=source, memory_scale=memory_scale,
                            overlap=overlap, attention=attention, kv_memory=kv_memory)
    return Gpu(id=device_id, name=f"local device ({device_id})", bf16_tflops=flops_per_s / 1e12,
               hbm_bandwidth_gbps=bytes_per_s / 1e9, memory_gib=memory_gib,
               link=Link(kind="pcie", bandwidth_gbps=1.0, latency_us=10.0), gpus_per_node=1,
               price_per_hour=price_per_hour, efficiency=efficiency, model_compute=model_compute or {})


class Overheads(NamedTuple):
    """An engine's fitted costs beyond the roofline (seconds)."""

    step_s: float
    """Per iteration."""

    seq_s: float
    """Per sequence that samples in an iteration."""

    prompt_s: float = 0.0
    """Per request, in the iteration that starts its prompt."""


def _predict(row: dict[str, Any], cost: CostModel) -> float:
    if row["kind"] == "decode":
        b, c = row["batch"], row["context"]
        return cost.step_time(b, b * (c + 1), b * c, b)
    return cost.prefill_time(np.asarray([row["new_tokens"]]), np.zeros(1))


def predict(rows: Sequence[dict[str, Any]], model: Model, device: Gpu, overheads: Overheads,
            exit_head_layers: int = 0) -> np.ndarray:
    """The cost model's seconds for each measured point (``rows`` as :func:`measure` returns them)."""
    out = []
    for row in rows:
        spec = ReplicaSpec(model, device, layers=row["layers"], exit_head_layers=exit_head_layers)
        out.append(_predict(row, CostModel(spec, *overheads)))
    return np.asarray(out)


def fit_device(rows: Sequence[dict[str, Any]], models: dict[str, Model], device_id: str, memory_gib: float,
               price_per_hour: float) -> tuple[Gpu, Overheads, dict[str, float]]:
    """Fit the cost model to measured step times (all models), in both of its forms, and keep the better fit.

    The forms: the roofline (a step costs the larger of compute and memory time; effective FLOP/s, bytes/s, per-step
    and per-sequence overheads, and the bandwidth multiplier at each smaller decode batch,
    ``Efficiency.memory_scale``, the largest batch measured being 1), and the sum (compute and memory time added, as
    a CPU core that streams the weights through its own FMA units does; the same numbers and multipliers: on an
    AVX512-BF16 core a batch-1 decode step streams the weights at 0.58x a batch-16 step's rate, measured by
    ``profile_vllm``, and without the multipliers the sum's max error there was 23% against 15%).
    Both forms also fit the rates of attention pairs and KV reads (``Efficiency.attention``, ``kv_memory``, at most
    those of the GEMMs and the weight streams; short contexts and prompts alone leave them at 1, as on our engine) and,
    with two or more models, each model's compute multiplier (``Gpu.model_compute``, geometric mean 1).
    The better is the one with the smaller root-mean-square log error.

    Args:
        rows: Measured points, each with a ``model`` key naming an entry of ``models``.
        models: Catalog models (with the ``dtype_bytes`` they ran in).
        device_id: Id of the fitted device entry.
        memory_gib: Memory the device offers the engine.
        price_per_hour: Its rental price (US$/h).

    Returns:
        The device entry, the overheads, and fit errors (median and max relative error of the kept form, the max
        of each form, and ``overlap``: 1 for the roofline, 0 for the sum).
    """
    fits = {overlap: _fit_form(rows, models, device_id, memory_gib, price_per_hour, overlap)
            for overlap in (True, False)}
    overlap = min(fits, key=lambda o: fits[o][2])
    device, overheads, _, errors = fits[overlap]
    form = "roofline (max)" if overlap else "sum of compute and memory time"
    source = (f"fitted by profile_device to {len(rows)} measured step times as a {form} (median error "
              f"{np.median(errors):.1%}, max {errors.max():.1%}; the {'sum' if overlap else 'roofline'} fitted "
              f"max {fits[not overlap][3].max():.1%})")
    device = device.model_copy(update={"efficiency": device.efficiency.model_copy(update={"source": source})})
    return device, overheads, {"median_rel_err": float(np.median(errors)), "max_rel_err": float(errors.max()),
                               "roofline_max_rel_err": float(fits[True][3].max()),
                               "sum_max_rel_err": float(fits[False][3].max()), "overlap": float(overlap)}


_RATES = (0, 1, 2, 3)
"""Slots of the fit's parameters: FLOP/s, bytes/s, the attention and the KV-read rate."""

_OVERHEADS = (4, 5, 6)
"""Slots of the fit's parameters: the per-step, per-sequence and per-request overheads (:class:`Overheads`' order)."""


def _fit_form(rows: Sequence[dict[str, Any]], models: dict[str, Model], device_id: str, memory_gib: float,
              price_per_hour: float, overlap: bool) -> tuple[Gpu, Overheads, float, np.ndarray]:
    """One form's least-squares fit in log space: the entry, the overheads, the RMS log error and the relative
    error of each row.

    The parameters (logs, in :data:`_RATES`' and :data:`_OVERHEADS`' slots first): FLOP/s, bytes/s, the attention
    and KV-read rates, the per-step, per-sequence and per-request overheads; then the bandwidth multiplier of each
    decode batch but the largest, and (with two or more models) each model's compute multiplier but the first, whose
    log is minus the others' sum (their geometric mean stays 1).
    """
    from scipy.optimize import least_squares

    measured = np.asarray([r["seconds"] for r in rows])
    decode = sorted({int(r["batch"]) for r in rows if r["kind"] == "decode"})
    sizes = decode[:-1]  # the largest decode batch is the reference (multiplier 1)
    names = sorted({r["model"] for r in rows})
    free = names[1:] if len(names) > 1 else []

    fixed = len(_RATES) + len(_OVERHEADS)

    def entry(x: np.ndarray) -> Gpu:
        scale = {**dict(zip(sizes, np.exp(x[fixed:fixed + len(sizes)]).tolist(), strict=True)), decode[-1]: 1.0}
        logs = x[fixed + len(sizes):]
        compute = dict(zip(names, np.exp([-logs.sum(), *logs]).tolist(), strict=True)) if free else {}
        flops, bandwidth, attention, kv_memory = np.exp(x[list(_RATES)]).tolist()
        return device_entry(device_id, flops, bandwidth, memory_gib, price_per_hour, "fit", scale if sizes else None,
                            overlap, attention, kv_memory, compute)

    def overheads(x: np.ndarray) -> Overheads:
        return Overheads(*np.exp(x[list(_OVERHEADS)]).tolist())

    def residual(x: np.ndarray) -> np.ndarray:
        device, costs = entry(x), overheads(x)
        pred = np.concatenate([predict([r], models[r["model"]], device, costs) for r in rows])
        return np.log(pred) - np.log(measured)

    extra = len(sizes) + len(free)
    start = np.log([5e10, 1e10, 0.5, 0.5, 1e-3, 1e-3, 1e-3, *[1.0] * extra])
    low = np.log([1e8, 1e8, 0.01, 0.01, 1e-6, 1e-7, 1e-6, *[0.1] * extra])
    high = np.log([1e15, 1e13, 1.0, 1.0, 1.0, 1.0, 1.0, *[10] * extra])  # attention and KV never beat GEMMs, streams
    fit = least_squares(residual, start, bounds=(low, high))
    logs = residual(fit.x)
    return entry(fit.x), overheads(fit.x), float(np.sqrt(np.mean(logs**2))), np.abs(np.exp(logs) - 1)
