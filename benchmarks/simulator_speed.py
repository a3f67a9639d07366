"""How fast the simulator is: 10,000 requests of one deployment, and (full mode) the default perf DB build.

Usage:
    python benchmarks/simulator_speed.py --quick    # ~10 s: 10k requests, 3 repeats, median
    python benchmarks/simulator_speed.py            # also builds the default perf DB (params.yaml), minutes

Targets (issue "Inference simulator and performance database"): 10k requests under 1 s on this CPU; the default
perf DB under 5 minutes; >= 100x faster than Vidur, which needed 6-30 s for 300-500 requests on this machine
(measured by an earlier session; Vidur is not installed here, so that figure is quoted, not re-measured).
Last line: ``RESULT sim_10k_s=... [perfdb_s=...]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from exitplan import REPO_ROOT  # noqa: E402
from exitplan.catalog import load_catalog  # noqa: E402
from exitplan.config import load_params  # noqa: E402
from exitplan.simulator.cost_model import ReplicaSpec  # noqa: E402
from exitplan.simulator.metrics import summarize  # noqa: E402
from exitplan.simulator.replica import ReplicaSimulator  # noqa: E402
from exitplan.simulator.requests import generate_requests  # noqa: E402

VIDUR_SECONDS_PER_REQUEST = 6.0 / 300  # the fastest Vidur figure quoted in the issue (6 s for 300 requests)


def time_10k(repeats: int) -> tuple[float, dict]:
    """Median seconds to simulate 10,000 ShareGPT-like requests of Llama-2-7B on one A100 at 6 QPS."""
    catalog = load_catalog(REPO_ROOT / "model_repository" / "catalog.yaml")
    spec = ReplicaSpec(catalog.model("meta-llama/Llama-2-7b-hf"), catalog.gpu("a100-80g"))
    requests = generate_requests(10_000, 6.0, 512, 128, seed=0)
    times, metrics = [], {}
    for _ in range(repeats):
        started = time.perf_counter()
        result = ReplicaSimulator(spec).run(requests)
        times.append(time.perf_counter() - started)
        metrics = summarize([result])
    return statistics.median(times), metrics


def time_perf_db() -> tuple[float, int]:
    """Seconds to build the default perf DB of params.yaml (needs prepare_workload's trace)."""
    from exitplan.simulator.perf_db import build_perf_db
    from exitplan.stages.build_perf_db import _lengths

    params = load_params(REPO_ROOT / "params.yaml")
    section = params.build_perf_db
    catalog = load_catalog(params.path(params.catalog))
    started = time.perf_counter()
    db = build_perf_db(catalog, section.models, section.gpus, params.simulator.engine, section.qps,
                       _lengths(params), section.requests_per_point, section.seed, section.max_gpus_per_replica,
                       section.layer_fractions, params.dask)
    return time.perf_counter() - started, len(db)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only the 10k-request timing")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    seconds, metrics = time_10k(args.repeats)
    per_request = seconds / 10_000
    print(f"{'case':<44}{'seconds':>10}{'ms/request':>12}{'vs Vidur':>10}")
    print(f"{'10k requests, Llama-2-7B, 1xA100, 6 QPS':<44}{seconds:>10.3f}{per_request * 1e3:>12.4f}"
          f"{VIDUR_SECONDS_PER_REQUEST / per_request:>9.0f}x")
    print(f"  (steps simulated: {metrics['num_steps']}, e2e p99 {metrics['e2e_s']['p99']:.2f} s, "
          f"throughput {metrics['throughput_req_s']:.2f} req/s)")
    result = f"RESULT sim_10k_s={seconds:.3f} speedup_vs_vidur={VIDUR_SECONDS_PER_REQUEST / per_request:.0f}"
    if not args.quick:
        perfdb_s, rows = time_perf_db()
        print(f"{'default perf DB (' + str(rows) + ' grid points)':<44}{perfdb_s:>10.1f}")
        result += f" perfdb_s={perfdb_s:.1f}"
    print(result)


if __name__ == "__main__":
    main()
