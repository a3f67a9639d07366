"""Stage build_perf_db: the local vLLM sweep takes the lengths of the workload the local fleet is sent."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from exitplan.errors import WorkloadError
from exitplan.stages.build_perf_db import workload_lengths


def test_the_workloads_lengths_are_cut_and_the_unservable_left_out(params, tmp_path) -> None:
    pd.DataFrame({"prompt": ["a"] * 5, "prompt_len": [30, 936, 937, 1200, 500],
                  "output_len": [10, 200, 5, 5, 0]}).to_parquet(tmp_path / "queries.parquet")
    prompts, answers = workload_lengths(params)
    assert prompts.tolist() == [30, 936, 500]  # 936 + 64 fits 1000; 937 + 64 does not
    assert answers.tolist() == [10, 64, 1]  # cut at 64, at least one token
    assert np.issubdtype(prompts.dtype, np.integer)


def test_missing_or_unservable_queries_are_named(params, tmp_path) -> None:
    with pytest.raises(WorkloadError, match="run the prepare_workload stage"):
        workload_lengths(params)
    pd.DataFrame({"prompt": ["a"], "prompt_len": [2000], "output_len": [3]}).to_parquet(tmp_path / "queries.parquet")
    with pytest.raises(WorkloadError, match="max_model_len=1000"):
        workload_lengths(params)
