"""The fleet coordinator: routing score -> model by the plan's thresholds -> replica by the plan's split -> forward.

Clients speak OpenAI's API to the coordinator, naming the fleet (``fleet_name``) to be routed or a plan model to pin
it. Each request's score (:mod:`serving.scorer`) picks the model: thresholds are re-cut every request from a sliding
window of recent scores at the plan's cumulative fractions, so the realised split tracks the plan while the score
distribution drifts. A replica of that model is picked by smooth weighted round-robin over the plan's replica
weights, and the request is forwarded over HTTP (our engine server or vLLM: the same protocol) and streamed back.

Faults, by class:

- A replica's 4xx (other than 429) is the request's fault: passed through with its status, the replica stays.
- A 429 is back-pressure: the request tries another replica; when all are busy the client gets 429 with
  ``Retry-After``. It never counts against a replica.
- A lost connection or a timeout takes the replica out of rotation until a health probe passes; a 5xx counts
  against it, and ``failure_threshold`` of them in a row take it out for ``cooldown_s``. Either way the request
  moves to another replica, at most ``max_attempts`` of them, so one bad request cannot take a model out.
- Only before the first byte reached the client. After it, a replica failure ends the stream with an OpenAI-style
  error event (and counts the stream as failed): a client never receives two answers.

Every replica is probed (``GET /health``) before the coordinator serves and every ``health_interval_s`` after, so a
replica that never started or was killed is not counted up, and ``/health`` answers 503 when some model has no
replica up. The coordinator bounds its in-flight requests (429 + ``Retry-After``), validates requests itself (4xx,
never 5xx, for a malformed one), guards every route but ``/health`` with the API key (:mod:`serving.guard`), and
drains on SIGTERM (:mod:`serving.lifecycle`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram

from exitplan.routing.fractions import check_fractions, route, thresholds
from serving.api import ApiError, ClientGone, install_error_handlers, sse, unless, unless_disconnected
from serving.guard import DEFAULT_MAX_BODY_BYTES, Drain, Guard
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
        healthy: Its last health probe passed and no connection to it failed since (the coordinator's lifespan
            probes every replica before it serves, so a replica that never started is never counted up).
        down_until: ``time.monotonic()`` before which it is out of rotation (the 5xx breaker's cooldown).
        served: Requests it answered.
        failures: Failures seen (lost connections, timeouts, 5xx).
        consecutive_5xx: 5xx answers since its last success.
    """

    model: str
    url: str
    weight: float
    current: float = 0.0
    healthy: bool = True
    down_until: float = 0.0
    served: int = 0
    failures: int = 0
    consecutive_5xx: int = 0

    @property
    def up(self) -> bool:
        """In rotation."""
        return self.healthy and time.monotonic() >= self.down_until


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
    """The coordinator's own time per request (seconds: total minus the replica and the scorer's whole wait), the
    attempts moved to another replica, and the streams ended by an error event after their first byte. The scorer
    keeps its own figures (:class:`~serving.scorer.BatchStats`)."""

    overhead: deque[float] = field(default_factory=lambda: deque(maxlen=100_000))
    retries: int = 0
    failed_streams: int = 0


def prompt_text(body: CompletionRequest | ChatRequest) -> str:
    """What the router scores: the prompt, or the chat's messages."""
    if isinstance(body, ChatRequest):
        return "\n".join(m.content for m in body.messages)
    return body.prompt


def upstream_error(status: int, raw: bytes) -> ApiError:
    """A replica's error answer as the coordinator's (same status; its OpenAI error body when it sent one)."""
    try:
        error = json.loads(raw).get("error") or {}
        message, kind, code = str(error.get("message")), str(error.get("type") or "invalid_request_error"), \
            error.get("code")
    except (ValueError, AttributeError):
        message, kind, code = raw[:200].decode("utf-8", "replace") or f"HTTP {status}", "invalid_request_error", None
    return ApiError(status, message, kind, code)


class StreamEndedEarly(Exception):
    """A replica's stream closed before its ``[DONE]``."""


@dataclass
class _Tally:
    """What went wrong while one request looked for a replica."""

    failures: int = 0
    busy: list[int] = field(default_factory=list)
    server_errors: int = 0
    last: str = ""


@dataclass
class _Open:
    """A replica's stream whose first event has arrived (nothing sent to the client yet)."""

    replica: Replica
    reply: httpx.Response
    lines: AsyncIterator[str]
    first: str


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
        cooldown_s: How long the 5xx breaker keeps a replica out of rotation.
        max_attempts: Replicas tried for one request whose attempts fail (a 429 does not count).
        failure_threshold: Consecutive 5xx answers that take a replica out of rotation.
        health_interval_s: Seconds between two health probes of every replica.
        api_key: Bearer token sent to the replicas (None: none).
    """

    def __init__(self, models: Sequence[str], router: ThresholdRouter, replicas: dict[str, ReplicaSet],
                 scorer: BatchingScorer, fleet_name: str = "exitplan", max_in_flight: int = 256,
                 request_timeout_s: float = 120.0, cooldown_s: float = 5.0, max_attempts: int = 2,
                 failure_threshold: int = 3, health_interval_s: float = 0.5, api_key: str | None = None) -> None:
        self.models, self.router, self.replicas, self.scorer = list(models), router, replicas, scorer
        self.fleet_name, self.max_in_flight = fleet_name, max_in_flight
        self.timeout, self.cooldown_s = request_timeout_s, cooldown_s
        self.max_attempts, self.failure_threshold, self.health_interval_s = max_attempts, failure_threshold, \
            health_interval_s
        self.in_flight = 0
        self.stats = CoordinatorStats()
        self._aborting = asyncio.Event()
        self._open_streams: set[httpx.Response] = set()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s, connect=2.0),
                                         limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
                                         headers={"authorization": f"Bearer {api_key}"} if api_key else None)
        self.registry = CollectorRegistry()
        self.routed = Counter("exitplan_routed", "Requests routed per model", ["model"], registry=self.registry)
        self.retried = Counter("exitplan_retries", "Attempts moved to another replica", registry=self.registry)
        self.down = Counter("exitplan_replica_down", "Replicas taken out of rotation", ["replica"],
                            registry=self.registry)
        self.stream_errors = Counter("exitplan_stream_errors", "Streams ended by an error event after their first "
                                     "byte (a replica failed mid-answer)", registry=self.registry)
        self.overhead = Histogram("exitplan_coordinator_overhead_seconds", "Coordinator time per request, without "
                                  "the replica and the scorer model", registry=self.registry,
                                  buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.05))

    @property
    def all_replicas(self) -> list[Replica]:
        """Every replica of every model."""
        return [r for s in self.replicas.values() for r in s.replicas]

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

    # --- replica faults ----------------------------------------------------------------------------------------------
    def _lost(self, replica: Replica, why: str, tally: _Tally | None = None) -> None:
        """A connection failed or timed out: out of rotation until a health probe passes."""
        replica.failures += 1
        replica.healthy = False
        self.down.labels(replica.url).inc()
        if tally is not None:
            tally.failures += 1
            tally.last = f"{replica.url}: {why}"

    def _server_error(self, replica: Replica, tally: _Tally, status: int) -> None:
        """A 5xx: counted against the replica; the breaker opens only after ``failure_threshold`` in a row."""
        replica.failures += 1
        replica.consecutive_5xx += 1
        if replica.consecutive_5xx >= self.failure_threshold:
            replica.down_until = time.monotonic() + self.cooldown_s
            replica.consecutive_5xx = 0
            self.down.labels(replica.url).inc()
        tally.failures += 1
        tally.server_errors += 1
        tally.last = f"{replica.url}: HTTP {status}"

    @staticmethod
    def _answered(replica: Replica) -> None:
        replica.served += 1
        replica.consecutive_5xx = 0

    def _candidates(self, model: str, tally: _Tally) -> Iterator[Replica]:
        """Replicas to try for one request: each at most once, at most ``max_attempts`` failing ones."""
        tried: set[str] = set()
        while tally.failures < self.max_attempts and (replica := self.replicas[model].pick(tried)) is not None:
            tried.add(replica.url)
            if len(tried) > 1:
                self.stats.retries += 1
                self.retried.inc()
            yield replica

    def _exhausted(self, model: str, tally: _Tally) -> ApiError:
        """The answer when no replica answered: 429 if they were all busy, else 503 (or 502 if the replicas were
        up and failed on this very request)."""
        if tally.busy and not tally.failures:
            return ApiError(429, f"every replica of {model} is busy", "rate_limit_error", "queue_full",
                            {"Retry-After": str(max(tally.busy))})
        retry = {"Retry-After": str(max(int(self.cooldown_s), 1))}
        if tally.server_errors and tally.server_errors == tally.failures:
            return ApiError(502, f"replicas of {model} failed on this request ({tally.last})", "server_error",
                            "replica_error", retry)
        why = f" (last: {tally.last})" if tally.last else ""
        return ApiError(503, f"no replica of {model} is available{why}", "server_error", "no_replica", retry)

    # --- forwarding --------------------------------------------------------------------------------------------------
    async def forward(self, path: str, payload: dict[str, Any], model: str) -> tuple[dict[str, Any], float]:
        """A whole answer from a replica of ``model``, moved to another one on a 429, a 5xx or a lost connection;
        a replica's other 4xx is the request's and passed through. Returns it and the seconds spent on replicas."""
        waited, tally = 0.0, _Tally()
        for replica in self._candidates(model, tally):
            started = time.perf_counter()
            try:
                reply = await self.client.post(f"{replica.url}{path}", json=payload)
            except RETRYABLE as exc:
                self._lost(replica, type(exc).__name__, tally)
                continue
            finally:
                waited += time.perf_counter() - started
            if reply.status_code == 429:
                tally.busy.append(_retry_after(reply))
            elif reply.status_code >= 500:
                self._server_error(replica, tally, reply.status_code)
            elif reply.status_code >= 400:
                raise upstream_error(reply.status_code, reply.content)
            else:
                self._answered(replica)
                return reply.json(), waited
        raise self._exhausted(model, tally)

    async def open_stream(self, path: str, payload: dict[str, Any], model: str) -> _Open:
        """A replica's stream up to its first event, with the same moves as :meth:`forward` (nothing has reached
        the client yet, so any replica may still answer)."""
        tally = _Tally()
        for replica in self._candidates(model, tally):
            reply = None
            try:
                request = self.client.build_request("POST", f"{replica.url}{path}", json=payload)
                reply = await self.client.send(request, stream=True)
                if reply.status_code >= 400:
                    raw = await reply.aread()
                    await reply.aclose()
                    if reply.status_code == 429:
                        tally.busy.append(_retry_after(reply))
                    elif reply.status_code >= 500:
                        self._server_error(replica, tally, reply.status_code)
                    else:
                        raise upstream_error(reply.status_code, raw)
                    continue
                lines = reply.aiter_lines()
                first = ""
                while not first:
                    first = await anext(lines)
                return _Open(replica, reply, lines, first)
            except (*RETRYABLE, StopAsyncIteration) as exc:
                if reply is not None:
                    await reply.aclose()
                self._lost(replica, type(exc).__name__, tally)
        raise self._exhausted(model, tally)

    async def relay(self, stream: _Open, model: str) -> AsyncIterator[str]:
        """The stream's events to the client. After its first byte a replica failure ends the stream with an
        error event (counted in ``stats.failed_streams``), never a second answer from another replica."""
        self._open_streams.add(stream.reply)
        try:
            done = self._finished(stream, stream.first, False)
            yield stream.first + "\n\n"
            async for line in stream.lines:
                if line:
                    done = self._finished(stream, line, done)
                    yield line + "\n\n"
            if not done:
                raise StreamEndedEarly("the replica closed the stream before [DONE]")
        except (httpx.HTTPError, StreamEndedEarly) as exc:
            aborted = self._aborting.is_set()
            if not aborted:
                self._lost(stream.replica, type(exc).__name__)
            self.stats.failed_streams += 1
            self.stream_errors.inc()
            message = ("the coordinator shut down before the answer was complete" if aborted else
                       f"the replica of {model} failed mid-answer ({type(exc).__name__}): the answer is incomplete")
            yield sse(error_body(message, "server_error", "shutting_down" if aborted else "replica_failed"))
            yield sse("[DONE]")
        finally:
            self._open_streams.discard(stream.reply)
            await stream.reply.aclose()
            self.in_flight -= 1

    def _finished(self, stream: _Open, line: str, done: bool) -> bool:
        """Whether the stream has ended with ``line``; its replica is counted as having answered on the ``[DONE]``
        itself, before the client can read it (so a client that has the whole answer sees it counted)."""
        if not done and line.strip() == "data: [DONE]":
            self._answered(stream.replica)
            return True
        return done

    async def until_aborted(self, work: Any) -> Any:
        """``work``'s result, or 503 when the drain's grace ends first (``work`` cancelled)."""
        return await unless(work, self._aborting.wait(), ApiError(
            503, "the coordinator shut down before the answer came", "server_error", "shutting_down",
            {"Retry-After": "1"}))

    async def abort(self) -> None:
        """End what still runs (the drain's grace is over): whole answers get 503, streams an error event."""
        self._aborting.set()
        for reply in list(self._open_streams):
            await reply.aclose()

    # --- health ------------------------------------------------------------------------------------------------------
    async def probe(self) -> None:
        """Probe every replica's ``/health`` once: up iff it answers 200 within a second."""
        async def one(replica: Replica) -> None:
            try:
                reply = await self.client.get(f"{replica.url}/health", timeout=1.0)
                replica.healthy = reply.status_code == 200
            except httpx.HTTPError:
                replica.healthy = False

        await asyncio.gather(*(one(r) for r in self.all_replicas))

    async def probe_forever(self) -> None:
        """Probe every ``health_interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.health_interval_s)
            await self.probe()

    def health(self) -> tuple[int, dict[str, Any]]:
        """``/health``: 200 ``ok`` (all up) or ``degraded`` (every model has a replica up), 503 ``unavailable``
        when some model has none."""
        up = {m: sum(r.up for r in s.replicas) for m, s in self.replicas.items()}
        total = {m: len(s.replicas) for m, s in self.replicas.items()}
        status = "ok" if up == total else "degraded" if all(up.values()) else "unavailable"
        return (503 if status == "unavailable" else 200), {"status": status, "replicas_up": up,
                                                            "replicas": total}

    # --- requests ----------------------------------------------------------------------------------------------------
    async def handle(self, body: CompletionRequest | ChatRequest, path: str, http: HttpRequest) -> Any:
        """Score, choose, forward; account the coordinator's own time. A whole answer whose client leaves is
        cancelled (its replica sees the disconnect and stops generating)."""
        if self.in_flight >= self.max_in_flight:
            raise ApiError(429, f"coordinator busy: {self.in_flight} requests in flight", "rate_limit_error",
                           "queue_full", {"Retry-After": "1"})
        t0 = time.perf_counter()
        self.in_flight += 1
        handed_over = False
        try:
            score, _, scorer_s = (await self.scorer.score(prompt_text(body))) if body.model == self.fleet_name \
                else (None, 0.0, 0.0)
            model = self.choose(body, score)
            payload = {**body.model_dump(exclude_none=True), "model": model}
            if body.stream:
                opened = time.perf_counter()
                stream = await self.until_aborted(self.open_stream(path, payload, model))
                waited = time.perf_counter() - opened  # the replica's time to its first event
                self._account(max(time.perf_counter() - t0 - waited - scorer_s, 0.0))  # relaying is I/O
                handed_over = True  # relay() releases the slot
                return StreamingResponse(self.relay(stream, model), media_type="text/event-stream",
                                         headers={"x-exitplan-model": model})
            answer, waited = await unless_disconnected(http, self.until_aborted(self.forward(path, payload, model)))
        except ClientGone:
            return JSONResponse(error_body("client disconnected", "invalid_request_error"), status_code=499)
        finally:
            if not handed_over:
                self.in_flight -= 1
        self._account(max(time.perf_counter() - t0 - waited - scorer_s, 0.0))
        return JSONResponse(answer, headers={"x-exitplan-model": model})

    def _account(self, own: float) -> None:
        self.stats.overhead.append(own)
        self.overhead.observe(own)


def _retry_after(reply: httpx.Response) -> int:
    """A replica's ``Retry-After`` in whole seconds (1 when absent or not a number)."""
    value = reply.headers.get("retry-after", "1")
    return max(int(value), 1) if value.isdigit() else 1


def create_coordinator_app(coordinator: Coordinator, api_key: str | None = None, drain_s: float = 30.0,
                           max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The coordinator's OpenAI-compatible app behind its :class:`~serving.guard.Guard` (``app.state.drain``);
    its lifespan probes every replica before serving and keeps probing."""
    from contextlib import asynccontextmanager

    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    drain = Drain(drain_s, in_flight=lambda: coordinator.in_flight, abort=coordinator.abort)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await coordinator.probe()
        prober = asyncio.create_task(coordinator.probe_forever())
        yield
        prober.cancel()
        await asyncio.gather(prober, return_exceptions=True)
        await coordinator.scorer.close()
        await coordinator.client.aclose()

    app = FastAPI(title="exitplan coordinator", lifespan=lifespan)
    app.state.drain = drain
    app.add_middleware(Guard, api_key=api_key, drain=drain, max_body_bytes=max_body_bytes)
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HttpRequest) -> Any:
        return await coordinator.handle(body, "/v1/completions", http)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: HttpRequest) -> Any:
        return await coordinator.handle(body, "/v1/chat/completions", http)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        names = [coordinator.fleet_name, *coordinator.models]
        return {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "exitplan"} for n in names]}

    @app.get("/health")
    async def health() -> JSONResponse:
        if drain.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        status, body = coordinator.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(coordinator.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        s = coordinator.stats
        return {"routed": dict(zip(coordinator.models, coordinator.router.routed.tolist(), strict=True)),
                "fractions": coordinator.router.fractions.tolist(), "retries": s.retries,
                "failed_streams": s.failed_streams,
                "overhead_ms_p50": 1000 * float(np.median(s.overhead)) if s.overhead else None,
                "overhead_ms_p95": 1000 * float(np.percentile(s.overhead, 95)) if s.overhead else None,
                "overhead_ms": [1000 * x for x in list(s.overhead)[-10_000:]],
                "replicas": [{"url": r.url, "model": r.model, "served": r.served, "failures": r.failures,
                              "up": r.up} for r in coordinator.all_replicas],
                "scorer": vars(coordinator.scorer.stats) | {"sizes": list(coordinator.scorer.stats.sizes)[-50:]}}

    return app
