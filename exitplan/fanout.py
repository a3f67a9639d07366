"""Embarrassingly parallel sweeps on ``dask.distributed``: a local cluster sized to this machine, or a running one.

A sweep is a list of independent jobs and one module-level function. With one worker and no scheduler it runs in
this process (no cluster at all); otherwise each job is a Dask task, so an existing scheduler spreads a sweep over
as many machines as have workers attached (each with exitplan installed). Results come back in job order whichever
worker finished first, so a sweep's output does not depend on how it was spread.
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

WORKER_CONFIG = {"distributed.worker.profile.enabled": False}
"""Dask settings of the local workers: no statistical profiler (it samples every worker's stack every 10 ms; the
perf-DB sweep ran 7% faster on one worker without it)."""


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
        jobs: The inputs, each sent to a worker once.
        settings: The ``dask`` section of params.
        progress: Called with each job as it finishes (in finishing order).
        client: A Dask client to use instead of one made from ``settings`` (a benchmark reuses its cluster).

    Returns:
        The results in the order of ``jobs``.
    """
    if client is None and in_process(settings):
        results = []
        for job in jobs:
            results.append(function(job))
            if progress:
                progress(job)
        return results
    if client is None:
        with dask_client(settings) as own:
            return sweep(function, jobs, settings, progress, own)
    from distributed import as_completed

    futures = client.map(function, list(jobs), pure=False)
    index = {future.key: i for i, future in enumerate(futures)}
    results: list[Any] = [None] * len(futures)
    for future in as_completed(futures):
        at = index[future.key]
        results[at] = future.result()
        if progress:
            progress(jobs[at])
    return results
