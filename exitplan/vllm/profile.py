"""vLLM's step times on this machine, measured through its OpenAI API, as the points ``fit_device`` fits.

:func:`exitplan.profiling.device.measure` times our runner's passes directly; vLLM runs in another process, so
its passes are timed from outside, where its own streaming shows them:

- **decode** at batch ``b`` and context ``c``: ``b`` streamed requests at once, each a prompt of ``c`` random
  token ids (distinct prompts, so the streams share no cached blocks) and ``tokens`` tokens with ``ignore_eos``.
  Each event of a stream is one decode step of the whole batch, so the median gap between consecutive events, over
  all streams and once every prompt is in, is the step time at batch ``b`` (a prefill that interrupts the decodes
  is one gap in many, and the median does not see it). The context recorded is ``c`` plus half the tokens (the mean
  over the steps). The warm-up and the repeats of a point send the same prompts: vLLM's prefix cache then holds
  their KV, so only the warm-up pays the ``b x c`` prefill tokens (two thirds of the stage's time when every run
  paid them) and a decode step reads the same context either way.
- **prefill** of ``n`` tokens: a single request of ``n`` prompt tokens and one output token, timed whole, minus
  nothing (the HTTP round trip, a millisecond here, goes into the fitted per-step overhead).

The rows have :func:`~exitplan.profiling.device.measure`'s columns, so the simulator's roofline model is fitted to
vLLM exactly as to our engine.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from typing import Any

import httpx
import numpy as np

from exitplan.errors import ExitplanError

VOCAB_LOW, VOCAB_HIGH = 1000, 20000
"""Token ids the synthetic prompts draw from (ordinary tokens of every vocabulary here)."""


def _prompt(rng: np.random.Generator, length: int) -> list[int]:
    return rng.integers(VOCAB_LOW, VOCAB_HIGH, size=length).tolist()


async def _stream_gaps(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                       tokens: int) -> list[float]:
    """Arrival times of the events of one streamed completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    times = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
    return times


async def decode_step(url: str, model: str, prompts: Sequence[list[int]], tokens: int) -> float:
    """Median seconds of one decode step with ``prompts`` streamed together (the batch)."""
    async with httpx.AsyncClient(timeout=600) as client:
        streams = await asyncio.gather(*(_stream_gaps(client, url, model, prompt, tokens) for prompt in prompts))
    return batch_step_seconds(streams)


def batch_step_seconds(streams: Sequence[Sequence[float]]) -> float:
    """Median gap between the events of ``streams`` (arrival times of each stream's events) once every stream has
    had its first token (all prefills done, so each gap is one decode step of the whole batch).

    Raises:
        ExitplanError: no stream had two events after that point: vLLM's API server merged the tokens of a stream
            into one event (it does when it lags behind its engine, on a slow or loaded CPU), so the stream does not
            time the engine's steps.
    """
    all_in = max(s[0] for s in streams)
    gaps = [b - a for s in streams for a, b in zip(s, s[1:], strict=False) if a >= all_in]
    if not gaps:
        events = sorted(len(s) for s in streams)
        raise ExitplanError(f"a batch of {len(streams)} streams gave no decode step to time: once the last prefill "
                            f"was done no stream had two events (events per stream: {events}); vLLM merged the "
                            "streamed tokens, its API server lagging behind the engine on this CPU")
    return statistics.median(gaps)


def prefill(url: str, model: str, length: int, rng: np.random.Generator) -> float:
    """Seconds of one request of ``length`` prompt tokens and one output token."""
    body = {"model": model, "prompt": _prompt(rng, length), "max_tokens": 1, "temperature": 0}
    started = time.perf_counter()
    httpx.post(f"{url}/v1/completions", json=body, timeout=600).raise_for_status()
    return time.perf_counter() - started


def measure(url: str, model: str, layers: int, batch_sizes: Sequence[int], contexts: Sequence[int],
            prefill_lengths: Sequence[int], tokens: int = 16, repeats: int = 3, seed: int = 0) -> list[dict[str, Any]]:
    """Decode-step and prefill times of the vLLM server at ``url`` serving ``model`` (``layers`` deep).

    Returns:
        One row per point: ``kind``, ``layers``, ``batch``, ``context``, ``new_tokens``, ``seconds`` (the median
        of ``repeats``, after one warm-up of each shape).
    """
    rng = np.random.default_rng(seed)
    rows = []
    for batch in batch_sizes:
        for context in contexts:
            prompts = [_prompt(rng, context) for _ in range(batch)]
            times = [asyncio.run(decode_step(url, model, prompts, tokens)) for _ in range(repeats + 1)]
            rows.append({"kind": "decode", "layers": layers, "batch": batch, "context": context + tokens // 2,
                         "new_tokens": batch, "seconds": statistics.median(times[1:])})
    for length in prefill_lengths:
        times = [prefill(url, model, length, rng) for _ in range(repeats + 1)]
        rows.append({"kind": "prefill", "layers": layers, "batch": 1, "context": 0, "new_tokens": length,
                     "seconds": statistics.median(times[1:])})
    return rows
