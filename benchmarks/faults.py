"""Faults under load, on loopback: kill -9 of a replica mid-stream, its restart, a burst beyond the queues, and
malformed or hostile requests, through the real coordinator.

Processes: three engine servers (``python -m serving.server``, SmolLM2-135M under the plan models' names: two
replicas of the small model, one of the large) and the coordinator (``python -m serving.coordinator_server``) with
the plan's real routing model, all requiring an API key from ``$EXITPLAN_API_KEY``. Client threads send a steady
load of real workload prompts, half streamed, half whole, half routed by the fleet name and half pinned to the small
model (so the victim carries streams when it dies). On that load:

1. kill -9 of one small-model replica with streams in flight on it;
2. its restart on the same port;
3. a burst of concurrent requests beyond the coordinator's and the replicas' queues;
4. malformed requests: bad JSON, NaN, a seed beyond torch's range, a body over the limit, a wrong key, an unknown
   model, a prompt that cannot fit the context.

Every request is classified from the client's side: answered (a whole answer, or a stream with one finish and
``[DONE]``), refused (429, 503 or another 4xx, with an OpenAI error body), ended by an error event (a stream whose
replica died after its first byte), a 5xx, lost (no answer and no error: a connection error, a stream cut without
``[DONE]``) or duplicated (a stream with two finishes, or text after its error). A monitor compares the coordinator's
``/health`` count of live small-model replicas with the truth (the victim's own ``/health``) every 50 ms; the longest
disagreement is ``max_health_lie_s``.

Last line: ``RESULT lost=... duplicated=... error_events=... http_5xx=... max_health_lie_s=...``.
Targets: lost=0, duplicated=0, http_5xx=0.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pandas as pd
from common import free_port, start

from exitplan.artifacts import PLAN_FILE, ROUTER_FILE, queries_path
from exitplan.deploy import LocalFleet, wait_healthy
from exitplan.planner.plan_file import Plan, read_plan

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
KEY = "faults-bench-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def engine(root: Path, name: str, port: int, env: dict) -> subprocess.Popen:
    """An engine server process serving SmolLM2 as ``name``."""
    return subprocess.Popen([sys.executable, "-m", "serving.server", "--model", SMOLLM2, "--served-name", name,
                             "--port", str(port), "--memory-gib", "1", "--max-context", "1024", "--max-queue", "8"],
                            cwd=root, env=env, stderr=subprocess.DEVNULL)


def launch(params, plan: Plan, router: Path) -> tuple[LocalFleet, list[str], dict, dict]:
    """Three engine servers and the coordinator, healthy; returns the fleet, the models, the replicas' URLs by
    role and the processes' environment."""
    env = {**os.environ, "PYTHONPATH": str(params.root), "EXITPLAN_API_KEY": KEY}
    models = plan.model_ids
    fleet, urls = LocalFleet(""), {}
    for role, model in (("victim", models[0]), ("survivor", models[0]), ("large", models[1])):
        port = free_port()
        fleet.processes.append(engine(params.root, model, port, env))
        urls[role] = f"http://127.0.0.1:{port}"
    for url, proc in zip(urls.values(), fleet.processes, strict=True):
        wait_healthy(url, 300, proc)
    replicas = [{"model": models[0], "url": urls["victim"], "weight": 0.5},
                {"model": models[0], "url": urls["survivor"], "weight": 0.5},
                {"model": models[1], "url": urls["large"], "weight": 1.0}]
    config = {"fleet_name": "exitplan", "models": models, "fractions": [m.fraction for m in plan.models],
              "router": str(router), "embedder": str(params.checkpoint_path(params.plan.embedder)),
              "replicas": replicas, "max_in_flight": 48, "request_timeout_s": 120, "cooldown_s": 5,
              "routing_window": 512, "max_attempts": 2, "failure_threshold": 3, "health_interval_s": 0.25}
    path = params.root / ".cache" / "faults-fleet.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(config))
    port = free_port()
    fleet.coordinator_url = f"http://127.0.0.1:{port}"
    fleet.processes.append(subprocess.Popen([sys.executable, "-m", "serving.coordinator_server", "--fleet", str(path),
                                             "--port", str(port)], cwd=params.root, env=env))
    wait_healthy(fleet.coordinator_url, 300, fleet.processes[-1])
    return fleet, models, urls, env


def refusal(status: int) -> str:
    """The class of a refusal: 429 (back-pressure), 503 (no replica / draining) or another 4xx."""
    return {429: "429", 503: "503"}.get(status, "4xx")


def whole(client: httpx.Client, url: str, body: dict) -> str:
    """Outcome of one whole request."""
    try:
        reply = client.post(f"{url}/v1/completions", json=body, headers=AUTH)
    except httpx.HTTPError:
        return "lost"
    if reply.status_code >= 500 and reply.status_code != 503:
        return "http_5xx"
    if reply.status_code >= 400:
        return refusal(reply.status_code) if reply.json().get("error") else "lost"
    return "answered" if reply.json()["choices"][0]["finish_reason"] else "lost"


def streamed(client: httpx.Client, url: str, body: dict) -> str:
    """Outcome of one streamed request."""
    finishes, errors, after_error, done = 0, 0, 0, False
    try:
        with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, headers=AUTH) as reply:
            if reply.status_code >= 400:
                reply.read()
                return "http_5xx" if reply.status_code >= 500 and reply.status_code != 503 else \
                    refusal(reply.status_code)
            for line in reply.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    errors += 1
                    continue
                after_error += errors > 0
                finishes += bool(event["choices"][0]["finish_reason"])
    except httpx.HTTPError:
        return "lost"
    if finishes > 1 or after_error or (finishes and errors):
        return "duplicated"
    if not done:
        return "lost"
    return "answered" if finishes == 1 else "error_event" if errors else "lost"


class Load:
    """Client threads sending a steady load until stopped."""

    def __init__(self, url: str, prompts: list[str], small: str, tokens: int, clients: int) -> None:
        self.url, self.prompts, self.small, self.tokens = url, prompts, small, tokens
        self.outcomes: Counter[str] = Counter()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def _client(self, index: int) -> None:
        with httpx.Client(timeout=300) as client:
            n = index
            while not self.stop.is_set():
                body = {"model": self.small if n % 2 else "exitplan", "prompt": self.prompts[n % len(self.prompts)],
                        "max_tokens": self.tokens}
                outcome = (streamed if (n // 2) % 2 == 0 else whole)(client, self.url, body)
                self.outcomes[outcome] += 1
                n += len(self.threads)


class HealthMonitor:
    """Every 50 ms: the coordinator's count of live small-model replicas vs the truth; the longest disagreement."""

    def __init__(self, url: str, victim_url: str, small: str) -> None:
        self.url, self.victim_url, self.small = url, victim_url, small
        self.stop = threading.Event()
        self.longest = 0.0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _up(self, client: httpx.Client, url: str) -> bool:
        try:
            return client.get(f"{url}/health", timeout=0.5).status_code == 200
        except httpx.HTTPError:
            return False

    def _run(self) -> None:
        since = None
        with httpx.Client() as client:
            while not self.stop.is_set():
                truth = 1 + self._up(client, self.victim_url)
                try:
                    said = client.get(f"{self.url}/health", timeout=1).json()["replicas_up"][self.small]
                except (httpx.HTTPError, KeyError, ValueError):
                    said = -1
                now = time.monotonic()
                if said != truth:
                    since = since or now
                    self.longest = max(self.longest, now - since)
                else:
                    since = None
                time.sleep(0.05)


def burst(url: str, prompt: str, size: int) -> Counter[str]:
    """``size`` whole requests at once."""
    with httpx.Client(timeout=300, limits=httpx.Limits(max_connections=size)) as client, \
            concurrent.futures.ThreadPoolExecutor(size) as pool:
        body = {"model": "exitplan", "prompt": prompt, "max_tokens": 24}
        return Counter(pool.map(lambda _: whole(client, url, body), range(size)))


def malformed(url: str, small: str) -> dict[str, int]:
    """Hostile requests; each one's status."""
    post = f"{url}/v1/completions"
    json_headers = {**AUTH, "content-type": "application/json"}
    cases = {
        "bad JSON": {"content": b'{"model": ', "headers": json_headers},
        "NaN temperature": {"content": b'{"model": "exitplan", "prompt": "x", "temperature": NaN}',
                            "headers": json_headers},
        "seed 2**64": {"json": {"model": small, "prompt": "x", "seed": 2**64}, "headers": AUTH},
        "2 MiB body": {"content": b'{"prompt": "' + b"x" * (2 << 20) + b'"}', "headers": json_headers},
        "wrong key": {"json": {"model": "exitplan", "prompt": "x"}, "headers": {"Authorization": "Bearer nope"}},
        "unknown model": {"json": {"model": "gpt-9", "prompt": "x"}, "headers": AUTH},
        "prompt over the context": {"json": {"model": small, "prompt": "word " * 3000, "max_tokens": 8},
                                    "headers": AUTH},
    }
    return {name: httpx.post(post, timeout=60, **kwargs).status_code for name, kwargs in cases.items()}


def main() -> None:
    args, params = start(__doc__)
    plan_dir = params.path(params.plan.output_dir) / params.plan.scenarios[0].name
    router = plan_dir / ROUTER_FILE
    if not router.is_file():
        sys.exit(f"no routing model at {router}: run `make run` first")
    plan = read_plan(plan_dir / PLAN_FILE)
    steady_s, tokens, clients, burst_size = (40, 48, 6, 120) if args.quick else (120, 64, 8, 240)
    queries = pd.read_parquet(queries_path(params))
    prompts = [p[:400] for p in queries.sample(frac=1.0, random_state=0)["prompt"].head(200)]
    fleet, models, urls, env = launch(params, plan, router)
    small, timeline = models[0], []
    victim_port = int(urls["victim"].rsplit(":", 1)[1])
    load, monitor = Load(fleet.coordinator_url, prompts, small, tokens, clients), \
        HealthMonitor(fleet.coordinator_url, urls["victim"], small)
    started = time.monotonic()
    try:
        monitor.thread.start()
        for t in load.threads:
            t.start()
        time.sleep(4.0)  # steady state: streams on the victim are past their first token
        deadline = time.monotonic() + 30
        while httpx.get(f"{urls['victim']}/health").json()["in_flight"] < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        fleet.processes[0].send_signal(signal.SIGKILL)
        fleet.processes[0].wait()
        timeline.append((time.monotonic() - started, "kill -9 of a small-model replica"))
        time.sleep(steady_s * 0.15)
        fleet.processes[0] = engine(params.root, small, victim_port, env)
        wait_healthy(urls["victim"], 300, fleet.processes[0])
        timeline.append((time.monotonic() - started, "the replica restarted and healthy"))
        time.sleep(steady_s * 0.1)
        bursts = burst(fleet.coordinator_url, prompts[0], burst_size)
        timeline.append((time.monotonic() - started, f"burst of {burst_size} requests done"))
        statuses = malformed(fleet.coordinator_url, small)
        timeline.append((time.monotonic() - started, "malformed requests done"))
        while time.monotonic() - started < steady_s:
            time.sleep(0.2)
        load.stop.set()
        for t in load.threads:
            t.join(timeout=300)
        monitor.stop.set()
        monitor.thread.join(timeout=10)
        stats = httpx.get(f"{fleet.coordinator_url}/stats", headers=AUTH, timeout=30).json()
    finally:
        fleet.stop()
    total = load.outcomes + bursts
    malformed_5xx = sum(s >= 500 for s in statuses.values())
    print(f"engines: SmolLM2-135M under the plan models' names (2 x {small}, 1 x {models[1]}); {clients} clients, "
          f"{tokens} tokens, half streamed; coordinator max_in_flight 48, replica max_queue 8")
    for at, what in timeline:
        print(f"  t={at:6.1f} s  {what}")
    columns = ("answered", "429", "503", "4xx", "error_event", "http_5xx", "lost", "duplicated")
    print(f"{'phase':<10}" + "".join(f"{k:>12}" for k in columns))
    for name, counts in (("steady", load.outcomes), ("burst", bursts), ("all", total)):
        print(f"{name:<10}" + "".join(f"{counts.get(k, 0):>12}" for k in columns))
    print("malformed: " + ", ".join(f"{k} -> {v}" for k, v in statuses.items()))
    print(f"coordinator: {stats['retries']} retries, {stats['failed_streams']} streams ended by an error event; "
          f"replicas {[(r['url'].rsplit(':', 1)[1], r['served'], r['failures']) for r in stats['replicas']]} "
          f"(port, served, failures); longest /health disagreement {monitor.longest:.2f} s")
    print(f"RESULT lost={total.get('lost', 0)} duplicated={total.get('duplicated', 0)} "
          f"error_events={total.get('error_event', 0)} http_5xx={total.get('http_5xx', 0) + malformed_5xx} "
          f"max_health_lie_s={monitor.longest:.2f}")


if __name__ == "__main__":
    main()
