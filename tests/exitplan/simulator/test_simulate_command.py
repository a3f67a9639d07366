"""The `exitplan simulate` command-line contract."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
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
    (["--qps", "0"], "--qps: Input should be greater than 0"),
    (["--qps", "nan"], "--qps: Input should be a finite number"),
    (["--burstiness", "0", "--arrival", "gamma"], "--burstiness: Input should be greater than 0"),
    (["--block-size", "0"], "--block-size: Input should be greater than or equal to 1"),
    (["--replicas", "-2"], "--replicas: Input should be greater than or equal to 1"),
    (["--model", "nobody/none"], "unknown model 'nobody/none'"),
    (["--gpu", "v100"], "unknown GPU 'v100'"),
])
def test_bad_input_gives_one_clear_error(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, [*BASE, *args])
    assert result.exit_code != 0
    assert isinstance(result.exception, ExitplanError)
    assert message in str(result.exception)
    assert "\n" not in str(result.exception)


def test_a_corrupt_or_bad_trace_file_is_one_line_naming_it(tmp_path: Path) -> None:
    cases = {"corrupt.parquet": b"PAR1 not parquet", "latin1.csv": b"\xff\xfe arrival_s", "empty.csv": b"",
             "nan.csv": b"arrival_s,prompt_len,output_len\nnan,5,5\n",
             "fraction.csv": b"arrival_s,prompt_len,output_len\n0,5.5,5\n",
             "columns.csv": b"arrival,prompt_len,output_len\n0,5,5\n"}
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        result = CliRunner().invoke(app, [*BASE, "--trace", str(tmp_path / name)])
        assert isinstance(result.exception, ExitplanError), (name, result.exception)
        assert str(tmp_path / name) in str(result.exception) and "\n" not in str(result.exception)


HOSTILE = st.sampled_from(["nan", "inf", "-inf", "0", "-1", "1e308", "18446744073709551616", "0.5", "abc", ""])
NUMERIC_FLAGS = ["--tp", "--pp", "--replicas", "--qps", "--requests", "--prompt-len", "--output-len", "--seed",
                 "--burstiness", "--layers", "--max-num-seqs", "--max-num-batched-tokens", "--block-size"]


class _Hang(Exception):
    pass


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(flags=st.dictionaries(st.sampled_from(NUMERIC_FLAGS), HOSTILE, min_size=1, max_size=3),
       arrival=st.sampled_from(["poisson", "gamma", "burst"]))
def test_hostile_numbers_never_end_in_a_traceback_or_a_hang(flags: dict[str, str], arrival: str) -> None:
    args = [*BASE, "--requests", "200", "--arrival", arrival]
    for flag, value in flags.items():
        args += [flag, value]

    def hang(*_: object) -> None:
        raise _Hang

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(30)
    try:
        result = CliRunner().invoke(app, args)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert not isinstance(result.exception, _Hang), args
    if result.exit_code == 0:
        json.loads(result.stdout)
    else:  # a usage error (exit 2) or one ExitplanError, which the console script prints as one line with exit 2
        assert result.exit_code == 2 or isinstance(result.exception, ExitplanError), (args, result.exception)
