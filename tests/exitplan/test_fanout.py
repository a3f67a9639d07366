"""Sweeps on Dask: in this process for one worker, on a real local cluster otherwise, results in job order."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from exitplan import fanout
from exitplan.catalog import Catalog
from exitplan.config import DaskParams, EngineParams
from exitplan.errors import PipelineError
from exitplan.ports import free_port
from exitplan.simulator.perf_db import build_perf_db


def _pid_after(delay: float) -> tuple[float, int]:
    time.sleep(delay)
    return delay, os.getpid()


def test_one_worker_sweeps_in_this_process_without_a_cluster() -> None:
    seen: list[float] = []
    results = fanout.sweep(_pid_after, [0.0, 0.01], DaskParams(workers=1), seen.append)
    assert results == [(0.0, os.getpid()), (0.01, os.getpid())] and seen == [0.0, 0.01]


def test_a_local_cluster_runs_jobs_in_worker_processes_and_keeps_job_order() -> None:
    settings = DaskParams(workers=2, dashboard_address="127.0.0.1:0")
    delays = [0.5, 0.0, 0.0, 0.0]  # the other worker finishes a short job before the first one ends
    finished: list[float] = []
    results = fanout.sweep(_pid_after, delays, settings, finished.append)
    assert [r[0] for r in results] == delays
    assert os.getpid() not in {r[1] for r in results} and len({r[1] for r in results}) == 2
    assert sorted(finished) == sorted(delays) and finished[0] == 0.0


def test_an_unreachable_scheduler_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    monkeypatch.setattr(fanout, "CONNECT_TIMEOUT_S", 1)
    with pytest.raises(PipelineError, match=f"tcp://127.0.0.1:{port}"):
        fanout.sweep(_pid_after, [0.0], DaskParams(scheduler_address=f"tcp://127.0.0.1:{port}"))


def test_the_perf_db_is_identical_in_one_process_and_on_two_workers(catalog: Catalog) -> None:
    lengths = (np.full(60, 40), np.full(60, 120))
    args = (catalog, ["meta-llama/Llama-2-7b-hf"], ["rtx-4090", "h100-sxm"], EngineParams(), [2.0, 20.0], lengths, 60)
    alone = build_perf_db(*args, max_gpus_per_replica=2, dask=DaskParams(workers=1))
    spread = build_perf_db(*args, max_gpus_per_replica=2, dask=DaskParams(workers=2, dashboard_address="127.0.0.1:0"))
    assert len(alone) == 2 * 3 * 2  # (TP 1, TP 2, PP 2) on two GPUs at two loads
    assert alone.equals(spread)
