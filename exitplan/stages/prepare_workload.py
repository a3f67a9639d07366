"""Stage ``prepare_workload``: real query sets with token lengths, request traces, and their length metrics."""

from __future__ import annotations

from typing import Any

from exitplan.artifacts import queries_path
from exitplan.atomic import write_json, write_parquet
from exitplan.config import Params
from exitplan.errors import WorkloadError
from exitplan.tracking import log_stage_run
from exitplan.workload.arrivals import read_timestamps
from exitplan.workload.trace import build_query_table, build_trace, length_report, trace_report

STAGE = "prepare_workload"


def load_tokenizer(params: Params) -> Any:
    """The tokenizer saved with the ``tokenizer_model`` checkpoint by ``fetch_models``."""
    from transformers import AutoTokenizer

    path = params.checkpoint_path(params.prepare_workload.tokenizer_model)
    if not (path / "tokenizer.json").is_file():
        raise WorkloadError(f"no tokenizer at {path}: run the fetch_models stage first (dvc repro fetch_models)")
    return AutoTokenizer.from_pretrained(str(path))


def main(params: Params) -> dict[str, Any]:
    """Build the query table and every trace of ``prepare_workload.traces``.

    Writes ``<output_dir>/queries.parquet``, ``<output_dir>/trace_<name>.parquet`` and
    ``reports/prepare_workload/metrics.json`` (counts and length percentiles per data set and per trace).
    """
    section = params.prepare_workload
    timestamps = {t.name: read_timestamps(params.path(t.timestamps_file))
                  for t in section.traces if t.arrival == "replay" and t.timestamps_file}
    tokenizer = load_tokenizer(params)
    queries = build_query_table(section.datasets, tokenizer, section.max_queries_per_dataset, section.seed)
    out_dir = params.path(section.output_dir)
    traces = {
        t.name: build_trace(queries, t, section.seed, section.max_prompt_tokens, section.max_output_tokens,
                            timestamps.get(t.name))
        for t in section.traces
    }
    write_parquet(queries_path(params), queries)
    for name, trace in traces.items():
        write_parquet(out_dir / f"trace_{name}.parquet", trace)
    metrics = {
        "num_queries": int(len(queries)),
        "datasets": length_report(queries),
        "traces": {name: trace_report(trace) for name, trace in traces.items()},
    }
    report = write_json(params.path("reports") / STAGE / "metrics.json", metrics)
    log_stage_run(STAGE, params.tracking, params.root, section.model_dump(), metrics, [report])
    return metrics
