"""The plan deployed on real vLLM replicas here, held against the simulator's prediction of the same traffic.

The plan is the local scenario's (``qwen-local``: the Qwen pair on this machine's vLLM device, ``data/plan/
qwen-local/plan.json``: its models, routing fractions, routing model and predicted P95). ``exitplan deploy``'s local
path (:func:`exitplan.deploy.start_local` with ``deploy.backend: vllm``) starts one vLLM CPU replica per plan model this
machine holds (one core each) and the coordinator in front, on loopback. A real trace is replayed through the
coordinator: workload prompts (``queries.parquet``, their text and token counts) at Poisson arrivals at the scenario's
load, each streamed with ``max_tokens`` = its reference answer's length cut at ``build_perf_db.vllm_max_output_len`` (as
the plan's perf DB cut them); the client records TTFT, TPOT and end-to-end latency, and which model the coordinator
routed it to.

The prediction of each request is its wait in the coordinator's routing scorer (each prompt's scoring time, its embedder
and weights timed here alone with the replicas up and standing by, through the scorer's micro-batching queue) followed
by the simulator's (:mod:`exitplan.vllm.simulate`: the ``vllm-cpu`` device fitted by ``profile_vllm``, the replicas'
engine knobs) of its model's replica serving exactly the requests routed to it, each reaching it when its score is
known, with their prompt lengths and the answer lengths they got. Errors are relative, per metric: the median over the
cells (each model and the fleet) x (P50, P95). The plan's own promise is its ``predicted_p95_s`` (the worst loaded
model's P95 from the perf DB at the plan's fractions): ``plan_p95_err`` compares it with the worst model's measured P95
(``fleet_p95_s``).

``--quick``: 16 requests (about 5 minutes with the replicas' start-up); without it 48. ``--scenario`` to change.

Last line: ``RESULT plan_p95_err=... ttft_err=... tpot_err=... e2e_p50_err=... fleet_p95_s=... predicted_p95_s=...``
(target: median relative error <= 15% per metric, goal 10%).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import numpy as np
import pandas as pd
from common import start

from exitplan.artifacts import PLAN_FILE, ROUTER_FILE, queries_path, vllm_device_path
from exitplan.catalog import load_catalog
from exitplan.deploy import start_local
from exitplan.planner.plan_file import read_plan
from exitplan.routing.router_file import load_router
from exitplan.simulator.replica import RequestSet
from exitplan.vllm.simulate import read_vllm_device, replica_simulator
from serving.scorer import BatchingScorer, score_function

METRICS = ("ttft", "tpot", "e2e")


def trace(params, count: int, qps: float, cap: int) -> pd.DataFrame:
    """``count`` workload queries at Poisson arrivals of rate ``qps`` (seeded), answers capped at ``cap``."""
    queries = pd.read_parquet(queries_path(params))
    picked = queries.sample(n=count, random_state=0).reset_index(drop=True)
    rng = np.random.default_rng(0)
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
                    "stream": True}
            events = []
            async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
                reply.raise_for_status()
                served_by = reply.headers["x-exitplan-model"]
                async for line in reply.aiter_lines():
                    if line.startswith("data: {") and '"choices":[{' in line.replace(" ", ""):
                        events.append(time.perf_counter())
            tokens = len(events)
            return {"model": served_by, "sent_s": sent - began, "tokens": tokens, "ttft": events[0] - sent,
                    "e2e": events[-1] - sent, "tpot": (events[-1] - events[0]) / (tokens - 1) if tokens > 1 else
                    float("nan")}

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


def predict(params, frame: pd.DataFrame, device) -> pd.DataFrame:
    """The prediction of each request's TTFT, TPOT and E2E: its routing score's time (``route_s``), then the
    simulator's replica of its model, reached when the score is known."""
    catalog = load_catalog(params.path(params.catalog))
    out = frame.copy()
    for model, rows in frame.groupby("model"):
        rows = rows.assign(at_s=rows["sent_s"] + rows["route_s"]).sort_values("at_s")
        requests = RequestSet(rows["at_s"].to_numpy(float), rows["prompt_len"].to_numpy(np.int64),
                              rows["tokens"].clip(lower=1).to_numpy(np.int64))
        result = replica_simulator(device, catalog.model(model)).run(requests)
        ttft = result.first_token_s - requests.arrival_s + rows["route_s"].to_numpy(float)
        e2e = result.finish_s - requests.arrival_s + rows["route_s"].to_numpy(float)
        out.loc[rows.index, "pred_ttft"] = ttft
        out.loc[rows.index, "pred_e2e"] = e2e
        out.loc[rows.index, "pred_tpot"] = np.where(requests.output_len > 1,
                                                    (e2e - ttft) / np.maximum(requests.output_len - 1, 1), np.nan)
    return out


def cells(frame: pd.DataFrame) -> pd.DataFrame:
    """Measured and predicted P50 / P95 of each metric, per model and for the fleet."""
    rows = []
    for name, part in [*frame.groupby("model"), ("fleet", frame)]:
        for metric in METRICS:
            for q in (50, 95):
                measured = float(np.nanpercentile(part[metric], q))
                predicted = float(np.nanpercentile(part[f"pred_{metric}"], q))
                rows.append({"who": name, "metric": metric, "q": q, "measured": measured, "predicted": predicted,
                             "rel_err": abs(predicted - measured) / measured})
    return pd.DataFrame(rows)


def main() -> None:
    args, base = start(__doc__, {"--scenario": {"default": "qwen-local", "help": "Scenario whose plan to deploy."}})
    params = base.model_copy(update={"deploy": base.deploy.model_copy(update={"backend": "vllm"})})
    scenario = next(s for s in params.plan.scenarios if s.name == args.scenario)
    count, qps, cap = 16 if args.quick else 48, scenario.load_qps, params.build_perf_db.vllm_max_output_len
    plan_dir = params.path(params.plan.output_dir) / scenario.name
    plan = read_plan(plan_dir / PLAN_FILE)
    device = read_vllm_device(vllm_device_path(params))
    frame = trace(params, count, qps, cap)
    fleet = start_local(params, plan, plan_dir / ROUTER_FILE, params.path(params.deploy.output_dir))
    try:
        # timed beside the standing-by replicas, as profile_vllm times each replica beside the others
        frame["score_s"] = routing_seconds(params, plan_dir / ROUTER_FILE, frame["prompt"].tolist())
        results = asyncio.run(replay(fleet.coordinator_url, params.deploy.fleet_name, frame))
        stats = httpx.get(f"{fleet.coordinator_url}/stats", timeout=30).json()
    finally:
        fleet.stop()
    scorer = stats["scorer"]
    print(f"routing score alone: median {1000 * frame['score_s'].median():.1f} ms per prompt")
    print(f"coordinator: own time P50 {stats['overhead_ms_p50']:.1f} ms, P95 {stats['overhead_ms_p95']:.1f} ms; "
          f"routing score: {scorer['batches']} batches, model {1000 * scorer['model_seconds'] / scorer['batches']:.1f}"
          f" ms per batch, wait {1000 * scorer['wait_seconds'] / scorer['requests']:.1f} ms per request")
    measured = pd.concat([frame[["prompt_len", "max_tokens", "score_s"]], pd.DataFrame(results)], axis=1)
    measured["route_s"] = scorer_queue(measured["sent_s"].to_numpy(float), measured["score_s"].to_numpy(float))
    predicted = predict(params, measured, device)
    table = cells(predicted)
    planned = {m.model: m.fraction for m in plan.models}
    print(f"{count} requests, Poisson {qps} req/s, answers capped at {cap} tokens; replicas {fleet.replica_urls}")
    print(f"{'sent s':>8}{'model':>34}{'prompt':>8}{'tokens':>8}{'TTFT s':>8}{'pred':>7}{'TPOT s':>8}{'pred':>7}"
          f"{'E2E s':>8}{'pred':>7}")
    for r in predicted.sort_values("sent_s").itertuples():
        print(f"{r.sent_s:>8.1f}{r.model:>34}{r.prompt_len:>8}{r.tokens:>8}{r.ttft:>8.3f}{r.pred_ttft:>7.3f}"
              f"{r.tpot:>8.3f}{r.pred_tpot:>7.3f}{r.e2e:>8.2f}{r.pred_e2e:>7.2f}")
    print(f"{'who':<36}{'metric':>7}{'q':>4}{'measured s':>12}{'predicted s':>13}{'rel err':>9}")
    for row in table.itertuples():
        print(f"{row.who:<36}{row.metric:>7}{row.q:>4}{row.measured:>12.3f}{row.predicted:>13.3f}{row.rel_err:>9.1%}")
    print(f"{'model':<36}{'planned':>9}{'realised':>10}")
    for model, share in planned.items():
        print(f"{model:<36}{share:>9.3f}{(measured['model'] == model).mean():>10.3f}")
    fleet_rows = table[table["who"] == "fleet"].set_index(["metric", "q"])
    errors = {m: float(table[table["metric"] == m]["rel_err"].median()) for m in METRICS}
    worst = float(table[(table["who"] != "fleet") & (table["metric"] == "e2e") & (table["q"] == 95)]["measured"].max())
    promised = plan.predicted_p95_s
    print(f"plan {scenario.name}: predicted P95 (worst model) {promised:.3f} s, measured {worst:.3f} s; "
          f"all requests' P95 {fleet_rows.loc[('e2e', 95), 'measured']:.3f} s measured, "
          f"{fleet_rows.loc[('e2e', 95), 'predicted']:.3f} s simulated on the realised routing")
    for metric in METRICS:
        print(f"{metric}: median relative error {errors[metric]:.1%} (target <= 15%, goal 10%)")
    print(f"RESULT plan_p95_err={abs(promised - worst) / worst:.3f} ttft_err={errors['ttft']:.3f} "
          f"tpot_err={errors['tpot']:.3f} e2e_p50_err={fleet_rows.loc[('e2e', 50), 'rel_err']:.3f} "
          f"fleet_p95_s={worst:.3f} predicted_p95_s={promised:.3f}")


if __name__ == "__main__":
    main()
