"""Query tables with real token lengths, request traces drawn from them, and their length statistics."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from exitplan.errors import WorkloadError
from exitplan.workload.arrivals import make_arrivals
from exitplan.workload.sources import Query, read_queries

if TYPE_CHECKING:
    import pandas as pd

    from exitplan.config import TraceParams

PERCENTILES = (50, 90, 95, 99)
"""Percentiles reported for prompt and output lengths."""


def count_tokens(tokenizer: Any, texts: Sequence[str], batch_size: int = 256) -> np.ndarray:
    """Token count of each text with ``tokenizer`` (no special tokens, no chat template); shape ``len(texts)``."""
    counts: list[int] = []
    for start in range(0, len(texts), batch_size):
        encoded = tokenizer(list(texts[start:start + batch_size]), add_special_tokens=False)["input_ids"]
        counts.extend(len(ids) for ids in encoded)
    return np.asarray(counts, dtype=np.int64)


def sample_queries(queries: list[Query], limit: int, rng: np.random.Generator) -> list[Query]:
    """At most ``limit`` queries: all of them when few enough, else a seeded sample kept in source order."""
    if len(queries) <= limit:
        return queries
    keep = np.sort(rng.choice(len(queries), size=limit, replace=False))
    return [queries[i] for i in keep]


def build_query_table(datasets: Sequence[str], tokenizer: Any, max_per_dataset: int, seed: int) -> pd.DataFrame:
    """Read each data set, sample it, and count prompt and reference tokens.

    Returns:
        One row per query: ``dataset, query_id, prompt, reference, prompt_len, output_len``.
    """
    import pandas as pd

    frames = []
    for offset, dataset in enumerate(datasets):
        rng = np.random.default_rng([seed, offset])
        queries = sample_queries(read_queries(dataset), max_per_dataset, rng)
        frame = pd.DataFrame([q.__dict__ for q in queries])
        frame["prompt_len"] = count_tokens(tokenizer, frame["prompt"].tolist())
        frame["output_len"] = count_tokens(tokenizer, frame["reference"].tolist())
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)


def length_stats(lengths: np.ndarray) -> dict[str, float]:
    """Mean, max and the :data:`PERCENTILES` of a length array (numpy's linear interpolation)."""
    stats = {"mean": float(np.mean(lengths)), "max": float(np.max(lengths))}
    stats.update({f"p{q}": float(np.percentile(lengths, q)) for q in PERCENTILES})
    return stats


def length_report(frame: pd.DataFrame, by: str = "dataset") -> dict[str, dict[str, Any]]:
    """Per group of ``by``: the count, and the statistics of prompt and output lengths."""
    return {
        str(name): {
            "count": int(len(group)),
            "prompt_len": length_stats(group["prompt_len"].to_numpy()),
            "output_len": length_stats(group["output_len"].to_numpy()),
        }
        for name, group in frame.groupby(by, sort=True)
    }


def build_trace(queries: pd.DataFrame, trace: TraceParams, seed: int, max_prompt_tokens: int,
                max_output_tokens: int, timestamps: np.ndarray | None = None) -> pd.DataFrame:
    """Draw a request trace from the query table.

    Each request picks a data set by the trace's ``mix`` weights, then a query of it uniformly (with
    replacement) among those within the token limits, and gets an arrival time from the trace's process.

    Returns:
        One row per request, by arrival: ``request_id, arrival_s, dataset, query_id, prompt_len, output_len``.

    Raises:
        WorkloadError: if a data set of the mix has no query within the limits.
    """
    import pandas as pd

    rng = np.random.default_rng([seed, 1_000_003, sum(map(ord, trace.name))])
    eligible = queries[(queries["prompt_len"] <= max_prompt_tokens) & (queries["output_len"] <= max_output_tokens)]
    names = sorted(trace.mix)
    weights = np.asarray([trace.mix[n] for n in names], dtype=float)
    pools = {n: eligible[eligible["dataset"] == n] for n in names}
    empty = [n for n in names if trace.mix[n] > 0 and pools[n].empty]
    if empty:
        raise WorkloadError(f"trace '{trace.name}': no query of {empty} fits the token limits")
    picks = rng.choice(len(names), size=trace.num_requests, p=weights / weights.sum())
    rows = []
    for choice in picks:
        pool = pools[names[choice]]
        rows.append(pool.iloc[int(rng.integers(len(pool)))])
    chosen = pd.DataFrame(rows)[["dataset", "query_id", "prompt_len", "output_len"]].reset_index(drop=True)
    arrivals = make_arrivals(trace.arrival, trace.num_requests, trace.qps, rng, trace.burstiness, timestamps)
    chosen.insert(0, "arrival_s", np.asarray(arrivals, dtype=float))
    chosen.insert(0, "request_id", np.arange(trace.num_requests))
    return chosen


def trace_report(trace: pd.DataFrame) -> dict[str, Any]:
    """Request count, duration, achieved rate and length statistics of one trace."""
    duration = float(trace["arrival_s"].max())
    return {
        "num_requests": int(len(trace)),
        "duration_s": duration,
        "achieved_qps": float(len(trace) / duration) if duration > 0 else float("inf"),
        "prompt_len": length_stats(trace["prompt_len"].to_numpy()),
        "output_len": length_stats(trace["output_len"].to_numpy()),
    }
