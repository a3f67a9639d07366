"""The fleet coordinator: routing score -> model by the plan's thresholds -> replica by the plan's split -> forward.

Clients speak OpenAI's API to the coordinator, naming the fleet (``fleet_name``) to be routed or a plan model to pin
it. Each request's score (:mod:`serving.scorer`) picks the model: thresholds are re-cut every request from a sliding
window of recent scores at the plan's cumulative fractions, so the realised split tracks the plan while the score
distribution drifts. A replica of that model is picked by smooth weighted round-robin over the plan's replica
weights, and the request is forwarded over HTTP (our engine server or vLLM: the same protocol) and streamed back.

Faults: a replica that refuses the connection, times out, answers 5xx or 429 is taken out of rotation for
``cooldown_s`` and the request goes to another replica of the same model - only before a byte reached the client, so
no request is lost or answered twice. The coordinator bounds its in-flight requests (429 + ``Retry-After``) and
validates requests itself (4xx, never 5xx, for a malformed one).
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram

from exitplan.routing.fractions import check_fractions, route, thresholds
from serving.api import ApiError, check_key, install_error_handlers, sse
from serving.openai_schema import ChatRequest, CompletionRequest, error_body
from serving.scorer import BatchingScorer

RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout,
             httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


@dataclass
class Replica:
    """One replica of a model.

    Attributes:
        model: Model it serves.
        url: Base URL (``http://host:port``).
        weight: Share of its model's load (the plan's replica weight).
        current: Smooth weighted round-robin state.
        down_until: ``time.monotonic()`` before which it is out of rotation.
        served: Requests it answered.
        failures: Failures seen.
    """

    model: str
    url: str
    weight: float
    current: float = 0.0
    down_until: float = 0.0
    served: int = 0
    failures: int = 0

    @property
    def up(self) -> bool:
        """In rotation."""
        return time.monotonic() >= self.down_until


class ReplicaSet:
    """The replicas of one model, picked by smooth weighted round-robin (nginx's): deterministic, and after any n
    picks each replica's count is within one of ``n x weight``."""

    def __init__(self, replicas: Sequence[Replica]) -> None:
        if not replicas or any(r.weight <= 0 for r in replicas):
            raise ValueError("a model needs replicas with positive weights")
        self.replicas = list(replicas)

    def pick(self, exclude: set[str] = frozenset()) -> Replica | None:
        """The next replica in rotation, not in ``exclude`` (None: none left)."""
        live = [r for r in self.replicas if r.up and r.url not in exclude]
        if not live:
            return None
        total = sum(r.weight for r in live)
        for r in live:
            r.current += r.weight
        chosen = max(live, key=lambda r: r.current)
        chosen.current -= total
        return chosen


class ThresholdRouter:
    """Model choice by score thresholds, re-cut on a sliding window of scores at the plan's fractions.

    Args:
        fractions: The plan's load fraction per model, smallest first.
        initial_window: Scores the plan's thresholds were cut from (seeds the window).
        window: Scores kept.
    """

    def __init__(self, fractions: Sequence[float], initial_window: Sequence[float], window: int = 512) -> None:
        self.fractions = check_fractions(fractions)
        self.window: deque[float] = deque(np.asarray(initial_window, float)[-window:], maxlen=window)
        self.cuts = thresholds(np.asarray(self.window), self.fractions)
        self.routed = np.zeros(len(self.fractions), int)

    def route(self, score: float) -> int:
        """Model index for ``score``; the score then joins the window and the thresholds are re-cut."""
        index = int(route(np.array([score]), self.cuts)[0])
        self.window.append(score)
        self.cuts = thresholds(np.asarray(self.window), self.fractions)
        self.routed[index] += 1
        return index


@dataclass
class CoordinatorStats:
    """The coordinator's own time per request (seconds: total minus the replica and the scorer's whole wait), and
    the attempts moved to another replica. The scorer keeps its own figures (:class:`~serving.scorer.BatchStats`)."""

    overhead: deque[float] = field(default_factory=lambda: deque(maxlen=100_000))
    retries: int = 0


def prompt_text(body: CompletionRequest | ChatRequest) -> str:
    """What the router scores: the prompt, or the chat's messages."""
    if isinstance(body, ChatRequest):
        return "\n".join(m.content for m in body.messages)
    return body.prompt


class Coordinator:
    """Routes and forwards requests (see the module docstring).

    Args:
        models: Plan models, smallest first.
        router: Threshold router over ``models``.
        replicas: Model -> its replica set.
        scorer: Batching routing scorer.
        fleet_name: Model name clients use to be routed.
        max_in_flight: Requests in flight before 429.
        request_timeout_s: Per-attempt timeout to a replica.
        cooldown_s: How long a failed replica stays out of rotation.
    """

    def __init__(self, models: Sequence[str], router: ThresholdRouter, replicas: dict[str, ReplicaSet],
                 scorer: BatchingScorer, fleet_name: str = "exitplan", max_in_flight: int = 256,
                 request_timeout_s: float = 120.0, cooldown_s: float = 5.0) -> None:
        self.models, self.router, self.replicas, self.scorer = list(models), router, replicas, scorer
        self.fleet_name, self.max_in_flight = fleet_name, max_in_flight
        self.timeout, self.cooldown_s = request_timeout_s, cooldown_s
        self.in_flight = 0
        self.stats = CoordinatorStats()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s, connect=2.0),
                                         limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))
        self.registry = CollectorRegistry()
        self.routed = Counter("exitplan_routed", "Requests routed per model", ["model"], registry=self.registry)
        self.retried = Counter("exitplan_retries", "Attempts moved to another replica", registry=self.registry)
        self.down = Counter("exitplan_replica_down", "Replicas taken out of rotation", ["replica"],
                            registry=self.registry)
        self.overhead = Histogram("exitplan_coordinator_overhead_seconds", "Coordinator time per request, without "
                                  "the replica and the scorer model", registry=self.registry,
                                  buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.05))

    def choose(self, body: CompletionRequest | ChatRequest, score: float | None) -> str:
        """The model that serves ``body``: pinned by name, or routed by its score."""
        if body.model in self.models:
            return body.model
        if body.model != self.fleet_name:
            raise ApiError(404, f"model '{body.model}' is neither the fleet '{self.fleet_name}' nor one of its "
                                f"models {self.models}", code="model_not_found")
        model = self.models[self.router.route(score)]
        self.routed.labels(model).inc()
        return model

    def _mark_down(self, replica: Replica) -> None:
        replica.failures += 1
        replica.down_until = time.monotonic() + self.cooldown_s
        self.down.labels(replica.url).inc()

    async def _attempts(self, model: str) -> AsyncIterator[Replica]:
        """Replicas to try for one request, each at most once."""
        tried: set[str] = set()
        while (replica := self.replicas[model].pick(tried)) is not None:
            tried.add(replica.url)
            if len(tried) > 1:
                self.stats.retries += 1
                self.retried.inc()
            yield replica
        raise ApiError(503, f"no replica of {model} is available", "server_error", "no_replica",
                       {"Retry-After": str(int(self.cooldown_s))})

    async def forward(self, path: str, payload: dict[str, Any], model: str) -> tuple[dict[str, Any], float]:
        """A whole answer from a replica of ``model``, retried on another one on failure; returns it and the
        seconds spent waiting on replicas."""
        waited = 0.0
        async for replica in self._attempts(model):
            started = time.perf_counter()
            try:
                reply = await self.client.post(f"{replica.url}{path}", json=payload)
            except RETRYABLE:
                waited += time.perf_counter() - started
                self._mark_down(replica)
                continue
            waited += time.perf_counter() - started
            if reply.status_code == 429 or reply.status_code >= 500:
                self._mark_down(replica)
                continue
            if reply.status_code >= 400:
                raise ApiError(reply.status_code, reply.json().get("error", {}).get("message", reply.text))
            replica.served += 1
            return reply.json(), waited
        raise AssertionError("unreachable")  # _attempts raises when replicas run out

    async def stream(self, path: str, payload: dict[str, Any], model: str, t0: float,
                     scorer_s: float) -> AsyncIterator[str]:
        """Server-sent events from a replica; moves to another replica only before the first byte."""
        try:
            async for replica in self._attempts(model):
                try:
                    async with self.client.stream("POST", f"{replica.url}{path}", json=payload) as reply:
                        if reply.status_code == 429 or reply.status_code >= 500:
                            self._mark_down(replica)
                            continue
                        if reply.status_code >= 400:
                            body = json.loads(await reply.aread())
                            yield sse(body)
                            yield sse("[DONE]")
                            return
                        async for line in reply.aiter_lines():
                            if line:
                                yield line + "\n\n"
                        replica.served += 1
                        return
                except RETRYABLE:
                    self._mark_down(replica)
                    continue
        except ApiError as exc:
            yield sse(error_body(exc.message, exc.kind, exc.code))
            yield sse("[DONE]")
        finally:
            self.in_flight -= 1

    async def handle(self, body: CompletionRequest | ChatRequest, path: str) -> Any:
        """Score, choose, forward; account the coordinator's own time."""
        if self.in_flight >= self.max_in_flight:
            raise ApiError(429, f"coordinator busy: {self.in_flight} requests in flight", "rate_limit_error",
                           "queue_full", {"Retry-After": "1"})
        t0 = time.perf_counter()
        self.in_flight += 1
        try:
            score, _, scorer_s = (await self.scorer.score(prompt_text(body))) if body.model == self.fleet_name \
                else (None, 0.0, 0.0)
            model = self.choose(body, score)
            payload = {**body.model_dump(exclude_none=True), "model": model}
        except BaseException:
            self.in_flight -= 1
            raise
        if body.stream:  # the coordinator's own time of a stream: up to forwarding (relaying is I/O)
            own = max(time.perf_counter() - t0 - scorer_s, 0.0)
            self.stats.overhead.append(own)
            self.overhead.observe(own)
            return StreamingResponse(self.stream(path, payload, model, t0, scorer_s), media_type="text/event-stream",
                                     headers={"x-exitplan-model": model})
        try:
            answer, waited = await self.forward(path, payload, model)
        finally:
            self.in_flight -= 1
        own = max(time.perf_counter() - t0 - waited - scorer_s, 0.0)
        self.stats.overhead.append(own)
        self.overhead.observe(own)
        return JSONResponse(answer, headers={"x-exitplan-model": model})


def create_coordinator_app(coordinator: Coordinator, api_key: str | None = None) -> FastAPI:
    """The coordinator's OpenAI-compatible app."""
    from contextlib import asynccontextmanager

    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await coordinator.scorer.close()
        await coordinator.client.aclose()

    app = FastAPI(title="exitplan coordinator", lifespan=lifespan)
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HttpRequest) -> Any:
        check_key(http, api_key)
        return await coordinator.handle(body, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: HttpRequest) -> Any:
        check_key(http, api_key)
        return await coordinator.handle(body, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(http: HttpRequest) -> dict[str, Any]:
        check_key(http, api_key)
        names = [coordinator.fleet_name, *coordinator.models]
        return {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "exitplan"} for n in names]}

    @app.get("/health")
    async def health() -> JSONResponse:
        up = {m: sum(r.up for r in s.replicas) for m, s in coordinator.replicas.items()}
        ok = all(up.values())
        return JSONResponse({"status": "ok" if ok else "degraded", "replicas_up": up}, status_code=200)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(coordinator.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        s = coordinator.stats
        return {"routed": dict(zip(coordinator.models, coordinator.router.routed.tolist(), strict=True)),
                "fractions": coordinator.router.fractions.tolist(), "retries": s.retries,
                "overhead_ms_p50": 1000 * float(np.median(s.overhead)) if s.overhead else None,
                "overhead_ms_p95": 1000 * float(np.percentile(s.overhead, 95)) if s.overhead else None,
                "overhead_ms": [1000 * x for x in list(s.overhead)[-10_000:]],
                "replicas": [{"url": r.url, "model": r.model, "served": r.served, "failures": r.failures}
                             for rs in coordinator.replicas.values() for r in rs.replicas],
                "scorer": vars(coordinator.scorer.stats) | {"sizes": list(coordinator.scorer.stats.sizes)[-50:]}}

    return app
