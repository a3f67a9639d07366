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
- **beside busy neighbours** (:func:`neighbour_grids`): the decode step at a few batch sizes, alone and while every
  other replica of the host decodes a few batch sizes of its own, in turn; beside over alone, it is what a replica
  loses to its neighbours (the memory system and the cores they share), one grid per replica (its batch by the
  neighbour's), which the simulator applies to co-located replicas of its model.
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

from exitplan.catalog import SlowdownGrid
from exitplan.errors import ExitplanError

VOCAB_LOW, VOCAB_HIGH = 1000, 20000
"""Token ids the synthetic prompts draw from (ordinary tokens of every vocabulary here)."""

BUSY_TOKENS = 1024
"""Tokens a neighbour's stream asks for while a replica is timed beside it (it is cancelled long before; its context
plus these stays within the replicas' ``max_model_len``)."""


def _prompt(rng: np.random.Generator, length: int) -> list[int]:
    return rng.integers(VOCAB_LOW, VOCAB_HIGH, size=length).tolist()


async def _stream_gaps(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                       tokens: int, first: asyncio.Event | None = None) -> list[float]:
    """Arrival times of the events of one streamed completion (``first`` is set at its first event)."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    times = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
                if first is not None:
                    first.set()
    return times


async def decode_step(url: str, model: str, prompts: Sequence[list[int]], tokens: int) -> float:
    """Median seconds of one decode step with ``prompts`` streamed together (the batch)."""
    async with httpx.AsyncClient(timeout=600) as client:
        streams = await asyncio.gather(*(_stream_gaps(client, url, model, prompt, tokens) for prompt in prompts))
    return batch_step_seconds(streams)


async def decode_step_beside(url: str, model: str, prompts: Sequence[list[int]], tokens: int,
                             neighbours: Sequence[tuple[str, str, list[int]]]) -> float:
    """:func:`decode_step` while every neighbour replica decodes a stream of its own the whole time.

    Args:
        url: The timed replica.
        model: Its model.
        prompts: The timed batch.
        tokens: Tokens each timed stream decodes.
        neighbours: ``(url, model, prompt)`` of each other replica: a stream with no end in sight is started on
            each, the timed batch starts once every one of them has sent its first token (its prefill is done), and
            they are cancelled (vLLM aborts them) when it ends.
    """
    async with httpx.AsyncClient(timeout=600) as client:
        started = [asyncio.Event() for _ in neighbours]
        busy = [asyncio.create_task(_stream_gaps(client, u, m, p, BUSY_TOKENS, e))
                for (u, m, p), e in zip(neighbours, started, strict=True)]
        try:
            await asyncio.gather(*(e.wait() for e in started))
            streams = await asyncio.gather(*(_stream_gaps(client, url, model, prompt, tokens) for prompt in prompts))
        finally:
            for task in busy:
                task.cancel()
            await asyncio.gather(*busy, return_exceptions=True)
    return batch_step_seconds(streams)


def neighbour_grids(replicas: Sequence[tuple[str, str]], batches: Sequence[int], context: int, tokens: int,
                    repeats: int, seed: int = 1) -> list[SlowdownGrid]:
    """The share by which each replica's decode step takes longer per busy neighbour, by its batch and theirs: each
    replica timed at each of ``batches`` alone (the others standing by) and beside every other replica decoding each
    of ``batches`` streams, the two in turn in every repeat so that the machine's own drift between them cancels;
    the mean of the paired ratios (the effect comes and goes between pairs; a fleet sees its mean), per neighbour,
    never below 0. One grid per replica, in order (the catalog's ``Gpu.slowdown_grids``): on a CPU host what a
    replica loses depends on which model it is, on its own batch and on how busy the neighbour is (a one-core
    decode at batch 1 loses 0.30 beside one busy stream, at batch 4 0.03).

    Args:
        replicas: ``(url, model)`` of every replica on this host (two or more).
        batches: Streams of the timed batches and of each neighbour's (increasing).
        context: Prompt tokens of every stream.
        tokens: Tokens each timed stream decodes.
        repeats: Timed pairs per cell (their mean ratio kept), after one warm-up pair.
        seed: Seed of the synthetic prompts.
    """
    if len(replicas) < 2 or not batches:
        raise ExitplanError("the neighbour slowdown needs two or more replicas and a batch size to time")
    rng = np.random.default_rng(seed)
    grids = []
    for i, (url, model) in enumerate(replicas):
        values = []
        for batch in batches:
            prompts = [_prompt(rng, context) for _ in range(batch)]
            row = []
            for busy in batches:
                others = [(u, m, _prompt(rng, context)) for j, (u, m) in enumerate(replicas) if j != i
                          for _ in range(busy)]
                ratio = _beside_over_alone(url, model, prompts, tokens, others, repeats)
                row.append(max(0.0, (ratio - 1) / (len(replicas) - 1)))
            values.append(row)
        grids.append(SlowdownGrid(batches=list(batches), values=values))
    return grids


def _beside_over_alone(url: str, model: str, prompts: Sequence[list[int]], tokens: int,
                       others: Sequence[tuple[str, str, list[int]]], repeats: int) -> float:
    """The mean ratio of :func:`decode_step_beside` ``others`` over :func:`decode_step` alone, timed in turn in
    ``repeats`` pairs after one warm-up pair."""
    ratios = []
    for _ in range(repeats + 1):
        alone = asyncio.run(decode_step(url, model, prompts, tokens))
        ratios.append(asyncio.run(decode_step_beside(url, model, prompts, tokens, others)) / alone)
    return statistics.fmean(ratios[1:])


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
