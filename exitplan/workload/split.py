"""A seeded split of the query table into training and held-out queries (by query, never by token)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from exitplan.errors import WorkloadError


def split_queries(path: Path, datasets: Sequence[str], seed: int) -> tuple[Any, Any]:
    """Queries of ``datasets`` from the query table at ``path``, shuffled by ``seed`` and cut in two halves.

    Returns:
        ``(train, held_out)`` DataFrames with a ``text`` column (prompt, a newline, reference).

    Raises:
        WorkloadError: if the table is missing.
    """
    import pandas as pd

    if not path.is_file():
        raise WorkloadError(f"no query table at {path}: run the prepare_workload stage first")
    queries = pd.read_parquet(path, columns=["dataset", "query_id", "prompt", "reference"])
    queries = queries[queries["dataset"].isin(list(datasets))].reset_index(drop=True)
    queries = queries.iloc[np.random.default_rng(seed).permutation(len(queries))].reset_index(drop=True)
    queries["text"] = queries["prompt"] + "\n" + queries["reference"]
    half = len(queries) // 2
    return queries.iloc[:half].reset_index(drop=True), queries.iloc[half:].reset_index(drop=True)
