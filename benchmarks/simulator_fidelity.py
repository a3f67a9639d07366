"""How close the simulator is to published measurements (and, later, to figures measured on a lent GPU).

Each reference point in ``benchmarks/simulator_reference.csv`` names its source (URL, table, configuration) and is
replayed through the same code path as ``exitplan simulate``. A point's role is ``calibration`` when it set an
efficiency factor of the catalog (so its error is in-sample) or ``validation`` when nothing was fitted to it. The
relative error of each is printed; the target is <= 10% on low-load TTFT and TPOT (and end-to-end latency at a small
fixed batch, which is TPOT-dominated).

Usage:
    python benchmarks/simulator_fidelity.py [--quick]

Last line: ``RESULT fidelity_median_err=... fidelity_max_err=...`` (relative errors, as fractions).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from exitplan import REPO_ROOT  # noqa: E402
from exitplan.catalog import Catalog, load_catalog  # noqa: E402
from exitplan.config import Params, load_params  # noqa: E402
from exitplan.simulator.cluster import simulate_cluster  # noqa: E402
from exitplan.simulator.cost_model import CostModel, ReplicaSpec  # noqa: E402
from exitplan.simulator.metrics import summarize  # noqa: E402
from exitplan.simulator.replica import ReplicaSimulator  # noqa: E402
from exitplan.simulator.requests import generate_requests  # noqa: E402

REFERENCE = Path(__file__).with_name("simulator_reference.csv")
METRICS = {"e2e_mean": ("e2e_s", "mean"), "ttft_mean": ("ttft_s", "mean"), "tpot_mean": ("tpot_s", "mean"),
           "e2e_p50": ("e2e_s", "p50"), "ttft_p50": ("ttft_s", "p50"), "tpot_p50": ("tpot_s", "p50")}


def simulate_point(row: dict[str, str], params: Params, catalog: Catalog) -> float:
    """The simulator's value of one reference point's metric."""
    spec = ReplicaSpec(catalog.model(row["model"]), catalog.gpu(row["gpu"]), int(row["tp"]), int(row["pp"]))
    requests = generate_requests(int(row["requests"]), float(row["qps"]), int(row["prompt_len"]),
                                 int(row["output_len"]), arrival=row["arrival"])
    metrics = summarize(simulate_cluster(requests, [ReplicaSimulator(spec, params.simulator.engine)]))
    section, stat = METRICS[row["metric"]]
    return float(metrics[section][stat])


def print_tp_communication(params: Params, catalog: Catalog) -> None:
    """The share of TP's all-reduces in a 70B decode step (8 sequences of 500 tokens) on H100, TP 2/4/8."""
    model, gpu = catalog.model("meta-llama/Llama-2-70b-hf"), catalog.gpu("h100-sxm")
    print(f"\n{'70B decode step, 8 seqs, H100':<36}{'comm ms':>9}{'step ms':>9}{'comm share':>12}")
    for tp in (2, 4, 8):
        cost = CostModel(ReplicaSpec(model, gpu, tp), params.simulator.engine.step_overhead_s)
        comm, step = float(cost.comm_time(8)) * 1e3, float(cost.decode_times(8, 4000, 1)[0]) * 1e3
        print(f"{f'TP{tp}':<36}{comm:>9.3f}{step:>9.3f}{comm / step:>12.1%}")
    print("(exitplan/simulator/comm.py: vLLM's custom all-reduce below 8 MB on NVLink, NCCL's ring above it and on "
          "PCIe)\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="same points (they are all cheap)")
    parser.parse_args()
    rows = list(csv.DictReader(REFERENCE.open()))
    params = load_params(REPO_ROOT / "params.yaml")
    catalog = load_catalog(params.path(params.catalog))
    print_tp_communication(params, catalog)
    print(f"{'reference point':<36}{'role':<12}{'metric':<10}{'measured s':>11}{'simulated s':>12}{'error':>9}")
    errors: dict[str, list[float]] = {"validation": [], "calibration": []}
    for row in rows:
        measured = float(row["value_s"])
        simulated = simulate_point(row, params, catalog)
        error = (simulated - measured) / measured
        errors[row["role"]].append(abs(error))
        print(f"{row['id'][:35]:<36}{row['role']:<12}{row['metric']:<10}{measured:>11.4f}{simulated:>12.4f}"
              f"{error:>+9.1%}")
    print("sources:\n  " + "\n  ".join(sorted({r["url"] for r in rows})))
    print("calibration points set a catalog efficiency factor (in-sample); the RESULT counts validation points only")
    valid = errors["validation"]
    calibration = max(errors["calibration"], default=float("nan"))
    print(f"RESULT fidelity_median_err={statistics.median(valid):.3f} fidelity_max_err={max(valid):.3f} "
          f"points={len(valid)} calibration_err={calibration:.3f}")


if __name__ == "__main__":
    main()
