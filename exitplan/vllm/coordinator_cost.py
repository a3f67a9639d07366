"""What the fleet's coordinator costs the cores of a host it shares with its replicas: CPU seconds per streamed
token it relays and per request it routes (its embedder scores the prompt), measured on the real coordinator process
(``serving.coordinator_server``, started as ``exitplan deploy`` starts it) in front of the profiled replicas.

On a host whose cores the replicas fill (this machine: one core per replica), the coordinator has no core of its own:
while every replica is busy, its work is taken from theirs (:mod:`exitplan.simulator.colocation`). The routing model
it runs here has zero weights: a score costs the embedder's pass whatever the weights are.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from exitplan.atomic import write_json
from exitplan.config import Params
from exitplan.errors import ExitplanError
from exitplan.files import read_json
from exitplan.ports import free_port
from exitplan.routing.router_file import FORMAT

STREAMS = 4
"""Streams relayed to each replica at once while the relay is timed (a decode batch of each)."""

ROUTED = 16
"""Workload prompts routed one at a time while the coordinator's CPU per request is read."""


@dataclass(frozen=True)
class CoordinatorCost:
    """The coordinator's CPU per unit of work.

    Attributes:
        relay_cpu_s: CPU seconds per streamed token (one server-sent event) it relays.
        score_cpu_s: CPU seconds per request it routes: the prompt's score and the request's own handling.
    """

    relay_cpu_s: float
    score_cpu_s: float


def fleet_file(params: Params, replicas: Sequence[tuple[str, str]], workdir: Path) -> Path:
    """A fleet file over ``replicas`` (``(url, model)``, two or more models) with a zero-weight routing model of the
    plan's embedder, written into ``workdir``."""
    models = list(dict.fromkeys(model for _, model in replicas))
    embedder = params.checkpoint_path(params.plan.embedder)
    width = int(read_json(embedder / "config.json", f"config of {embedder}")["hidden_size"])
    router = write_json(workdir / "router.json", {
        "format": FORMAT, "embedder": params.plan.embedder, "models": models, "coef": [[0.0] * width] * len(models),
        "intercept": [0.0] * len(models), "window": [0.0, 1.0]})
    section = params.deploy
    return write_json(workdir / "fleet.json", {
        "fleet_name": section.fleet_name, "models": models, "fractions": [1 / len(models)] * len(models),
        "thresholds": [], "router": str(router), "embedder": str(embedder),
        "replicas": [{"model": m, "url": u, "weight": 1.0} for u, m in replicas],
        "max_in_flight": section.max_in_flight, "request_timeout_s": section.request_timeout_s,
        "cooldown_s": section.cooldown_s})


def _cpu_s(pid: int) -> float:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


async def _relay(url: str, models: Sequence[str], tokens: int, headers: dict[str, str]) -> int:
    """Events received over ``STREAMS`` streams per model through the coordinator at ``url``."""
    async def one(client: httpx.AsyncClient, model: str, k: int) -> int:
        body = {"model": model, "prompt": f"{k} Write a long story about the sea.", "max_tokens": tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as reply:
            reply.raise_for_status()
            return sum([line.startswith("data: {") async for line in reply.aiter_lines()])

    async with httpx.AsyncClient(timeout=600) as client:
        counts = await asyncio.gather(*(one(client, m, k) for m in models for k in range(STREAMS)))
    return int(sum(counts))


def _route(url: str, fleet_name: str, prompts: Sequence[str], headers: dict[str, str]) -> None:
    """Each prompt routed by the fleet's name, one at a time, for one token."""
    with httpx.Client(timeout=600) as client:
        for prompt in prompts:
            client.post(f"{url}/v1/completions", json={"model": fleet_name, "prompt": prompt, "max_tokens": 1},
                        headers=headers).raise_for_status()


def measure_coordinator_cost(params: Params, replicas: Sequence[tuple[str, str]], prompts: Sequence[str],
                             tokens: int, workdir: Path) -> CoordinatorCost:
    """Start the coordinator in front of ``replicas`` and read its CPU time over a relayed batch and routed prompts.

    Args:
        params: Run parameters (the ``deploy`` section's knobs, the plan's embedder).
        replicas: ``(url, model)`` of each replica up (two or more models).
        prompts: Prompts routed one at a time (the workload's: the score's cost grows with the prompt's tokens).
        tokens: Tokens each relayed stream decodes.
        workdir: Folder of its fleet file and routing model.

    Raises:
        ExitplanError: when the coordinator does not come up, or a request through it fails.
    """
    from exitplan.deploy import wait_healthy

    if len({m for _, m in replicas}) < 2 or not prompts:
        raise ExitplanError("the coordinator's cost needs replicas of two models and prompts to route")
    port, key = free_port(), os.environ.get(params.deploy.api_key_env)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    cmd = [sys.executable, "-m", "serving.coordinator_server", "--fleet", str(fleet_file(params, replicas, workdir)),
           "--host", "127.0.0.1", "--port", str(port), "--api-key-env", params.deploy.api_key_env]
    proc = subprocess.Popen(cmd, cwd=params.root, env={**os.environ, "PYTHONPATH": str(params.root)})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, params.deploy.startup_timeout_s, proc)
        models = list(dict.fromkeys(m for _, m in replicas))
        _route(url, params.deploy.fleet_name, prompts[:1], headers)  # warm: the embedder's first pass
        asyncio.run(_relay(url, models, 2, headers))
        began = _cpu_s(proc.pid)
        events = asyncio.run(_relay(url, models, tokens, headers))
        relayed = _cpu_s(proc.pid)
        _route(url, params.deploy.fleet_name, prompts, headers)
        routed = _cpu_s(proc.pid)
    except httpx.HTTPError as exc:
        raise ExitplanError(f"a request through the coordinator failed while timing it: {exc}") from exc
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return CoordinatorCost(relay_cpu_s=(relayed - began) / max(events, 1),
                           score_cpu_s=(routed - relayed) / len(prompts))
