"""The routing score of each request, computed in micro-batches off the event loop.

The plan's routing model (``router.json``: embedder name, ridge weights, models, score window) scores a prompt as the
predicted quality gain of the large model over the small one. Requests that arrive together are embedded together:
the first waits at most ``max_wait_s`` for others (up to ``max_batch``), then one embedding pass runs in a thread.
The model time per batch is kept apart from the coordinator's own overhead.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from exitplan.routing.router_file import RoutingModel


def score_function(routing: RoutingModel, embedder_checkpoint: Path) -> Callable[[Sequence[str]], np.ndarray]:
    """``texts -> scores`` with the embedder loaded once."""
    from exitplan.routing.scores import Embedder

    embed = Embedder(embedder_checkpoint)
    return lambda texts: routing.scorer.score(embed(texts, batch_size=64))


@dataclass
class BatchStats:
    """Scorer batches so far."""

    batches: int = 0
    requests: int = 0
    model_seconds: float = 0.0
    wait_seconds: float = 0.0
    sizes: deque[int] = field(default_factory=lambda: deque(maxlen=1000))
    """Sizes of the most recent batches."""


class BatchingScorer:
    """Scores prompts in micro-batches.

    Args:
        score: ``texts -> scores`` (blocking; run in a worker thread).
        max_batch: Largest batch.
        max_wait_s: Longest a request waits for others to join its batch.
    """

    def __init__(self, score: Callable[[Sequence[str]], np.ndarray], max_batch: int = 32,
                 max_wait_s: float = 0.002) -> None:
        self._score, self.max_batch, self.max_wait_s = score, max_batch, max_wait_s
        self._queue: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None
        self.stats = BatchStats()

    async def score(self, text: str) -> tuple[float, float, float]:
        """The prompt's score, the model seconds of the batch it rode in, and its whole wait (queue, batching and
        model)."""
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._task = asyncio.create_task(self._run())
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        started = time.perf_counter()
        await self._queue.put((text, future))
        value, model_s = await future
        waited = time.perf_counter() - started
        self.stats.wait_seconds += waited
        return value, model_s, waited

    async def _run(self) -> None:
        assert self._queue is not None
        while True:
            batch = [await self._queue.get()]
            deadline = time.monotonic() + self.max_wait_s
            while len(batch) < self.max_batch:
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), timeout))
                except TimeoutError:
                    break
            started = time.perf_counter()
            try:
                scores = await asyncio.to_thread(self._score, [text for text, _ in batch])
            except Exception as exc:  # noqa: BLE001 - a scorer failure fails its batch, not the coordinator
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            seconds = time.perf_counter() - started
            self.stats.batches += 1
            self.stats.requests += len(batch)
            self.stats.model_seconds += seconds
            self.stats.sizes.append(len(batch))
            for (_, future), value in zip(batch, scores, strict=True):
                if not future.done():
                    future.set_result((float(value), seconds))

    async def close(self) -> None:
        """Stop the batching task."""
        if self._task is not None:
            self._task.cancel()
