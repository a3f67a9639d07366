"""Latency and throughput metrics of a simulation: TTFT, TPOT, end-to-end latency, queueing, throughput."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from exitplan.simulator.replica import ReplicaResult

QUANTILES = (50, 95, 99)


def distribution(values: np.ndarray) -> dict[str, float]:
    """Mean and P50/P95/P99 of ``values`` (NaN-free); NaNs everywhere when empty."""
    if len(values) == 0:
        return {"mean": float("nan"), **{f"p{q}": float("nan") for q in QUANTILES}}
    out = {"mean": float(np.mean(values))}
    out.update({f"p{q}": float(v) for q, v in zip(QUANTILES, np.percentile(values, QUANTILES), strict=True)})
    return out


def per_request(results: Sequence[ReplicaResult]) -> dict[str, np.ndarray]:
    """Concatenate the served requests of one or more replicas: arrival, first token, finish, lengths."""
    keep = [~r.rejected for r in results]
    return {
        "arrival_s": np.concatenate([r.requests.arrival_s[k] for r, k in zip(results, keep, strict=True)]),
        "first_token_s": np.concatenate([r.first_token_s[k] for r, k in zip(results, keep, strict=True)]),
        "finish_s": np.concatenate([r.finish_s[k] for r, k in zip(results, keep, strict=True)]),
        "scheduled_s": np.concatenate([r.scheduled_s[k] for r, k in zip(results, keep, strict=True)]),
        "output_len": np.concatenate([r.requests.output_len[k] for r, k in zip(results, keep, strict=True)]),
    }


def summarize(results: Sequence[ReplicaResult]) -> dict[str, Any]:
    """The metrics of the command-line contract, over every replica's served requests.

    TPOT is ``(e2e - ttft) / (output tokens - 1)`` over requests with at least two output tokens.
    Throughput counts completed requests (and their output tokens) over first arrival to last finish; the busy
    fraction is the share of that span the replicas spent in iterations (the mean over the replicas), the mean batch
    the running sequences while busy (weighted by busy time).
    """
    r = per_request(results)
    ttft = r["first_token_s"] - r["arrival_s"]
    e2e = r["finish_s"] - r["arrival_s"]
    multi = r["output_len"] > 1
    tpot = (e2e[multi] - ttft[multi]) / (r["output_len"][multi] - 1)
    span = float(r["finish_s"].max() - r["arrival_s"].min()) if len(e2e) else 0.0
    busy = sum(x.busy_s for x in results)
    return {
        "ttft_s": distribution(ttft),
        "tpot_s": distribution(tpot),
        "e2e_s": distribution(e2e),
        "queue_s": distribution(r["scheduled_s"] - r["arrival_s"]),
        "throughput_req_s": len(e2e) / span if span > 0 else float("nan"),
        "throughput_out_tok_s": float(r["output_len"].sum()) / span if span > 0 else float("nan"),
        "completed": len(e2e),
        "rejected": int(sum(int(x.rejected.sum()) for x in results)),
        "preemptions": int(sum(int(x.preemptions.sum()) for x in results)),
        "kv_utilisation": float(np.average([x.kv_utilisation for x in results],
                                           weights=[max(x.busy_s, 1e-12) for x in results])),
        "busy_s": float(busy),
        "busy_fraction": float(busy) / (span * len(results)) if span > 0 else float("nan"),
        "mean_batch": float(sum(x.mean_batch * x.busy_s for x in results) / busy) if busy > 0 else float("nan"),
        "num_steps": int(sum(x.num_steps for x in results)),
    }
