"""The expectation suites, in code: what every input of a plan and its served quality must satisfy.

Each function returns the expectations of one kind of frame; thresholds come from the ``gates`` section of params.
"""

from __future__ import annotations

from typing import Any

from exitplan.config import GatesParams

TRACE_COLUMNS = ("request_id", "arrival_s", "dataset", "query_id", "prompt_len", "output_len")
LABEL_COLUMNS = ("model", "dataset", "query_id", "metric", "quality")
PERF_KEYS = ("model", "gpu", "tp", "pp", "layers", "qps", "cost_per_hour")
LATENCIES = ("ttft", "tpot", "e2e")


def _gxe() -> Any:
    import great_expectations.expectations as gxe

    return gxe


def _present(gxe: Any, columns: tuple[str, ...], min_rows: int) -> list[Any]:
    return [gxe.ExpectTableColumnsToMatchSet(column_set=list(columns), exact_match=False),
            gxe.ExpectTableRowCountToBeBetween(min_value=min_rows),
            *(gxe.ExpectColumnValuesToNotBeNull(column=c) for c in columns)]


def trace(gates: GatesParams) -> list[Any]:
    """A workload trace: its columns, no nulls, arrivals from 0 in order, positive lengths."""
    gxe = _gxe()
    return [*_present(gxe, TRACE_COLUMNS, gates.min_trace_rows),
            gxe.ExpectColumnValuesToBeBetween(column="arrival_s", min_value=0),
            gxe.ExpectColumnValuesToBeIncreasing(column="arrival_s"),
            gxe.ExpectColumnValuesToBeUnique(column="request_id"),
            gxe.ExpectColumnValuesToBeBetween(column="prompt_len", min_value=1),
            gxe.ExpectColumnValuesToBeBetween(column="output_len", min_value=1)]


def perf_db(gates: GatesParams) -> list[Any]:
    """The perf DB: keys present, no negative latency, p50 <= p95 <= p99, no NaN where the replica kept up."""
    gxe = _gxe()
    out = [*_present(gxe, PERF_KEYS, gates.min_perf_db_rows),
           gxe.ExpectColumnValuesToBeBetween(column="qps", min_value=0, strict_min=True),
           gxe.ExpectColumnValuesToBeBetween(column="cost_per_hour", min_value=0)]
    for metric in LATENCIES:
        p50, p95, p99 = (f"{metric}_p{q}_s" for q in (50, 95, 99))
        out += [gxe.ExpectColumnValuesToBeBetween(column=p50, min_value=0),
                gxe.ExpectColumnValuesToNotBeNull(column=p95, row_condition="saturated == False",
                                                  condition_parser="pandas"),
                gxe.ExpectColumnPairValuesAToBeGreaterThanB(column_A=p95, column_B=p50, or_equal=True,
                                                            ignore_row_if="either_value_is_missing"),
                gxe.ExpectColumnPairValuesAToBeGreaterThanB(column_A=p99, column_B=p95, or_equal=True,
                                                            ignore_row_if="either_value_is_missing")]
    return out


def labels(gates: GatesParams) -> list[Any]:
    """Quality labels: columns, no nulls, quality in [0, 1]."""
    gxe = _gxe()
    return [*_present(gxe, LABEL_COLUMNS, gates.min_label_rows),
            gxe.ExpectColumnValuesToBeBetween(column="quality", min_value=0, max_value=1)]


def imported_labels(gates: GatesParams) -> list[Any]:
    """Labels imported from AlpacaEval: a judge's verdicts (win 1, draw 0.5, loss 0; a duplicated instruction the
    mean of its verdicts), one row per model and query, of the import's data set and metric."""
    gxe = _gxe()
    return [*labels(gates),
            gxe.ExpectColumnValuesToBeInSet(column="dataset", value_set=["alpaca_eval"]),
            gxe.ExpectColumnValuesToBeInSet(column="metric", value_set=["alpaca_eval_preference"]),
            gxe.ExpectCompoundColumnsToBeUnique(column_list=["model", "dataset", "query_id"])]


def imported_lengths(gates: GatesParams) -> list[Any]:
    """Real answer lengths per model and query (proxy tokens): a prompt of at least one token, no negative
    answer."""
    gxe = _gxe()
    columns = ("model", "dataset", "query_id", "prompt_len", "output_len")
    return [*_present(gxe, columns, gates.min_label_rows),
            gxe.ExpectColumnValuesToBeBetween(column="prompt_len", min_value=1),
            gxe.ExpectColumnValuesToBeBetween(column="output_len", min_value=0),
            gxe.ExpectCompoundColumnsToBeUnique(column_list=["model", "dataset", "query_id"])]


def pht(gates: GatesParams) -> list[Any]:
    """The Performance History Table (one row per candidate): exit shares summing to 1, sane costs."""
    gxe = _gxe()
    columns = ("model", "num_layers", "exit_share_sum", "perplexity", "prefill_s", "decode_s", "requests")
    return [*_present(gxe, columns, 1),
            gxe.ExpectColumnValuesToBeBetween(column="exit_share_sum", min_value=0.999, max_value=1.001),
            gxe.ExpectColumnValuesToBeBetween(column="perplexity", min_value=1),
            gxe.ExpectColumnValuesToBeBetween(column="prefill_s", min_value=0),
            gxe.ExpectColumnValuesToBeBetween(column="decode_s", min_value=0),
            gxe.ExpectColumnValuesToBeBetween(column="requests", min_value=1)]


def plan(gates: GatesParams) -> list[Any]:
    """The plan (one row per model): fractions in [0, 1] summing to 1, predicted P95 <= P99, a cost."""
    gxe = _gxe()
    columns = ("model", "fraction", "predicted_p95_s", "predicted_p99_s", "cost_per_hour")
    return [*_present(gxe, ("model", "fraction", "cost_per_hour"), 2),
            gxe.ExpectTableColumnsToMatchSet(column_set=list(columns), exact_match=False),
            gxe.ExpectColumnValuesToBeBetween(column="fraction", min_value=0, max_value=1),
            gxe.ExpectColumnSumToBeBetween(column="fraction", min_value=0.999, max_value=1.001),
            gxe.ExpectColumnValuesToBeBetween(column="predicted_p95_s", min_value=0),
            gxe.ExpectColumnPairValuesAToBeGreaterThanB(column_A="predicted_p99_s", column_B="predicted_p95_s",
                                                        or_equal=True, ignore_row_if="either_value_is_missing")]


def quality(gates: GatesParams) -> list[Any]:
    """Served quality per plan model: perplexity drift, ROUGE-2 against full depth, GSM8K exact-match drop."""
    gxe = _gxe()
    return [gxe.ExpectTableRowCountToBeBetween(min_value=1),
            gxe.ExpectColumnValuesToBeBetween(column="ppl_increase_rel", max_value=gates.tolerance_rel),
            gxe.ExpectColumnValuesToBeBetween(column="rouge2_vs_full", min_value=gates.min_rouge2),
            gxe.ExpectColumnValuesToBeBetween(column="em_drop", max_value=gates.em_tolerance)]
