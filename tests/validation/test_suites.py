"""Each suite passes a real frame and fails each kind of bad frame, naming the expectation that failed."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd
import pytest

from exitplan.config import EngineParams, GatesParams, TraceParams
from validation import suites
from validation.check import validate

GATES = GatesParams(min_trace_rows=10, min_perf_db_rows=4, min_label_rows=4)


@pytest.fixture(scope="module")
def trace(smollm2_tokenizer) -> pd.DataFrame:
    from exitplan.workload.trace import build_query_table, build_trace

    table = build_query_table(["gsm8k", "humaneval"], smollm2_tokenizer, max_per_dataset=30, seed=0)
    params = TraceParams(name="t", arrival="gamma", burstiness=0.5, qps=4.0, num_requests=40,
                         mix={"gsm8k": 0.5, "humaneval": 0.5})
    return build_trace(table, params, seed=0, max_prompt_tokens=512, max_output_tokens=512)


@pytest.fixture(scope="module")
def perf_db(catalog) -> pd.DataFrame:
    from exitplan.simulator.perf_db import build_perf_db

    rng = np.random.default_rng(0)
    lengths = (rng.integers(16, 200, 100), rng.integers(16, 200, 100))
    return build_perf_db(catalog, ["meta-llama/Llama-3.1-8B-Instruct"], ["rtx-4090", "h100-sxm"], EngineParams(),
                         [1.0, 50.0], lengths, num_requests=40, max_gpus_per_replica=1)


LABELS = pd.DataFrame({"model": ["a"] * 4 + ["b"] * 4, "dataset": ["gsm8k"] * 8, "query_id": list("wxyz") * 2,
                       "metric": ["exact_match"] * 8, "quality": [0, 1, 0, 1, 1, 1, 0, 1.0]})
PHT = pd.DataFrame({"model": ["a", "b"], "num_layers": [24, 28], "exit_share_sum": [1.0, 1.0],
                    "perplexity": [1.3, 1.2], "prefill_s": [1e-4, 2e-4], "decode_s": [1e-3, 2e-3], "requests": [5, 5]})
PLAN = pd.DataFrame({"model": ["a", "b"], "fraction": [0.65, 0.35], "predicted_p95_s": [0.5, 0.7],
                     "predicted_p99_s": [0.6, 0.9], "cost_per_hour": [1.2, 2.7]})
QUALITY = pd.DataFrame({"model": ["a", "b"], "ppl_increase_rel": [0.0, 0.004], "rouge2_vs_full": [1.0, 0.9],
                        "em_drop": [0.0, np.nan]})


def _failed(result, expectation: str, column: str | None = None) -> bool:
    return any(f.startswith(expectation) and (column is None or f"column={column}" in f or column in f)
               for f in result.failures)


def _bad(frame: pd.DataFrame, change: Callable[[pd.DataFrame], pd.DataFrame | None]) -> pd.DataFrame:
    copy = frame.copy()
    out = change(copy)
    return copy if out is None else out


def test_good_frames_pass(trace, perf_db) -> None:
    cases = (("trace", trace, suites.trace(GATES)), ("perf_db", perf_db, suites.perf_db(GATES)),
             ("labels", LABELS, suites.labels(GATES)), ("pht", PHT, suites.pht(GATES)),
             ("plan", PLAN, suites.plan(GATES)), ("quality", QUALITY, suites.quality(GATES)))
    for name, frame, expectations in cases:
        result = validate(name, frame, expectations)
        assert result.success, (name, result.failures)
        assert result.evaluated >= 4


@pytest.mark.parametrize(("change", "expectation", "column"), [
    (lambda f: f.__setitem__("arrival_s", f["arrival_s"] - f["arrival_s"].iloc[5]),
     "expect_column_values_to_be_between", "arrival_s"),
    (lambda f: f.iloc[::-1].reset_index(drop=True), "expect_column_values_to_be_increasing", "arrival_s"),
    (lambda f: f.drop(columns=["output_len"]), "expect_table_columns_to_match_set", None),
    (lambda f: f.head(5), "expect_table_row_count_to_be_between", None),
    (lambda f: f.__setitem__("prompt_len", f["prompt_len"].where(f.index != 3, 0)),
     "expect_column_values_to_be_between", "prompt_len"),
    (lambda f: f.__setitem__("request_id", 0), "expect_column_values_to_be_unique", "request_id"),
])
def test_bad_traces_fail_with_the_expectation_named(trace, change, expectation, column) -> None:
    result = validate("trace", _bad(trace, change), suites.trace(GATES))
    assert not result.success and _failed(result, expectation, column), result.failures


def _set(column: str, row: int, value: float) -> Callable[[pd.DataFrame], None]:
    return lambda f: f.__setitem__(column, f[column].where(f.index != row, value))


@pytest.mark.parametrize(("change", "expectation", "column"), [
    (_set("e2e_p50_s", 0, -1.0), "expect_column_values_to_be_between", "e2e_p50_s"),
    (_set("ttft_p95_s", 0, 0.0), "expect_column_pair_values_a_to_be_greater_than_b", "ttft_p95_s"),
    (_set("e2e_p99_s", 0, 0.0), "expect_column_pair_values_a_to_be_greater_than_b", "e2e_p99_s"),
    (_set("e2e_p95_s", 0, np.nan), "expect_column_values_to_not_be_null", "e2e_p95_s"),
    (_set("qps", 0, 0.0), "expect_column_values_to_be_between", "qps"),
])
def test_bad_perf_dbs_fail_with_the_expectation_named(perf_db, change, expectation, column) -> None:
    assert not perf_db.loc[0, "saturated"]  # row 0 is a served load, where NaN is not allowed
    result = validate("perf_db", _bad(perf_db, change), suites.perf_db(GATES))
    assert not result.success and _failed(result, expectation, column), result.failures


def test_a_saturated_row_may_have_no_latency(perf_db) -> None:
    saturated = perf_db.copy()
    saturated.loc[0, "saturated"] = True
    saturated.loc[0, [c for c in saturated.columns if c.endswith("_s")]] = np.nan
    assert validate("perf_db", saturated, suites.perf_db(GATES)).success


@pytest.mark.parametrize(("suite", "frame", "change", "expectation", "column"), [
    ("labels", LABELS, _set("quality", 2, 1.5), "expect_column_values_to_be_between", "quality"),
    ("labels", LABELS, _set("quality", 2, np.nan), "expect_column_values_to_not_be_null", "quality"),
    ("pht", PHT, _set("exit_share_sum", 1, 0.9), "expect_column_values_to_be_between", "exit_share_sum"),
    ("pht", PHT, _set("decode_s", 1, -1.0), "expect_column_values_to_be_between", "decode_s"),
    ("plan", PLAN, _set("fraction", 1, 0.5), "expect_column_sum_to_be_between", "fraction"),
    ("plan", PLAN, _set("predicted_p99_s", 1, 0.1), "expect_column_pair_values_a_to_be_greater_than_b", None),
    ("quality", QUALITY, _set("ppl_increase_rel", 1, 0.2), "expect_column_values_to_be_between", "ppl_increase_rel"),
    ("quality", QUALITY, _set("rouge2_vs_full", 0, 0.3), "expect_column_values_to_be_between", "rouge2_vs_full"),
    ("quality", QUALITY, _set("em_drop", 0, 0.5), "expect_column_values_to_be_between", "em_drop"),
])
def test_bad_small_frames_fail_with_the_expectation_named(suite, frame, change, expectation, column) -> None:
    result = validate(suite, _bad(frame, change), getattr(suites, suite)(GATES))
    assert not result.success and _failed(result, expectation, column), result.failures


IMPORTED = pd.DataFrame({"model": ["a"] * 4 + ["b"] * 4, "dataset": ["alpaca_eval"] * 8, "query_id": list("wxyz") * 2,
                         "metric": ["alpaca_eval_preference"] * 8, "quality": [0, 1, 0.5, 1, 1, 1, 0, 0.75],
                         "reference_score": [np.nan] * 8})
LENGTHS = pd.DataFrame({"model": ["a"] * 4 + ["b"] * 4, "dataset": ["alpaca_eval"] * 8, "query_id": list("wxyz") * 2,
                        "prompt_len": [12, 30, 8, 9] * 2, "output_len": [300, 0, 120, 80, 400, 2, 150, 90]})


def test_imported_labels_and_lengths_pass_and_fail_with_the_expectation_named() -> None:
    assert validate("imported_labels", IMPORTED, suites.imported_labels(GATES)).success
    assert validate("imported_lengths", LENGTHS, suites.imported_lengths(GATES)).success
    for frame, suite, change, expectation in (
            (IMPORTED, "imported_labels", _set("quality", 1, 2.0), "expect_column_values_to_be_between"),
            (IMPORTED, "imported_labels", _set("metric", 1, "exact_match"), "expect_column_values_to_be_in_set"),
            (IMPORTED, "imported_labels", lambda f: pd.concat([f, f.head(1)], ignore_index=True),
             "expect_compound_columns_to_be_unique"),
            (LENGTHS, "imported_lengths", _set("prompt_len", 2, 0), "expect_column_values_to_be_between"),
            (LENGTHS, "imported_lengths", _set("output_len", 2, -1), "expect_column_values_to_be_between")):
        result = validate(suite, _bad(frame, change), getattr(suites, suite)(GATES))
        assert not result.success and _failed(result, expectation), (suite, result.failures)
