"""Load test of the serving path: client -> coordinator (routing score, thresholds, replica split) -> engine servers.

Everything runs on loopback in separate processes: one engine server per plan model (python -m serving.server) and
the coordinator (python -m serving.coordinator_server) with the plan's real routing model (MiniLM + ridge, the plan's
fractions and score window). Requests are real workload prompts, sent by a bounded pool of concurrent clients:

- phase 1, streamed: TTFT and TPOT as the client sees them;
- phase 2, whole answers: throughput, and the coordinator's own time per request (its total minus the replica's and
  the scorer model's), which the coordinator measures and exposes on /stats.

Routing: realised fractions per model against the plan's. The scorer's model time and batch sizes are reported apart.
``--quick`` serves both plan models with SmolLM2-135M under their names (routing is the real one; generation is fast)
and sends 48 + 48 requests of 12 tokens; without it the real plan models serve 96 + 96 requests of 24 tokens.

Last line: ``RESULT throughput_rps=... ttft_p95_ms=... routing_fraction_err=... coordinator_overhead_ms=...``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pandas as pd
from common import free_port, start

from exitplan.artifacts import PLAN_FILE, ROUTER_FILE, queries_path
from exitplan.deploy import LocalFleet, wait_healthy
from exitplan.planner.plan_file import Plan, read_plan

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


def launch(params, plan: Plan, router: Path, quick: bool) -> tuple[LocalFleet, dict]:
    """One engine server per plan model and the coordinator, healthy."""
    python, env = sys.executable, {**os.environ, "PYTHONPATH": str(params.root)}
    fleet, replicas = LocalFleet(""), []
    models = plan.model_ids
    for model in models:
        port = free_port()
        serve = SMOLLM2 if quick else model
        cmd = [python, "-m", "serving.server", "--model", serve, "--served-name", model, "--port", str(port),
               "--memory-gib", "1.5" if quick else "9", "--max-context", "1024", "--max-queue", "256"]
        fleet.processes.append(subprocess.Popen(cmd, cwd=params.root, env=env))
        replicas.append({"model": model, "url": f"http://127.0.0.1:{port}", "weight": 1.0})
    for replica, proc in zip(replicas, fleet.processes, strict=True):
        wait_healthy(replica["url"], 600, proc)
    config = {"fleet_name": "exitplan", "models": models, "fractions": [m.fraction for m in plan.models],
              "router": str(router), "embedder": str(params.checkpoint_path(params.plan.embedder)),
              "replicas": replicas, "max_in_flight": 256, "request_timeout_s": 300, "cooldown_s": 5,
              "routing_window": 512}
    path = params.root / ".cache" / "bench-fleet.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(config))
    port = free_port()
    fleet.coordinator_url = f"http://127.0.0.1:{port}"
    fleet.processes.append(subprocess.Popen([python, "-m", "serving.coordinator_server", "--fleet", str(path),
                                             "--port", str(port)], cwd=params.root, env=env))
    wait_healthy(fleet.coordinator_url, 300, fleet.processes[-1])
    return fleet, config


async def one(client: httpx.AsyncClient, url: str, prompt: str, tokens: int, stream: bool) -> dict:
    body = {"model": "exitplan", "prompt": prompt, "max_tokens": tokens, "stream": stream}
    started = time.perf_counter()
    if not stream:
        reply = await client.post(f"{url}/v1/completions", json=body)
        reply.raise_for_status()
        return {"seconds": time.perf_counter() - started, "model": reply.headers["x-exitplan-model"],
                "tokens": reply.json()["usage"]["completion_tokens"]}
    first, chunks = None, 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
        reply.raise_for_status()
        model = reply.headers["x-exitplan-model"]
        async for line in reply.aiter_lines():
            if line.startswith("data: {"):
                chunks += 1
                first = first or time.perf_counter()
    end = time.perf_counter()
    return {"seconds": end - started, "ttft": (first or end) - started, "model": model, "tokens": chunks,
            "tpot": (end - first) / max(chunks - 1, 1) if first else float("nan")}


async def load(url: str, prompts: list[str], tokens: int, stream: bool, concurrency: int) -> tuple[list, float]:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def bounded(p: str) -> dict:
            async with gate:
                return await one(client, url, p, tokens, stream)

        started = time.perf_counter()
        results = await asyncio.gather(*(bounded(p) for p in prompts))
        return results, time.perf_counter() - started


def pct(values, q) -> float:
    return float(np.percentile(np.asarray(values, float), q))


def main() -> None:
    args, params = start(__doc__)
    plan_dir = params.path(params.plan.output_dir) / params.plan.scenarios[0].name
    plan, router = read_plan(plan_dir / PLAN_FILE), plan_dir / ROUTER_FILE
    if not router.is_file():
        sys.exit(f"no routing model at {router}: run `make run` first")
    count, tokens, concurrency = (48, 12, 8) if args.quick else (96, 24, 8)
    queries = pd.read_parquet(queries_path(params))
    queries = queries.sample(frac=1.0, random_state=0)
    prompts = [p[:600] for p in queries["prompt"].head(2 * count)]
    fleet, config = launch(params, plan, router, args.quick)
    try:
        streamed, s_seconds = asyncio.run(load(fleet.coordinator_url, prompts[:count], tokens, True, concurrency))
        whole, w_seconds = asyncio.run(load(fleet.coordinator_url, prompts[count:], tokens, False, concurrency))
        stats = httpx.get(f"{fleet.coordinator_url}/stats", timeout=30).json()
    finally:
        fleet.stop()
    results = streamed + whole
    planned = dict(zip(config["models"], config["fractions"], strict=True))
    realised = {m: sum(r["model"] == m for r in results) / len(results) for m in planned}
    err = max(abs(realised[m] - planned[m]) for m in planned)
    overhead = np.asarray(stats["overhead_ms"], float)
    scorer = stats["scorer"]
    print(f"{len(results)} requests ({count} streamed, {count} whole), {tokens} tokens each, {concurrency} clients; "
          f"engines: {'SmolLM2-135M under the plan models names' if args.quick else 'the plan models'}")
    print(f"{'phase':<10}{'seconds':>9}{'req/s':>8}{'tok/s':>8}{'p50 s':>8}{'p95 s':>8}")
    for name, rows, secs in (("streamed", streamed, s_seconds), ("whole", whole, w_seconds)):
        lat = [r["seconds"] for r in rows]
        print(f"{name:<10}{secs:>9.2f}{len(rows) / secs:>8.2f}{sum(r['tokens'] for r in rows) / secs:>8.1f}"
              f"{pct(lat, 50):>8.3f}{pct(lat, 95):>8.3f}")
    ttft, tpot = [r["ttft"] for r in streamed], [r["tpot"] for r in streamed if np.isfinite(r["tpot"])]
    print(f"TTFT ms p50 {1000 * pct(ttft, 50):.1f} p95 {1000 * pct(ttft, 95):.1f}; "
          f"TPOT ms p50 {1000 * pct(tpot, 50):.1f} p95 {1000 * pct(tpot, 95):.1f}")
    print(f"{'model':<40}{'planned':>9}{'realised':>10}")
    for m, share in planned.items():
        print(f"{m:<40}{share:>9.3f}{realised[m]:>10.3f}")
    print(f"coordinator own time per request ms: p50 {np.median(overhead):.3f} p95 {np.percentile(overhead, 95):.3f} "
          f"(target < 2 ms; {len(overhead)} requests); retries {stats['retries']}")
    print(f"routing scorer (MiniLM + ridge), apart: {scorer['batches']} batches for {scorer['requests']} requests "
          f"(mean batch {scorer['requests'] / max(scorer['batches'], 1):.2f}), model time "
          f"{1000 * scorer['model_seconds'] / max(scorer['batches'], 1):.1f} ms per batch, "
          f"{1000 * scorer['model_seconds'] / max(scorer['requests'], 1):.1f} ms per request; wait per request "
          f"(queue + batching + model) {1000 * scorer['wait_seconds'] / max(scorer['requests'], 1):.1f} ms")
    print(f"RESULT throughput_rps={len(whole) / w_seconds:.3f} ttft_p95_ms={1000 * pct(ttft, 95):.1f} "
          f"routing_fraction_err={err:.3f} coordinator_overhead_ms={np.median(overhead):.3f}")


if __name__ == "__main__":
    main()
