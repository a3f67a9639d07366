"""The plan deployed on real vLLM replicas here, held against the simulator's prediction of the same traffic, at
four loads from the plan's own to near saturation.

The plan is the local scenario's (``qwen-local``: the Qwen pair on this machine's vLLM device, ``data/plan/
qwen-local/plan.json``: its models, routing fractions, routing model and predicted P95). ``exitplan deploy``'s local
path (:func:`exitplan.deploy.start_local` with ``deploy.backend: vllm``) starts one vLLM CPU replica per plan model this
machine holds (one core each) and the coordinator in front, on loopback, once for the whole sweep. At each load a
real trace is replayed through the coordinator: workload prompts (``queries.parquet``, their text and token counts;
the same prompts at every load, each opened by a line naming the load, so vLLM's prefix cache never holds one from
an earlier point) at Poisson arrivals, each
streamed with ``max_tokens`` = its reference answer's length cut at ``build_perf_db.vllm_max_output_len`` (as the
plan's perf DB cut them); the client records TTFT, TPOT and end-to-end latency, and which model the coordinator
routed it to.

The loads: the scenario's ``load_qps`` (the plan's promise is checked there: ``plan_p95_err`` compares its
``predicted_p95_s``, the worst loaded model's P95 from the perf DB, with the worst model's measured P95), then
geometrically up to where the simulator predicts the fleet's P95 at 4x the light one (the last point is meant to
measure at least 3x: ``heavy_over_light`` says whether it did).

The prediction of each request is its wait in the coordinator's routing scorer (each prompt's scoring time, its embedder
and weights timed here alone with the replicas up and standing by, through the scorer's micro-batching queue) followed
by the simulator's (:mod:`exitplan.vllm.simulate`: the ``vllm-cpu`` device fitted by ``profile_vllm``, the replicas'
engine knobs) of its model's replica serving exactly the requests routed to it, each reaching it when its score is
known, with their prompt lengths and the answer lengths they got; the replicas share this host, so each is slowed by
the other's busy share over the point (the device's measured ``neighbour_slowdown``,
:mod:`exitplan.simulator.colocation`). Each point runs between two reference probes
(``benchmarks/sweep.py``): the prediction is made twice, with the device as profiled (raw) and rescaled by the
probes' drift since profiling (corrected). Errors are relative, per cell: load x (each model and all requests) x
(TTFT, TPOT, E2E) x (P50, P95).

``--quick``: 20 requests per load (about 10 minutes with the replicas' start-up: the P95 of 20 is their second
slowest); without it 100 per load (well over an hour). ``--scenario`` to change. The plot goes to
``benchmarks/out/fleet_vs_plan.png``.

``--cut MODEL=LAYERS``: the plan with that model's replicas cut to an exit (a plan with a partial replica, issue 31):
deployed as ``exitplan deploy`` deploys it (a vLLM replica of the truncated checkpoint, written first if
``partial_checkpoints`` has not) and predicted with the replica holding that many layers. The plan's own promise was
made at full depth, so ``plan_p95_err`` then holds the simulator's P95 at the plan's load instead.

Last line: ``RESULT sweep_median_err=... sweep_max_err=... drift_corrected_median_err=... drift_corrected_max_err=...
drift_max=... plan_p95_err=... heavy_over_light=...`` (target: median <= 10%, max <= 25%, raw).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import httpx
import numpy as np
import pandas as pd
from common import start
from sweep import (
    CpuMeter,
    Prober,
    cells,
    geometric_loads,
    plot,
    print_table,
    saturating_load,
    save_requests,
    stamp,
    summary,
)

from exitplan.artifacts import PLAN_FILE, ROUTER_FILE, calibration_path, queries_path
from exitplan.catalog import load_catalog
from exitplan.deploy import start_local
from exitplan.planner.plan_file import read_plan
from exitplan.profiling.calibration import device_of, read_calibration, standing
from exitplan.routing.router_file import load_router
from exitplan.simulator.colocation import HostSharing, simulate_colocated
from exitplan.simulator.replica import RequestSet
from exitplan.vllm.simulate import replica_simulator
from serving.scorer import BatchingScorer, score_function

LOADS = 4
"""Measured loads of the sweep."""


def trace(params, count: int, qps: float, cap: int, point: int) -> pd.DataFrame:
    """The same ``count`` workload queries at every ``point``, each prompt opened by a line naming the point (so
    vLLM's prefix cache, whose block hashes chain from the first token, holds nothing of an earlier point), at Poisson
    arrivals of rate ``qps`` (seeded by the point), answers capped at ``cap``; ``prompt_len`` counts the opened prompt
    with the workload's tokenizer.

    Every load serves the same prompt and answer lengths, so the sweep's latencies differ by load alone (with other
    prompts per point, the prompt mix moved a point's P95 more than its load did: ``docs/measurements.md``,
    2026-12-04)."""
    from exitplan.stages.prepare_workload import load_tokenizer
    from exitplan.workload.trace import count_tokens

    queries = pd.read_parquet(queries_path(params)).sample(frac=1.0, random_state=0)
    picked = queries.iloc[:count].reset_index(drop=True)
    picked["prompt"] = f"Request set {point}.\n" + picked["prompt"]
    picked["prompt_len"] = count_tokens(load_tokenizer(params), picked["prompt"].tolist())
    rng = np.random.default_rng(point)
    picked["arrival_s"] = np.cumsum(rng.exponential(1 / qps, size=count))
    picked["max_tokens"] = picked["output_len"].clip(lower=2, upper=cap).astype(int)
    return picked


async def replay(url: str, model: str, frame: pd.DataFrame) -> list[dict]:
    """Send every request at its arrival time (streamed) and time what the client sees."""
    async with httpx.AsyncClient(timeout=1800) as client:
        began = time.perf_counter()

        async def one(row) -> dict:
            await asyncio.sleep(max(0.0, row.arrival_s - (time.perf_counter() - began)))
            sent = time.perf_counter()
            body = {"model": model, "prompt": row.prompt, "max_tokens": int(row.max_tokens), "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}
            events, tokens = [], 0
            async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
                reply.raise_for_status()
                served_by = reply.headers["x-exitplan-model"]
                async for line in reply.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[len("data: "):])
                    if chunk.get("choices"):
                        events.append(time.perf_counter())
                    if chunk.get("usage"):
                        tokens = int(chunk["usage"]["completion_tokens"])
            # the server's token count: an event may carry several tokens (vLLM's API server merges them when it
            # lags behind its engine), so counting events would undercount the tokens and overstate TPOT
            return {"model": served_by, "sent_s": sent - began, "tokens": tokens, "events": len(events),
                    "ttft": events[0] - sent, "e2e": events[-1] - sent,
                    "tpot": (events[-1] - events[0]) / (tokens - 1) if tokens > 1 else float("nan")}

        return list(await asyncio.gather(*(one(r) for r in frame.itertuples())))


def routing_seconds(params, router: Path, prompts: list[str]) -> np.ndarray:
    """Seconds the coordinator's routing score takes for each prompt alone (its embedder and weights, with this
    process's threads, which the coordinator inherits; after one warm-up): the time a request spends before it reaches a
    replica."""
    routing = load_router(router.read_bytes(), str(router))
    score = score_function(routing, params.checkpoint_path(routing.embedder))
    score(prompts[:1])
    seconds = []
    for prompt in prompts:
        began = time.perf_counter()
        score([prompt])
        seconds.append(time.perf_counter() - began)
    return np.asarray(seconds)


def scorer_queue(sent_s: np.ndarray, score_s: np.ndarray) -> np.ndarray:
    """Each request's wait in the coordinator's routing scorer (:class:`serving.scorer.BatchingScorer` with the
    coordinator's knobs): one batch at a time; a batch is the first waiting request and those that join it within
    ``max_wait_s`` (at most ``max_batch``); it takes the sum of its prompts' scoring times. Returns seconds from each
    request's send to its score."""
    knobs = BatchingScorer(lambda texts: np.zeros(len(texts)))
    order = np.argsort(sent_s, kind="stable")
    arrivals, costs = sent_s[order], score_s[order]
    waits, free_at, i = np.empty(len(order)), 0.0, 0
    while i < len(order):
        closes = max(arrivals[i], free_at) + knobs.max_wait_s
        j = i + 1
        while j < len(order) and j - i < knobs.max_batch and arrivals[j] <= closes:
            j += 1
        free_at = closes + float(costs[i:j].sum())
        waits[i:j] = free_at - arrivals[i:j]
        i = j
    out = np.empty(len(order))
    out[order] = waits
    return out


def predict(catalog, frame: pd.DataFrame, device, prefix: str, layers: Mapping[str, int | None],
            timed: bool = False) -> pd.DataFrame:
    """The prediction of each request's TTFT, TPOT and E2E (columns ``<prefix>_<metric>``): its routing score's time
    (``route_s``), then the simulator's replica of its model on ``device`` (holding ``layers[model]``: all when
    ``None``), reached when the score is known (``timed``: neighbours slow a replica only while they are busy)."""
    out = frame.copy()
    groups = [(model, rows.assign(at_s=rows["sent_s"] + rows["route_s"]).sort_values("at_s"))
              for model, rows in frame.groupby("model")]
    request_sets = [RequestSet(rows["at_s"].to_numpy(float), rows["prompt_len"].to_numpy(np.int64),
                               rows["tokens"].clip(lower=1).to_numpy(np.int64)) for _, rows in groups]
    sims = [replica_simulator(device, catalog.llm(model), layers.get(model)) for model, _ in groups]
    results, _ = simulate_colocated(sims, request_sets, HostSharing.of(device.gpu), [model for model, _ in groups],
                                    timed)
    for (_, rows), requests, result in zip(groups, request_sets, results, strict=True):
        ttft = result.first_token_s - requests.arrival_s + rows["route_s"].to_numpy(float)
        e2e = result.finish_s - requests.arrival_s + rows["route_s"].to_numpy(float)
        out.loc[rows.index, f"{prefix}_ttft"] = ttft
        out.loc[rows.index, f"{prefix}_e2e"] = e2e
        out.loc[rows.index, f"{prefix}_tpot"] = np.where(requests.output_len > 1,
                                                         (e2e - ttft) / np.maximum(requests.output_len - 1, 1), np.nan)
    return out


NO_NEIGHBOURS = {"neighbour_slowdown": 0.0, "model_slowdowns": {}, "slowdown_grids": {}}
TIMED = "the model, neighbours felt only while busy (timed)"
SHARING_TERMS = {"neighbours by batch and coordinator (the model)": {},
                 TIMED: {},
                 "neighbours one figure per model (no batches)": {"slowdown_grids": {}},
                 "neighbours as one device-wide figure": {"model_slowdowns": {}, "slowdown_grids": {}},
                 "coordinator only (neighbour_slowdown 0)": NO_NEIGHBOURS,
                 "neighbours only (no coordinator)": {"host_slots": 0},
                 "replicas as if alone": {**NO_NEIGHBOURS, "host_slots": 0}}
"""The co-location model's terms, each switched off in turn on the same measured requests (what each contributes)."""


def terms_table(catalog, frames: list[pd.DataFrame], device, layers: Mapping[str, int | None]) -> None:
    """The raw median and max error over every cell of the measured points, predicted again with each of
    :data:`SHARING_TERMS` (the simulator only: seconds)."""
    print("co-location terms on the same requests (raw errors over every cell):")
    for name, update in SHARING_TERMS.items():
        gpu = device.gpu.model_copy(update=update)
        variant = device.model_copy(update={"gpu": gpu})
        again = [predict(catalog, f.rename(columns={"who": "model"}), variant, "raw", layers, name == TIMED)
                 for f in frames]
        table = pd.concat([cells(a.assign(cor_ttft=a["raw_ttft"], cor_tpot=a["raw_tpot"], cor_e2e=a["raw_e2e"])
                                 .rename(columns={"model": "who"}), float(a["qps"].iloc[0])) for a in again])
        print(f"  {name:<48} median {table['raw_err'].median():6.1%}  max {table['raw_err'].max():6.1%}")


def planned_p95(catalog, device, plan, params, count: int, cap: int) -> Callable[[float], float]:
    """The simulator's P95 of all requests at a load, before anything is measured: the sweep's first trace, each
    request sent to a model drawn by the plan's fractions (seeded), no routing time."""
    frame = trace(params, count, 1.0, cap, 0)
    shares = np.asarray([m.fraction for m in plan.models])
    names = [m.model for m in plan.models]
    frame["model"] = np.random.default_rng(0).choice(names, size=count, p=shares / shares.sum())
    frame["tokens"], frame["route_s"] = frame["max_tokens"], 0.0

    def p95(qps: float) -> float:
        at = frame.assign(sent_s=frame["arrival_s"] / qps)
        return float(np.percentile(predict(catalog, at, device, "raw", plan_layers(plan))["raw_e2e"], 95))

    return p95


def plan_layers(plan) -> dict[str, int | None]:
    """Layers each plan model's replicas hold (``None``: the whole model)."""
    return {m.model: m.layers for m in plan.models}


def cut_plan(params, catalog, plan, cut: str):
    """``plan`` with the replicas of ``cut``'s model (``MODEL=LAYERS``) cut to that many layers, its truncated
    checkpoint written where ``exitplan deploy`` looks for it if it is not there yet."""
    from exitplan.deploy import partial_path
    from exitplan.vllm.truncate import truncate

    model, _, layers_text = cut.rpartition("=")
    entry, layers = plan.entry(model), int(layers_text)
    if entry is None or not 1 <= layers < catalog.llm(model).num_layers:
        raise SystemExit(f"--cut {cut}: the plan has no {model!r} or {layers} is not below its layers")
    if not (partial_path(params, model, layers) / "config.json").is_file():
        truncate(params.fetched(model), partial_path(params, model, layers), layers, params.vllm.dtype)
    groups = [g.model_copy(update={"layers": layers}) for g in entry.groups]
    models = [m.model_copy(update={"groups": groups}) if m.model == model else m for m in plan.models]
    return plan.model_copy(update={"models": models})


def cpu_meter(fleet) -> CpuMeter:
    """A meter of the fleet's processes (each replica named by its model and port, the coordinator) and this client."""
    by_url = {url: model.split("/")[-1] for model, urls in fleet.replica_urls.items() for url in urls}
    names = {}
    for proc in fleet.processes:
        args = [str(a) for a in proc.args]
        port = args[args.index("--port") + 1] if "--port" in args else "?"
        model = next((m for u, m in by_url.items() if u.endswith(f":{port}")), None)
        names[f"{model}:{port}" if model else "coordinator"] = proc.pid
    return CpuMeter(names, {"client": os.getpid()})


def measure_point(params, fleet, plan_dir: Path, frame: pd.DataFrame,
                  meter: CpuMeter) -> tuple[pd.DataFrame, dict, dict[str, float]]:
    """Replay ``frame`` through the fleet's coordinator: per request what the client saw (with each prompt's scoring
    time and its wait in the scorer's queue), the coordinator's own statistics, and each process's share of a core
    over the replay."""
    # timed beside the standing-by replicas, as profile_vllm times each replica beside the others
    frame["score_s"] = routing_seconds(params, plan_dir / ROUTER_FILE, frame["prompt"].tolist())
    results, cpu = meter.around(lambda: asyncio.run(replay(fleet.coordinator_url, params.deploy.fleet_name, frame)))
    stats = httpx.get(f"{fleet.coordinator_url}/stats", timeout=30).json()
    measured = pd.concat([frame[["prompt_len", "max_tokens", "score_s"]], pd.DataFrame(results)], axis=1)
    measured["route_s"] = scorer_queue(measured["sent_s"].to_numpy(float), measured["score_s"].to_numpy(float))
    return measured, stats, cpu


def main() -> None:
    args, base = start(__doc__, {"--scenario": {"default": "qwen-local", "help": "Scenario whose plan to deploy."},
                                 "--cut": {"default": None, "help": "MODEL=LAYERS: cut that model's replicas"}})
    params = base.model_copy(update={"deploy": base.deploy.model_copy(update={"backend": "vllm"})})
    scenario = next(s for s in params.plan.scenarios if s.name == args.scenario)
    count, cap = 20 if args.quick else 100, params.build_perf_db.vllm_max_output_len
    plan_dir = params.path(params.plan.output_dir) / scenario.name
    plan = read_plan(plan_dir / PLAN_FILE)
    catalog = load_catalog(params.path(params.catalog))
    if args.cut:
        plan = cut_plan(params, catalog, plan, args.cut)
        print(f"plan {scenario.name} with {args.cut}: {plan_layers(plan)} layers per model")
    device = device_of(params, "profile_vllm")
    print(standing(device, read_calibration(calibration_path(params, "profile_vllm")), params.calibrate.max_age_h)
          .line())
    heavy = saturating_load(scenario.load_qps, planned_p95(catalog, device, plan, params, count, cap), 4.0, 64.0)
    loads = geometric_loads(scenario.load_qps, heavy, LOADS)
    print(f"loads {', '.join(f'{q:.3f}' for q in loads)} req/s ({count} requests each"
          f"{', --quick: a P95 of 20 is their second slowest' if args.quick else ''}); answers capped at {cap} tokens")
    prober = Prober(device, catalog, params.calibrate.repeats)
    fleet = start_local(params, plan, plan_dir / ROUTER_FILE, params.path(params.deploy.output_dir))
    tables, frames, at_plan = [], [], None
    meter = cpu_meter(fleet)
    try:
        for point, qps in enumerate(loads):
            frame = trace(params, count, qps, cap, point)
            (measured, stats, cpu), drift, (before, after) = prober.around(lambda f=frame: measure_point(
                params, fleet, plan_dir, f, meter))
            predicted = predict(catalog, measured, device, "raw", plan_layers(plan))
            predicted = predict(catalog, predicted, prober.corrected(drift), "cor", plan_layers(plan)).rename(
                columns={"model": "who"})
            tables.append(cells(predicted, qps))
            frames.append(predicted.assign(qps=qps, drift_prefill=drift.prefill, drift_decode=drift.decode))
            at_plan = predicted if point == 0 else at_plan
            print(f"{stamp()} {qps:.3f} req/s done: drift before x{before.prefill:.3f}/x{before.decode:.3f}, after "
                  f"x{after.prefill:.3f}/x{after.decode:.3f} (prefill/decode); coordinator own time P95 "
                  f"{stats['overhead_ms_p95']:.1f} ms; routed {predicted['who'].value_counts().to_dict()}; "
                  f"{(predicted['events'] < predicted['tokens']).mean():.0%} of streams sent fewer events than tokens "
                  f"({predicted['events'].sum()} events, {predicted['tokens'].sum()} tokens); cores used over the "
                  f"replay {', '.join(f'{k} {v:.2f}' for k, v in cpu.items())}", flush=True)
    finally:
        fleet.stop()
    table = pd.concat(tables, ignore_index=True)
    print_table(table)
    terms_table(catalog, frames, device, plan_layers(plan))
    print(f"requests: {save_requests(frames, 'fleet_vs_plan')}")
    print(f"plot: {plot(table, 'fleet_vs_plan', f'{scenario.name} on vLLM CPU replicas', ['all'])}")
    assert at_plan is not None
    worst = max(float(np.percentile(rows["e2e"], 95)) for _, rows in at_plan.groupby("who"))
    promised = plan.predicted_p95_s if not args.cut else max(
        float(np.percentile(rows["raw_e2e"], 95)) for _, rows in at_plan.groupby("who"))
    print(f"plan {scenario.name} at its load {scenario.load_qps} req/s: predicted P95 (worst model) {promised:.3f} s,"
          f" measured {worst:.3f} s")
    figures = {**summary(table, prober, ['all']), "plan_p95_err": abs(promised - worst) / worst}
    print(f"raw: median {figures['sweep_median_err']:.1%}, max {figures['sweep_max_err']:.1%} over {len(table)} "
          f"cells (target <= 10%, <= 25%); drift-corrected: median {figures['drift_corrected_median_err']:.1%}, max "
          f"{figures['drift_corrected_max_err']:.1%}; largest drift {figures['drift_max']:+.1%}")
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
