"""One HELIOS engine behind a thread: requests come from any thread (the API's event loop), tokens go back by callback.

The engine is single-threaded by design (one batched pass per step). The worker owns it: it drains an inbox of new
requests and cancellations, steps while there is work, and after each step hands every request its new tokens. It
bounds the queue (callers get :class:`QueueFull` and answer 429), counts what ``/metrics`` exports, keeps the recent
per-request telemetry that re-profiling reads (and persists it atomically), and drains in-flight requests on stop.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exitplan.engine.engine import Engine
from exitplan.engine.request import Request
from exitplan.engine.telemetry import request_rows
from exitplan.errors import ExitplanError
from serving.metrics import ServerMetrics


class QueueFull(ExitplanError):
    """The engine's queue is at its bound: retry later."""


class ShuttingDown(ExitplanError):
    """The server is draining: no new requests."""


@dataclass(frozen=True)
class Failure:
    """Why a request ended without an answer, as the API answers it.

    Attributes:
        status: HTTP status: 400 the request's fault, 500 the engine's, 503 the server stopped before it finished.
        message: What happened.
        code: OpenAI-style error code.
    """

    status: int
    message: str
    code: str | None = None


@dataclass
class Handle:
    """A submitted request and where its tokens go.

    Attributes:
        request: The engine request.
        on_event: Called (from the worker thread) with ``("tokens", [ids])``, ``("done", reason)`` or
            ``("error", Failure)``.
        sent: Output tokens already handed over.
        submitted_s: ``time.perf_counter()`` at submission.
    """

    request: Request
    on_event: Callable[[str, Any], None]
    sent: int = 0
    submitted_s: float = field(default_factory=time.perf_counter)


class EngineWorker:
    """Runs ``engine`` in a daemon thread.

    Args:
        engine: The HELIOS engine (used only from the worker thread).
        max_queue: Requests that may wait (beyond those running) before :meth:`submit` refuses.
        metrics: Prometheus metrics to update.
        telemetry_path: Where to persist per-request telemetry (None: kept in memory only).
        telemetry_window: Finished requests kept.
        persist_every: Finished requests between two writes of the telemetry file.
    """

    def __init__(self, engine: Engine, max_queue: int, metrics: ServerMetrics, telemetry_path: Path | None = None,
                 telemetry_window: int = 1000, persist_every: int = 20) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.metrics = metrics
        self.telemetry: deque[dict[str, Any]] = deque(maxlen=telemetry_window)
        self._telemetry_path, self._persist_every, self._unsaved = telemetry_path, persist_every, 0
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._handles: dict[str, Handle] = {}
        self._pending = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._accepting = True
        self._events_seen = 0
        self._thread = threading.Thread(target=self._loop, name="engine-worker", daemon=True)

    # --- any thread --------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start stepping."""
        self._thread.start()

    @property
    def healthy(self) -> bool:
        """Accepting requests and stepping."""
        return self._accepting and self._thread.is_alive()

    @property
    def in_flight(self) -> int:
        """Requests submitted and not finished."""
        with self._lock:
            return self._pending + len(self._handles)

    def queue_depth(self) -> int:
        """Requests waiting (not yet running)."""
        with self._lock:
            return self._pending + len(self.engine.waiting)

    def submit(self, request: Request, on_event: Callable[[str, Any], None]) -> None:
        """Queue ``request``; its tokens come to ``on_event``.

        Raises:
            ShuttingDown: while draining.
            QueueFull: when ``max_queue`` requests already wait.
        """
        if not self._accepting:
            raise ShuttingDown("the server is shutting down")
        with self._lock:
            if self._pending + len(self.engine.waiting) >= self.max_queue:
                raise QueueFull(f"{self.max_queue} requests are already waiting")
            self._pending += 1
        self._inbox.put(("add", Handle(request, on_event)))

    def cancel(self, request_id: str) -> None:
        """Stop a request (timed out, or its client went away); its blocks are freed at the next step."""
        self._inbox.put(("cancel", request_id))

    def drain(self) -> None:
        """Refuse new requests from now on (the ones running go on)."""
        self._accepting = False

    def abort(self, message: str = "the server shut down before the request finished") -> None:
        """End every submitted request with a 503 :class:`Failure` (at the worker's next turn)."""
        self._accepting = False
        self._inbox.put(("abort", message))

    def stop(self, drain_s: float = 30.0) -> None:
        """Refuse new requests, let in-flight ones finish (at most ``drain_s``), end the rest with a 503
        :class:`Failure`, then stop the thread."""
        self._accepting = False
        deadline = time.monotonic() + drain_s
        while self.in_flight and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.02)
        if self.in_flight and self._thread.is_alive():
            self.abort(f"the server shut down before the request finished (drain of {drain_s:g} s)")
            deadline = time.monotonic() + 5
            while self.in_flight and time.monotonic() < deadline:
                time.sleep(0.02)
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self.persist()

    def persist(self) -> None:
        """Write the telemetry window (atomically) if a path is set."""
        if self._telemetry_path is not None and self.telemetry:
            import pandas as pd

            from exitplan.atomic import write_parquet

            write_parquet(self._telemetry_path, pd.DataFrame(list(self.telemetry)))
            self._unsaved = 0

    # --- worker thread -----------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain_inbox(block=not self.engine.has_work())
            if not self.engine.has_work():
                continue
            try:
                record = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - an engine failure fails its requests, never the server
                self._fail_all(Failure(500, f"engine error: {exc}", "engine_error"))
                continue
            if record is not None:
                self.metrics.step(record)
            self._deliver()

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, value = item
            if kind == "add":
                self._add(value)
            elif kind == "cancel":
                self._cancel(value)
            else:
                self._fail_all(Failure(503, value, "shutting_down"))
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, handle: Handle) -> None:
        with self._lock:
            self._pending -= 1
            try:
                self.engine.add(handle.request)
            except ExitplanError as exc:
                handle.on_event("error", Failure(400, str(exc)))
                return
            except Exception as exc:  # noqa: BLE001 - a request the engine cannot take fails alone
                handle.on_event("error", Failure(500, f"engine refused the request: {exc}", "engine_error"))
                return
            self._handles[handle.request.request_id] = handle

    def _cancel(self, request_id: str) -> None:
        handle = self._handles.pop(request_id, None)
        if handle is None:
            return
        request = handle.request
        if request in self.engine.waiting:
            self.engine.waiting.remove(request)
        if not request.finished:
            request.finish_reason = "cancelled"
        self.metrics.finished("cancelled")

    def _deliver(self) -> None:
        for request_id, handle in list(self._handles.items()):
            request = handle.request
            if len(request.output) > handle.sent:
                handle.on_event("tokens", request.output[handle.sent:])
                handle.sent = len(request.output)
            if request.finished and request not in self.engine.running:
                del self._handles[request_id]
                handle.on_event("done", request.finish_reason)
                self.metrics.request(request)
                self.telemetry.extend(request_rows([request]))
                self._unsaved += 1
                if self._unsaved >= self._persist_every:
                    self.persist()
        self.metrics.events(self.engine.telemetry.events[self._events_seen:])
        self._events_seen = len(self.engine.telemetry.events)
        self.metrics.queue_depth.set(self.queue_depth())

    def _fail_all(self, failure: Failure) -> None:
        for handle in self._handles.values():
            handle.on_event("error", failure)
        self._handles.clear()
        served = self.engine.served
        pool = served.pool if served is not None and served.has_pool else None
        for request in self.engine.running:
            if pool is not None:
                pool.release(request.blocks)
            request.blocks, request.finish_reason = [], request.finish_reason or "error"
        self.engine.waiting.clear()
        self.engine.running.clear()
