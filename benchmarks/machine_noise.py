"""How repeatable one measurement is on this machine: the floor under any simulator error the fleet benchmarks report.

One vLLM CPU replica of the smallest profiled model is started exactly as ``exitplan deploy`` starts one (one pinned
core, the replicas' flags and environment) and nothing else runs. The same request (a fixed seeded prompt of
``CONTEXT`` tokens, ``TOKENS`` greedy tokens, ``ignore_eos``) is streamed ``--repeats`` times, one at a time, each
right after the device's reference probe (:mod:`exitplan.profiling.probe`, the work ``profile_vllm`` timed). Every
repeat does the same work, so whatever moves between them is the machine.

Figures, each over the repeats of the request's time per output token (its decode):

- ``step_cv``: coefficient of variation (standard deviation over mean);
- ``step_spread``: slowest over fastest;
- ``self_err``: the median of ``|x - median| / median``: the relative error a perfect predictor (one that predicts
  the median exactly) shows against a single measurement;
- ``probe_cv``: the probe's own coefficient of variation (decode probe);
- ``probe_corr``: Pearson's correlation of the probe taken just before each repeat with that repeat (near 0: a
  probe cannot correct the machine's moves, however often it runs);
- ``p95_of_20_err``: the median relative distance of a P95 of 20 repeats (bootstrap resamples of them, the
  quick fleet sweep's requests per point) from the P95 of all of them: the sampling error of the quick mode's P95
  alone.

``--quick``: 12 repeats (about 2 minutes with the replica's start); without it 40.

Last line: ``RESULT step_cv=... step_spread=... self_err=... probe_cv=... probe_corr=... p95_of_20_err=...``.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from common import free_port, start

from exitplan.catalog import load_catalog
from exitplan.profiling.calibration import device_of, probe_as
from exitplan.vllm import replica as vllm_replica
from exitplan.vllm.profile import _prompt

CONTEXT = 128
"""Prompt tokens of the repeated request."""

TOKENS = 48
"""Tokens it decodes."""

BOOTSTRAP = 2000
"""Resamples of the P95-of-20 figure."""


async def per_token_s(url: str, model: str, prompt: list[int]) -> float:
    """Seconds per output token of one streamed request, after its first (its decode alone)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    events = []
    async with (
        httpx.AsyncClient(timeout=600) as client,
        client.stream("POST", f"{url}/v1/completions", json=body) as reply,
    ):
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if line.startswith("data: {"):
                events.append(time.perf_counter())
    return (events[-1] - events[0]) / (TOKENS - 1)


def p95_sampling_err(values: np.ndarray, size: int, rng: np.random.Generator) -> float:
    """Median relative distance of the P95 of ``size`` values drawn (with replacement) from ``values`` from the P95
    of all of them."""
    whole = np.percentile(values, 95)
    draws = np.percentile(rng.choice(values, size=(BOOTSTRAP, size)), 95, axis=1)
    return float(np.median(np.abs(draws - whole) / whole))


def figures(steps: np.ndarray, probes: np.ndarray) -> dict[str, float]:
    """The RESULT figures of the repeats' per-token times and the probes taken before each."""
    median = float(np.median(steps))
    return {
        "step_cv": float(steps.std() / steps.mean()),
        "step_spread": float(steps.max() / steps.min()),
        "self_err": float(np.median(np.abs(steps - median) / median)),
        "probe_cv": float(probes.std() / probes.mean()),
        "probe_corr": float(np.corrcoef(probes, steps)[0, 1]),
        "p95_of_20_err": p95_sampling_err(steps, 20, np.random.default_rng(0)),
    }


def main() -> None:
    args, params = start(__doc__)
    repeats = 12 if args.quick else 40
    catalog = load_catalog(params.path(params.catalog))
    device = device_of(params, "profile_vllm")
    assert device.probe is not None
    model = min(params.profile_vllm.models, key=lambda name: catalog.llm(name).hidden_size)
    port = free_port()
    spec = vllm_replica.cpu_replica(params, model, "127.0.0.1", port)
    cores = vllm_replica.cores(1, params.vllm.threads_per_replica)[0]
    with tempfile.TemporaryDirectory() as tmp:
        replica = vllm_replica.start(params, params.checkpoint_path(model), spec, cores, Path(tmp) / "replica.log")
        try:
            vllm_replica.wait_ready(replica, params.vllm.startup_timeout_s)
            url, prompt = f"http://127.0.0.1:{port}", _prompt(np.random.default_rng(0), CONTEXT)
            asyncio.run(per_token_s(url, model, prompt))  # warm-up
            steps, probes = [], []
            for i in range(repeats):
                probes.append(probe_as(device.probe, catalog, 3).decode_s)
                steps.append(asyncio.run(per_token_s(url, model, prompt)))
                print(f"{i:>3}  probe {probes[-1] * 1e3:7.2f} ms   per token {steps[-1] * 1e3:7.1f} ms", flush=True)
        finally:
            vllm_replica.stop(replica.process)
    steps_a, probes_a = np.array(steps), np.array(probes)
    print(
        f"\n{model}, {CONTEXT} prompt tokens, {TOKENS} tokens, {repeats} repeats: per token median "
        f"{statistics.median(steps) * 1e3:.1f} ms, min {steps_a.min() * 1e3:.1f}, max {steps_a.max() * 1e3:.1f}; "
        f"profiled probe {device.probe.decode_s * 1e3:.2f} ms, now median {np.median(probes_a) * 1e3:.2f} ms"
    )
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in figures(steps_a, probes_a).items()))


if __name__ == "__main__":
    main()
