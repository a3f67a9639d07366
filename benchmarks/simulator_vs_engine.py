"""Does the simulator, calibrated by ``profile_device``, predict this CPU engine's latencies under a Poisson load?

The engine serves real held-out prompts (ShareGPT / GSM8K / HumanEval, capped) arriving by a seeded Poisson process,
first at full depth, then as an early-exit model (the small candidate partially loaded up to an exit with its block
head). The simulator gets the same arrivals, prompt and output lengths, engine knobs (batch cap, block size, memory
budget, prefill mixed with decodes as this engine does) and the device entry fitted by the ``profile_device``
stage. Errors are relative, per metric (TTFT, TPOT, end-to-end P50 and P95), per mode.

Usage:
    python benchmarks/simulator_vs_engine.py --quick   # 10 requests per mode (~1.5 min)
    python benchmarks/simulator_vs_engine.py           # 30 requests per mode

Needs ``make run`` (checkpoints, exit heads, the device profile). Last line:
``RESULT sim_vs_engine_median_err=... sim_vs_engine_max_err=...``.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
from common import start  # benchmarks/ is the script's folder, so on sys.path

from exitplan.artifacts import queries_path
from exitplan.config import EngineParams
from exitplan.earlyexit.checkpoint import read_index
from exitplan.engine.engine import Engine, EngineConfig
from exitplan.engine.factory import candidates
from exitplan.engine.request import Request
from exitplan.engine.served import Candidate
from exitplan.errors import ExitplanError
from exitplan.simulator.cost_model import ReplicaSpec
from exitplan.simulator.replica import ReplicaSimulator, RequestSet
from exitplan.stages.profile_device import catalog_model, load_device
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


def engine_metrics(requests: list[Request]) -> dict[str, float]:
    ttft = np.array([r.first_token_s - r.arrival_s for r in requests])
    e2e = np.array([r.finish_s - r.arrival_s for r in requests])
    tpot = np.array([(r.finish_s - r.first_token_s) / (len(r.output) - 1) for r in requests])
    return {"ttft": float(np.mean(ttft)), "tpot": float(np.mean(tpot)), "e2e_p50": float(np.percentile(e2e, 50)),
            "e2e_p95": float(np.percentile(e2e, 95))}


def sim_metrics(params, candidate: Candidate, layers: int | None, config: EngineConfig, prompts, outputs,
                arrivals) -> dict[str, float]:
    fitted = load_device(params)
    device, step, seq = fitted.gpu, fitted.step_overhead_s, fitted.seq_overhead_s
    device = device.model_copy(update={"memory_gib": config.memory_budget_bytes / GIB})
    model = catalog_model(params, candidate.name)
    spec = ReplicaSpec(model, device, layers=layers, exit_head_layers=1)
    engine = EngineParams(max_num_seqs=config.max_num_seqs, block_size=config.block_size,
                          gpu_memory_utilization=1.0, enable_chunked_prefill=True,
                          max_num_batched_tokens=config.max_prefill_tokens, step_overhead_s=step,
                          seq_overhead_s=seq, max_model_len=4096, watermark=0.0)
    result = ReplicaSimulator(spec, engine).run(RequestSet(np.asarray(arrivals, float),
                                                           np.asarray([len(p) for p in prompts]),
                                                           np.asarray(outputs)))
    arrival = result.requests.arrival_s
    ttft, e2e = result.first_token_s - arrival, result.finish_s - arrival
    tpot = (result.finish_s - result.first_token_s) / (result.requests.output_len - 1)
    return {"ttft": float(np.mean(ttft)), "tpot": float(np.mean(tpot)), "e2e_p50": float(np.percentile(e2e, 50)),
            "e2e_p95": float(np.percentile(e2e, 95))}


def main() -> None:
    from transformers import AutoTokenizer

    args, params = start(__doc__, {"--qps": {"type": float, "default": 0.6}})
    name = params.helios.candidates[0]
    exits = params.path(params.train_exits.output_dir) / name
    candidate = candidates(params, [name])[0]  # as the servers serve it (helios.dtype), as profile_device timed it
    try:
        load_device(params)
    except ExitplanError as exc:
        sys.exit(str(exc))
    tokenizer = AutoTokenizer.from_pretrained(str(candidate.checkpoint))
    count = 10 if args.quick else 30
    prompts, outputs, arrivals = workload(params, tokenizer, count, 96, 24, args.qps)

    exit_layers = read_index(exits).exit_layers
    modes = {"full depth": ("full", None), f"early exit @{max(exit_layers)}": ("fixed", max(exit_layers))}
    budget = int(params.helios.memory_budget_gib * GIB)
    print(f"{count} requests, Poisson {args.qps} req/s, prompts <= 96 tokens (mean "
          f"{np.mean([len(p) for p in prompts]):.0f}), outputs {min(outputs)}-{max(outputs)} tokens; {name}")
    print(f"{'mode':<18}{'metric':<10}{'engine s':>10}{'sim s':>10}{'error':>8}")
    errors = []
    for label, (mode, layer) in modes.items():
        config = EngineConfig(memory_budget_bytes=budget, mode=mode, fixed_exit=layer, max_num_seqs=64,
                              block_size=params.helios.block_size, max_prefill_tokens=2048)
        engine = Engine([candidate], config)
        requests = [Request(f"r{i}", p, n) for i, (p, n) in enumerate(zip(prompts, outputs, strict=True))]
        started = time.perf_counter()
        engine.run_timed(requests, list(arrivals))
        wall = time.perf_counter() - started
        measured = engine_metrics(requests)
        predicted = sim_metrics(params, candidate, layer, config, prompts, outputs, arrivals)
        for metric in measured:
            err = abs(predicted[metric] / measured[metric] - 1)
            errors.append(err)
            print(f"{label:<18}{metric:<10}{measured[metric]:>10.3f}{predicted[metric]:>10.3f}{err:>8.1%}")
        print(f"{'':<18}(engine wall {wall:.0f} s, largest batch {engine.telemetry.max_batch()})")
        del engine
    print(f"RESULT sim_vs_engine_median_err={np.median(errors):.3f} sim_vs_engine_max_err={np.max(errors):.3f}")


if __name__ == "__main__":
    main()
