"""Embarrassingly parallel sweeps on ``dask.distributed``: a local cluster sized to this machine, or a running one.

A sweep is a list of independent jobs and one module-level function. With one worker and no scheduler it runs in this
process (no cluster at all); otherwise the jobs go to Dask in batches (a dozen tasks per worker thread), so an existing
scheduler spreads a sweep over as many machines as have workers attached (each with exitplan installed). Results come
back in job order whichever worker finished first, so a sweep's output does not depend on how it was spread.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from exitplan.config import DaskParams
from exitplan.errors import PipelineError

Job = TypeVar("Job")
Result = TypeVar("Result")

CONNECT_TIMEOUT_S = 20
"""How long to wait for the scheduler at ``dask.scheduler_address`` before giving up."""

WORKER_CONFIG = {"distributed.worker.profile.enabled": False, "distributed.admin.tick.interval": "1s",
                 "distributed.admin.system-monitor.interval": "10s",
                 "distributed.worker.memory.monitor-interval": "10s", "distributed.scheduler.worker-saturation": "inf"}
"""Dask settings of the local cluster: no statistical profiler, and the event loop's periodic checks (tick every
20 ms, system monitor every 500 ms, memory monitor every 100 ms by default) made rare. Each of them takes the GIL
from the task thread: with the defaults one worker swept the perf DB 1.3-1.5x slower than the same code in one
process (8.5 s vs 6.5 s of CPU for one slice), with these as fast (6.6 s)."""


BATCHES_PER_THREAD = 12
"""Dask tasks per worker thread of a sweep: each task is a batch of jobs. One task per job cost about 10 ms of
scheduling each (a perf-DB job takes 20-300 ms); a dozen batches per thread still leave the last one short."""


def local_workers(settings: DaskParams) -> int:
    """Workers of a local cluster: ``dask.workers``, else one per core of this machine."""
    return settings.workers or os.cpu_count() or 1


def in_process(settings: DaskParams) -> bool:
    """Whether a sweep runs in this process: one local worker and no scheduler to join."""
    return settings.scheduler_address is None and local_workers(settings) == 1


@contextmanager
def dask_client(settings: DaskParams) -> Iterator[Any]:
    """A client of the scheduler at ``scheduler_address``, else of a new local cluster (closed on exit).

    The local cluster listens on 127.0.0.1 only, its dashboard at ``dashboard_address``; its workers are processes
    of one thread each by default, since the sweeps are pure-Python simulation loops that hold the GIL.

    Raises:
        PipelineError: if the scheduler cannot be reached (naming its address).
    """
    from distributed import Client, LocalCluster

    if settings.scheduler_address:
        try:
            client = Client(settings.scheduler_address, timeout=CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError) as err:
            raise PipelineError(f"no Dask scheduler answers at dask.scheduler_address "
                                f"{settings.scheduler_address!r} ({err}); start one with `dask scheduler` or set "
                                f"the address to null for a local cluster") from err
        with client:
            yield client
        return
    import dask

    with dask.config.set(WORKER_CONFIG):  # read by each nanny as it starts its worker
        cluster = LocalCluster(n_workers=local_workers(settings), threads_per_worker=settings.threads_per_worker,
                               processes=True, host="127.0.0.1", dashboard_address=settings.dashboard_address)
    with cluster, Client(cluster) as client:
        yield client


def sweep(function: Callable[[Job], Result], jobs: Sequence[Job], settings: DaskParams,
          progress: Callable[[Job], None] | None = None, client: Any = None) -> list[Result]:
    """``[function(job) for job in jobs]``, spread over Dask workers.

    Args:
        function: A module-level function (workers import it by name).
        jobs: The inputs, each run once (in a batch of jobs on some worker).
        settings: The ``dask`` section of params.
        progress: Called with each job as it finishes (in finishing order).
        client: A Dask client to use instead of one made from ``settings`` (a benchmark reuses its cluster).

    Returns:
        The results in the order of ``jobs``.
    """
    if client is None and in_process(settings):
        return [_done(function(job), job, progress) for job in jobs]
    if client is None:
        with dask_client(settings) as own:
            return sweep(function, jobs, settings, progress, own)
    from distributed import as_completed

    batches = _batches(len(jobs), sum(client.nthreads().values()) * BATCHES_PER_THREAD)
    futures = [client.submit(_run_batch, function, [jobs[i] for i in batch], pure=False) for batch in batches]
    index = {future.key: batch for future, batch in zip(futures, batches, strict=True)}
    results: list[Any] = [None] * len(jobs)
    for future in as_completed(futures):
        for at, result in zip(index[future.key], future.result(), strict=True):
            results[at] = _done(result, jobs[at], progress)
    return results


def _done(result: Result, job: Job, progress: Callable[[Job], None] | None) -> Result:
    """Report ``job`` finished (when asked to) and pass its result on."""
    if progress:
        progress(job)
    return result


def _batches(count: int, wanted: int) -> list[list[int]]:
    """``range(count)`` dealt round-robin into ``min(count, wanted)`` batches (neighbouring jobs, often alike in
    cost, land in different batches)."""
    size = max(1, min(count, wanted))
    return [list(range(start, count, size)) for start in range(size)]


def _run_batch(function: Callable[[Job], Result], batch: list[Job]) -> list[Result]:
    """One Dask task: ``function`` over a batch of jobs."""
    return [function(job) for job in batch]
