"""Does the simulator, calibrated by ``profile_device``, predict this CPU engine's latencies across loads?

The engine serves real held-out prompts (ShareGPT / GSM8K / HumanEval, capped) arriving by a seeded Poisson process,
in three series: each Qwen candidate at full depth, and the small one as an early-exit model (partially loaded up to
its deepest exit, with its block head). Each series is swept over four loads, from ``--qps`` up to where the
simulator predicts the end-to-end P95 at 4x the light one (the last point is meant to measure at least 3x:
``heavy_over_light`` says whether it did). The simulator gets the same arrivals, prompt and output lengths, engine
knobs (batch cap, block size, memory budget, prefill mixed with decodes as this engine does) and the device fitted by
the ``profile_device`` stage: as profiled (raw), and rescaled by the drift the reference probes measured right before
and after the point (corrected; ``benchmarks/sweep.py``). Errors are relative, per cell: series x load x (TTFT, TPOT,
E2E) x (P50, P95).

Usage:
    python benchmarks/simulator_vs_engine.py --quick   # 12 requests per point (~10 min; a P95 of 12 is the slowest)
    python benchmarks/simulator_vs_engine.py           # 100 requests per point

Needs ``make run`` (checkpoints, exit heads, the device profile with its probe). Plot:
``benchmarks/out/simulator_vs_engine.png``. Last line: ``RESULT sweep_median_err=... sweep_max_err=...
drift_corrected_median_err=... drift_corrected_max_err=... drift_max=... heavy_over_light=...`` (target: median
<= 10%, max <= 25%, raw).
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pandas as pd
from common import start  # benchmarks/ is the script's folder, so on sys.path
from sweep import Prober, cells, geometric_loads, plot, print_table, saturating_load, stamp, summary

from exitplan.artifacts import queries_path
from exitplan.catalog import load_catalog
from exitplan.config import EngineParams
from exitplan.earlyexit.checkpoint import read_index
from exitplan.engine.engine import Engine, EngineConfig
from exitplan.engine.factory import candidates
from exitplan.engine.request import Request
from exitplan.engine.served import Candidate
from exitplan.errors import ExitplanError
from exitplan.profiling.calibration import device_of
from exitplan.profiling.device_file import DeviceProfile
from exitplan.simulator.cost_model import ReplicaSpec
from exitplan.simulator.replica import ReplicaSimulator, RequestSet
from exitplan.stages.profile_device import catalog_model
from exitplan.workload.split import split_queries

MIX = ("sharegpt", "gsm8k", "humaneval")
GIB = 2**30


def workload(params, tokenizer, count: int, max_prompt: int, max_output: int, qps: float, seed: int = 0):
    """Prompts (token ids), output lengths and Poisson arrival offsets."""
    _, held_out = split_queries(queries_path(params),
                                params.train_exits.datasets, params.train_exits.seed)
    rng = np.random.default_rng(seed)
    prompts, outputs = [], []
    for i in range(count):
        rows = held_out[held_out["dataset"] == MIX[i % len(MIX)]]
        row = rows.iloc[i // len(MIX)]
        prompts.append(tokenizer.encode(row["prompt"])[:max_prompt])
        outputs.append(int(rng.integers(max_output // 2, max_output + 1)))
    arrivals = np.cumsum(rng.exponential(1.0 / qps, count))
    arrivals -= arrivals[0]
    return prompts, outputs, arrivals


LOADS = 4
"""Measured loads per series."""


def engine_latencies(requests: list[Request]) -> dict[str, np.ndarray]:
    """Each request's TTFT, TPOT and end-to-end seconds as the engine served it."""
    ttft = np.array([r.first_token_s - r.arrival_s for r in requests])
    e2e = np.array([r.finish_s - r.arrival_s for r in requests])
    tpot = np.array([(r.finish_s - r.first_token_s) / (len(r.output) - 1) for r in requests])
    return {"ttft": ttft, "tpot": tpot, "e2e": e2e}


def sim_latencies(params, fitted: DeviceProfile, candidate: Candidate, layers: int | None, config: EngineConfig,
                  prompts, outputs, arrivals) -> dict[str, np.ndarray]:
    """Each request's TTFT, TPOT and end-to-end seconds as the simulator predicts them on ``fitted``."""
    device = fitted.gpu.model_copy(update={"memory_gib": config.memory_budget_bytes / GIB})
    spec = ReplicaSpec(catalog_model(params, candidate.name), device, layers=layers, exit_head_layers=1)
    engine = EngineParams(max_num_seqs=config.max_num_seqs, block_size=config.block_size,
                          gpu_memory_utilization=1.0, enable_chunked_prefill=True,
                          max_num_batched_tokens=config.max_prefill_tokens, step_overhead_s=fitted.step_overhead_s,
                          seq_overhead_s=fitted.seq_overhead_s, prompt_overhead_s=fitted.prompt_overhead_s,
                          max_model_len=4096, watermark=0.0)
    result = ReplicaSimulator(spec, engine).run(RequestSet(np.asarray(arrivals, float),
                                                           np.asarray([len(p) for p in prompts]),
                                                           np.asarray(outputs)))
    arrival = result.requests.arrival_s
    tpot = (result.finish_s - result.first_token_s) / (result.requests.output_len - 1)
    return {"ttft": result.first_token_s - arrival, "tpot": tpot, "e2e": result.finish_s - arrival}


def sweep_series(params, prober: Prober, tokenizer, label: str, candidate: Candidate, layer: int | None,
                 config: EngineConfig, count: int, light: float) -> list[pd.DataFrame]:
    """One series: its loads picked by the simulator, each served by one engine between two probes."""
    def p95(qps: float) -> float:
        prompts, outputs, arrivals = workload(params, tokenizer, count, 96, 24, qps)
        return float(np.percentile(sim_latencies(params, prober.device, candidate, layer, config, prompts, outputs,
                                                 arrivals)["e2e"], 95))

    loads = geometric_loads(light, saturating_load(light, p95, 4.0, 64.0), LOADS)
    engine, tables = Engine([candidate], config), []
    for point, qps in enumerate(loads):
        prompts, outputs, arrivals = workload(params, tokenizer, count, 96, 24, qps, seed=point)
        requests = [Request(f"r{point}-{i}", p, n) for i, (p, n) in enumerate(zip(prompts, outputs, strict=True))]
        _, drift, _ = prober.around(lambda rs=requests, at=arrivals: engine.run_timed(rs, list(at)))
        frame = pd.DataFrame(engine_latencies(requests)).assign(who=label)
        for prefix, device in (("raw", prober.device), ("cor", prober.corrected(drift))):
            predicted = sim_latencies(params, device, candidate, layer, config, prompts, outputs, arrivals)
            frame = frame.assign(**{f"{prefix}_{m}": v for m, v in predicted.items()})
        tables.append(cells(frame, qps, total=False))
        print(f"{stamp()} {label} {qps:.3f} req/s: drift x{drift.prefill:.3f}/x{drift.decode:.3f} (prefill/decode), "
              f"largest batch {engine.telemetry.max_batch()}", flush=True)
    return tables


def main() -> None:
    from transformers import AutoTokenizer

    args, params = start(__doc__, {"--qps": {"type": float, "default": 0.3, "help": "The lightest load (req/s)."}})
    try:
        prober = Prober(device_of(params, "profile_device"), load_catalog(params.path(params.catalog)),
                        params.calibrate.repeats)
    except ExitplanError as exc:
        sys.exit(str(exc))
    count, budget = 12 if args.quick else 100, int(params.helios.memory_budget_gib * GIB)
    series = []
    for name in params.helios.candidates[:2]:
        candidate = candidates(params, [name])[0]  # as the servers serve it (helios.dtype), as profile_device timed it
        series.append((f"{name.split('/')[-1]} full", candidate, "full", None))
    small = series[0][1]
    deepest = max(read_index(params.path(params.train_exits.output_dir) / small.name).exit_layers)
    series.append((f"{small.name.split('/')[-1]} exit@{deepest}", small, "fixed", deepest))
    print(f"{count} requests per point{' (--quick)' if args.quick else ''}, Poisson, prompts <= 96 tokens, outputs "
          f"12-24 tokens; from {args.qps} req/s to the simulator's 4x-P95 load, {LOADS} loads per series")
    tables = []
    for label, candidate, mode, layer in series:
        tokenizer = AutoTokenizer.from_pretrained(str(candidate.checkpoint))
        config = EngineConfig(memory_budget_bytes=budget, mode=mode, fixed_exit=layer, max_num_seqs=64,
                              block_size=params.helios.block_size, max_prefill_tokens=2048)
        started = time.perf_counter()
        tables += sweep_series(params, prober, tokenizer, label, candidate, layer, config, count, args.qps)
        print(f"{stamp()} {label}: {time.perf_counter() - started:.0f} s", flush=True)
    table = pd.concat(tables, ignore_index=True)
    print_table(table)
    whos = [label for label, *_ in series]
    print(f"plot: {plot(table, 'simulator_vs_engine', 'HELIOS engine on this CPU', whos)}")
    figures = summary(table, prober, whos)
    print(f"raw: median {figures['sweep_median_err']:.1%}, max {figures['sweep_max_err']:.1%} over {len(table)} "
          f"cells (target <= 10%, <= 25%); drift-corrected: median {figures['drift_corrected_median_err']:.1%}, max "
          f"{figures['drift_corrected_max_err']:.1%}; largest drift {figures['drift_max']:+.1%}")
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
