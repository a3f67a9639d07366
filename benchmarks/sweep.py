"""What the simulator's checks against the real engines share: a load sweep with the reference probe around each
point, the error cells raw and drift-corrected, their table, plot and RESULT figures.

Each measured point runs between two probes (:func:`exitplan.profiling.calibration.probe_as`: the work the device's
reference probe timed at profiling). Their mean drift rescales the device for that point's corrected prediction
(:func:`exitplan.profiling.calibration.rescale`); the raw prediction uses the device as profiled. An error that the
correction removes was the machine's; what it leaves is the simulator's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from exitplan.catalog import Catalog
from exitplan.profiling.calibration import probe_as, rescale
from exitplan.profiling.device_file import DeviceProfile
from exitplan.profiling.probe import Drift

METRICS = ("ttft", "tpot", "e2e")
QUANTILES = (50, 95)
OUT = Path(__file__).resolve().parent / "out"


@dataclass
class Prober:
    """Runs the device's reference probe before and after each measured point and keeps every drift."""

    device: DeviceProfile
    catalog: Catalog
    repeats: int
    drifts: list[Drift] = field(default_factory=list)

    def drift_now(self) -> Drift:
        """The drift since profiling, measured now."""
        assert self.device.probe is not None  # calibration.device_of checked
        drift = Drift.between(self.device.probe, probe_as(self.device.probe, self.catalog, self.repeats))
        self.drifts.append(drift)
        return drift

    def around(self, measure: Callable[[], Any]) -> tuple[Any, Drift, tuple[Drift, Drift]]:
        """``measure()`` between two probes: its result, the two probes' mean drift, and the two."""
        before = self.drift_now()
        result = measure()
        after = self.drift_now()
        return result, Drift.mean([before, after]), (before, after)

    def corrected(self, drift: Drift) -> DeviceProfile:
        """The device rescaled by ``drift``."""
        return rescale(self.device, drift)

    @property
    def drift_max(self) -> float:
        """The largest departure from 1 of any probe's ratio (signed)."""
        return max((d.worst for d in self.drifts), key=abs, default=0.0)


@dataclass
class CpuMeter:
    """The share of one core each named process (with its children) used over a measured point: where the host's
    CPU went, the figure that tells the replicas' own work from what runs beside them."""

    pids: dict[str, int]
    """Name -> process id (a replica's leader, with its engine processes; the coordinator)."""

    own: dict[str, int] = field(default_factory=dict)
    """Name -> process id counted without its children (this client: the fleet's processes are its children)."""

    def _seconds(self) -> dict[str, float]:
        import psutil

        out = {}
        for name, pid in [*self.pids.items(), *self.own.items()]:
            try:
                root = psutil.Process(pid)
                family = [root] if name in self.own else [root, *root.children(recursive=True)]
                out[name] = sum(sum(p.cpu_times()[:2]) for p in family)
            except psutil.Error:
                out[name] = float("nan")
        return out

    def around(self, measure: Callable[[], Any]) -> tuple[Any, dict[str, float]]:
        """``measure()``'s result and each process's CPU seconds over its wall seconds."""
        before, began = self._seconds(), time.perf_counter()
        result = measure()
        wall, after = time.perf_counter() - began, self._seconds()
        return result, {name: (after[name] - before[name]) / wall for name in after}


def geometric_loads(light: float, heavy: float, count: int) -> list[float]:
    """``count`` loads from ``light`` to ``heavy`` (req/s), evenly spaced on a log scale."""
    return [float(x) for x in np.geomspace(light, heavy, count)]


def saturating_load(light: float, p95_at: Callable[[float], float], factor: float, ceiling: float) -> float:
    """The load (req/s) at which ``p95_at`` (a predicted P95 by load) first reaches ``factor`` times its value at
    ``light``: doubling, then bisecting (at most ``ceiling`` times ``light``)."""
    target, low, high = factor * p95_at(light), light, light
    while p95_at(high) < target and high < ceiling * light:
        low, high = high, high * 2
    for _ in range(8):
        mid = (low + high) / 2
        low, high = (mid, high) if p95_at(mid) < target else (low, mid)
    return high


def cells(frame: pd.DataFrame, qps: float, total: bool = True) -> pd.DataFrame:
    """Measured, raw-predicted and corrected-predicted P50 / P95 of each metric, per ``who`` and (``total``) for all
    requests.

    ``frame`` has a ``who`` column (a model, a mode), the measured ``ttft``, ``tpot``, ``e2e`` and the predictions
    ``raw_<metric>`` and ``cor_<metric>``.
    """
    rows = []
    for who, part in [*frame.groupby("who"), *([("all", frame)] if total else [])]:
        for metric in METRICS:
            for q in QUANTILES:
                measured = float(np.nanpercentile(part[metric], q))
                raw = float(np.nanpercentile(part[f"raw_{metric}"], q))
                cor = float(np.nanpercentile(part[f"cor_{metric}"], q))
                rows.append({"qps": qps, "who": who, "n": len(part), "metric": metric, "q": q, "measured": measured,
                             "raw": raw, "corrected": cor, "raw_err": abs(raw - measured) / measured,
                             "cor_err": abs(cor - measured) / measured})
    return pd.DataFrame(rows)


def print_table(table: pd.DataFrame) -> None:
    """One line per load x who x metric x quantile: measured, predicted raw and corrected, both errors."""
    print(f"{'req/s':>7}{'who':>34}{'n':>5}{'metric':>7}{'q':>4}{'measured s':>12}{'raw s':>9}{'err':>8}"
          f"{'corr s':>9}{'err':>8}")
    for r in table.itertuples():
        print(f"{r.qps:>7.3f}{r.who:>34}{r.n:>5}{r.metric:>7}{r.q:>4}{r.measured:>12.3f}{r.raw:>9.3f}"
              f"{r.raw_err:>8.1%}{r.corrected:>9.3f}{r.cor_err:>8.1%}")


def plot(table: pd.DataFrame, name: str, title: str, whos: list[str]) -> Path:
    """Predicted (raw and corrected) against measured E2E P50 and P95 by load, one panel per ``who``:
    ``benchmarks/out/<name>.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(whos), figsize=(6 * len(whos), 4.5), squeeze=False)
    for ax, who in zip(axes[0], whos, strict=True):
        part = table[(table["who"] == who) & (table["metric"] == "e2e")]
        for q, marker in zip(QUANTILES, ("o", "s"), strict=True):
            rows = part[part["q"] == q].sort_values("qps")
            ax.plot(rows["qps"], rows["measured"], marker=marker, color="black", label=f"measured P{q}")
            ax.plot(rows["qps"], rows["raw"], marker=marker, linestyle="--", color="tab:blue",
                    label=f"simulator P{q}")
            ax.plot(rows["qps"], rows["corrected"], marker=marker, linestyle=":", color="tab:orange",
                    label=f"simulator, drift-corrected P{q}")
        ax.set(xlabel="offered load (req/s)", ylabel="end-to-end latency (s)", title=who, xscale="log")
        ax.legend(fontsize=8)
    fig.suptitle(title)
    OUT.mkdir(exist_ok=True)
    path = OUT / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def save_requests(frames: list[pd.DataFrame], name: str) -> Path:
    """Every measured request with its predictions (the sweep's raw data, for re-analysis):
    ``benchmarks/out/<name>_requests.csv``."""
    OUT.mkdir(exist_ok=True)
    path = OUT / f"{name}_requests.csv"
    pd.concat(frames, ignore_index=True).drop(columns=["prompt"], errors="ignore").to_csv(path, index=False)
    return path


def summary(table: pd.DataFrame, prober: Prober, whos: list[str]) -> dict[str, float]:
    """The sweep's figures: median and max raw error over every cell, the corrected median, the largest drift, and
    the smallest ratio over ``whos`` of the heaviest point's measured E2E P95 to the lightest's
    (``heavy_over_light``: the sweep reaches near saturation where it is at least 3)."""
    e2e = table[(table["metric"] == "e2e") & (table["q"] == 95)].sort_values("qps")
    ratios = [float(rows["measured"].iloc[-1] / rows["measured"].iloc[0]) for who, rows in e2e.groupby("who")
              if who in whos]
    return {"sweep_median_err": float(table["raw_err"].median()), "sweep_max_err": float(table["raw_err"].max()),
            "drift_corrected_median_err": float(table["cor_err"].median()),
            "drift_corrected_max_err": float(table["cor_err"].max()), "drift_max": prober.drift_max,
            "heavy_over_light": min(ratios)}


def stamp() -> str:
    """The wall clock, for a progress line."""
    return time.strftime("%H:%M:%S")
