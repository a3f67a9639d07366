"""The perf-DB sweep scaled out on Dask: one process, 1 and 2 workers of a local cluster, and a grid twice as large.

Usage:
    python benchmarks/scale.py --quick    # ~1 min: the default models and GPUs at fewer requests per point
    python benchmarks/scale.py            # the default perf DB of params.yaml (minutes)
    python benchmarks/scale.py --scheduler tcp://host:8786   # the 2-worker runs on a running cluster instead

Each layout of the sweep is one Dask task; the tables of every run are compared row for row with the one-process run
(``identical``). The clusters are started before the clock starts (their start-up is printed apart), so the ratios
compare sweeping, not process start-up. The speed-up is taken against the faster of the two one-core runs (one process,
or one Dask worker), so Dask's own overhead on one worker cannot inflate it. Target (issue "The production profile and
scale-out"): speed-up of 2 workers over 1 >= 1.7 on this machine's 2 cores. Needs prepare_workload's trace (``make run``
or ``dvc repro prepare_workload``). Last line: ``RESULT perfdb_speedup_2w=... perfdb_s=... identical=1``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

from common import start  # noqa: E402

QUICK_REQUESTS = 100
"""Requests per grid point in ``--quick`` mode (the default grid of params.yaml holds 1,000)."""


def denser(grid: Sequence[float]) -> list[float]:
    """The grid with a midpoint between each pair of neighbours and one step beyond its top: twice the points."""
    points = sorted(grid)
    step = points[-1] - points[-2] if len(points) > 1 else points[0]
    mids = [(a + b) / 2 for a, b in zip(points, points[1:], strict=False)]
    return sorted([*points, *mids, points[-1] + step / 2])


def timed_sweep(params: Any, grid: Sequence[float], requests: int, client: Any) -> tuple[float, Any]:
    """Seconds and table of one perf-DB sweep of params' models and GPUs (on ``client``; None: in this process)."""
    from exitplan.catalog import load_catalog
    from exitplan.config import DaskParams
    from exitplan.simulator.perf_db import build_perf_db
    from exitplan.stages.build_perf_db import _lengths, _model_lengths

    section = params.build_perf_db
    catalog = load_catalog(params.path(params.catalog))
    started = time.perf_counter()
    db = build_perf_db(catalog, section.models, section.gpus, params.simulator.engine, grid, _lengths(params),
                       requests, section.seed, section.max_gpus_per_replica, section.layer_fractions,
                       DaskParams(workers=1), model_lengths=_model_lengths(params), client=client)
    return time.perf_counter() - started, db


def cluster(workers: int, scheduler: str | None) -> Any:
    """A client of a fresh local cluster of ``workers`` processes (or of the scheduler given), started now."""
    from exitplan.config import DaskParams
    from exitplan.fanout import dask_client

    return dask_client(DaskParams(workers=workers, scheduler_address=scheduler, dashboard_address="127.0.0.1:0"))


def main() -> None:
    args, params = start(__doc__, {"--scheduler": {"default": None, "help": "a running Dask scheduler"}})
    grid = list(params.build_perf_db.qps)
    requests = QUICK_REQUESTS if args.quick else params.build_perf_db.requests_per_point
    section = params.build_perf_db
    print(f"perf DB sweep: {len(section.models)} models x {len(section.gpus)} GPU types, {len(grid)} loads, "
          f"{requests} requests per point")
    alone_s, alone = timed_sweep(params, grid, requests, None)
    rows = [("1 process (no Dask)", len(grid), alone_s, 0.0)]
    tables = {}
    for workers in (1, 2):
        begun = time.perf_counter()
        with cluster(workers, args.scheduler if workers == 2 else None) as client:
            up_s = time.perf_counter() - begun
            seconds, tables[workers] = timed_sweep(params, grid, requests, client)
            rows.append((f"{workers} Dask worker{'s' if workers > 1 else ''}", len(grid), seconds, up_s))
            if workers == 2:
                big_s, _ = timed_sweep(params, denser(grid), requests, client)
                rows.append(("2 Dask workers, grid x2", len(denser(grid)), big_s, 0.0))
    identical = all(alone.equals(t) for t in tables.values())
    print(f"\n{'run':<26} {'loads':>5} {'rows':>6} {'sweep s':>8} {'cluster up s':>12}")
    for name, loads, seconds, up_s in rows:
        print(f"{name:<26} {loads:>5} {len(alone) * loads // len(grid):>6} {seconds:>8.1f} {up_s:>12.1f}")
    one_worker, two = rows[1][2], rows[2][2]
    speedup = min(alone_s, one_worker) / two  # against the faster one-core run: Dask's own overhead earns nothing
    print(f"\nspeed-up of 2 workers: {speedup:.2f}x over the faster one-core run (target >= 1.7); "
          f"{one_worker / two:.2f}x over 1 Dask worker, {alone_s / two:.2f}x over one process; "
          f"the grid x2 on 2 workers took {rows[3][2] / two:.2f}x the time")
    print(f"tables identical to the one-process run: {identical}")
    print(f"RESULT perfdb_speedup_2w={speedup:.2f} perfdb_s={rows[2][2]:.1f} identical={int(identical)}")


if __name__ == "__main__":
    main()
