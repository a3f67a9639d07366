"""What ``/metrics`` exports (Prometheus text format), one registry per server."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """Queue depth, batch size, exit layers, breaches, loads, switches, TTFT and TPOT of one engine server.

    Args:
        max_layers: Deepest layer of the served models (bounds the exit-layer histogram).
    """

    def __init__(self, max_layers: int = 64) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge("exitplan_queue_depth", "Requests waiting for the engine", registry=r)
        self.batch_size = Histogram("exitplan_batch_size", "Sequences per engine step", registry=r,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.exit_layer = Histogram("exitplan_exit_layer", "Exit layer of generated tokens", registry=r,
                                    buckets=tuple(range(2, max_layers + 1, 2)))
        self.breaches = Counter("exitplan_breaches", "Tokens generated under the confidence threshold", registry=r)
        self.loads = Counter("exitplan_layer_loads", "Partial models completed by a layer load", registry=r)
        self.switches = Counter("exitplan_model_switches", "Switches to another candidate", registry=r)
        self.ttft = Histogram("exitplan_ttft_seconds", "Time to first token", registry=r, buckets=LATENCY_BUCKETS)
        self.tpot = Histogram("exitplan_tpot_seconds", "Time per output token after the first", registry=r,
                              buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0))
        self.requests = Counter("exitplan_requests", "Finished requests by outcome", ["outcome"], registry=r)
        self.rejected = Counter("exitplan_rejected", "Requests refused (queue full, draining, invalid)", ["reason"],
                                registry=r)

    def step(self, record: Any) -> None:
        """Account one engine step (a :class:`~exitplan.engine.telemetry.StepRecord`)."""
        self.batch_size.observe(record.batch)
        for _ in range(record.batch):  # one token per sequence per step, all exiting at the step's layer
            self.exit_layer.observe(record.exit_layer)
        self.breaches.inc(record.breaches)

    def events(self, events: Iterable[Any]) -> None:
        """Account engine events (loads, switches)."""
        for event in events:
            if event.kind == "load":
                self.loads.inc()
            elif event.kind == "switch":
                self.switches.inc()

    def request(self, request: Any) -> None:
        """Account a finished request's latencies (engine clock) and outcome."""
        self.requests.labels(request.finish_reason or "unknown").inc()
        if request.first_token_s is not None:
            self.ttft.observe(max(request.first_token_s - request.arrival_s, 0.0))
            if request.finish_s is not None and len(request.output) > 1:
                self.tpot.observe((request.finish_s - request.first_token_s) / (len(request.output) - 1))

    def finished(self, outcome: str) -> None:
        """Account a request that ended outside the engine (cancelled)."""
        self.requests.labels(outcome).inc()
