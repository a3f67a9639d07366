"""The `exitplan simulate` command-line contract."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from exitplan import REPO_ROOT
from exitplan.cli import app
from exitplan.errors import ExitplanError

BASE = ["simulate", "--params", str(REPO_ROOT / "params.yaml"), "--model", "meta-llama/Llama-2-7b-hf",
        "--gpu", "a100-80g", "--json"]


def _run(*args: str) -> dict:
    result = CliRunner().invoke(app, [*BASE, *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_json_contract() -> None:
    out = _run("--qps", "2", "--requests", "300", "--prompt-len", "256", "--output-len", "64", "--seed", "1")
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        assert set(out[key]) >= {"mean", "p50", "p95", "p99"}
        assert out[key]["p50"] <= out[key]["p95"] <= out[key]["p99"]
    assert out["throughput_req_s"] == pytest.approx(2.0, rel=0.15)
    assert out["throughput_out_tok_s"] == pytest.approx(64 * out["throughput_req_s"])
    # TPOT is (e2e - ttft) / (output - 1)
    assert out["e2e_s"]["mean"] == pytest.approx(out["ttft_s"]["mean"] + 63 * out["tpot_s"]["mean"], rel=1e-9)


def test_burst_replicas_and_engine_knobs() -> None:
    one = _run("--arrival", "burst", "--requests", "400", "--output-len", "32")
    two = _run("--arrival", "burst", "--requests", "400", "--output-len", "32", "--replicas", "2")
    assert two["throughput_req_s"] > 1.6 * one["throughput_req_s"]
    small = _run("--arrival", "burst", "--requests", "400", "--output-len", "32", "--max-num-seqs", "8")
    assert small["throughput_req_s"] < one["throughput_req_s"]


def test_a_replayed_trace_gives_the_same_result_twice(tmp_path: Path) -> None:
    trace = tmp_path / "trace.parquet"
    pd.DataFrame({"arrival_s": [0.0, 0.3, 0.31, 1.2, 2.0], "prompt_len": [100, 900, 30, 400, 50],
                  "output_len": [20, 200, 5, 80, 300]}).to_parquet(trace)
    first = _run("--trace", str(trace))
    second = _run("--trace", str(trace))
    assert first == second
    assert first["completed"] == 5


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "meta-llama/Llama-3.1-70B-Instruct", "--gpu", "rtx-4090", "--tp", "4"], "does not fit"),
    (["--tp", "3"], "TP 3 does not divide the 32 attention heads"),
    (["--qps", "0"], "qps must be > 0"),
    (["--model", "nobody/none"], "unknown model 'nobody/none'"),
    (["--gpu", "v100"], "unknown GPU 'v100'"),
])
def test_bad_input_gives_one_clear_error(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, [*BASE, *args])
    assert result.exit_code != 0
    assert isinstance(result.exception, ExitplanError)
    assert message in str(result.exception)
    assert "\n" not in str(result.exception)
