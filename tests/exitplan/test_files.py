"""Every way an input file can be bad gives one line naming the file, of the caller's error class."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from exitplan.errors import ExitplanError, WorkloadError
from exitplan.files import parse_json, read_json, read_table


def _bad_tables(tmp_path: Path) -> dict[str, Path]:
    good = tmp_path / "good.parquet"
    pd.DataFrame({"arrival_s": [0.0, 1.0], "x": [1, 2]}).to_parquet(good)
    files = {"missing": tmp_path / "absent.parquet", "empty csv": tmp_path / "empty.csv",
             "truncated parquet": tmp_path / "truncated.parquet", "not parquet": tmp_path / "text.parquet",
             "latin-1 csv": tmp_path / "latin1.csv", "wrong columns": tmp_path / "columns.csv"}
    files["empty csv"].write_bytes(b"")
    files["truncated parquet"].write_bytes(good.read_bytes()[: len(good.read_bytes()) // 2])
    files["not parquet"].write_text("arrival_s\n1\n")
    files["latin-1 csv"].write_bytes("arrival_s,note\n1,caf\xe9\n".encode("latin-1"))
    files["wrong columns"].write_text("time,x\n1,2\n")
    return files


def test_a_bad_table_is_one_line_naming_it(tmp_path: Path) -> None:
    for case, path in _bad_tables(tmp_path).items():
        with pytest.raises(WorkloadError) as caught:
            read_table(path, "timestamps file", ["arrival_s"], WorkloadError, hint="fix it")
        message = str(caught.value)
        assert str(path) in message and "\n" not in message and message.endswith("; fix it"), (case, message)


def test_a_bad_json_file_is_one_line_naming_it(tmp_path: Path) -> None:
    cases = {"empty.json": b"  \n", "latin1.json": b'{"a": "caf\xe9"}', "broken.json": b'{"a": ',
             "text.json": b"plan: yes"}
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ExitplanError) as caught:
            read_json(tmp_path / name, "plan")
        assert str(tmp_path / name) in str(caught.value) and "\n" not in str(caught.value), name
    with pytest.raises(ExitplanError, match="plan artifact is not valid JSON"):
        parse_json(b"\x80", "plan artifact")
    assert read_json(_write(tmp_path / "ok.json", b'{"a": [1, 2]}'), "plan") == {"a": [1, 2]}


def _write(path: Path, content: bytes) -> Path:
    path.write_bytes(content)
    return path


def test_the_readers_of_user_files_use_it(tmp_path: Path) -> None:
    from exitplan.profiling.drift import read_telemetry
    from exitplan.profiling.pht import PerformanceHistoryTable
    from exitplan.routing.labels import read_user_labels
    from exitplan.workload.arrivals import read_timestamps

    corrupt = _write(tmp_path / "corrupt.parquet", b"PAR1 garbage")
    with pytest.raises(ExitplanError, match="telemetry .*corrupt.parquet cannot be read"):
        read_telemetry(str(corrupt), 10)
    with pytest.raises(WorkloadError, match="timestamps file .*corrupt.parquet cannot be read"):
        read_timestamps(corrupt)
    with pytest.raises(WorkloadError, match="must be non-empty, finite"):
        read_timestamps(_write(tmp_path / "words.csv", b"arrival_s\nsoon\n"))
    with pytest.raises(ExitplanError, match="label file .*latin1.csv cannot be read"):
        read_user_labels(_write(tmp_path / "latin1.csv", "model,dataset\nx,caf\xe9\n".encode("latin-1")))
    for name, content in (("pht.json", b"[1, 2"), ("list.json", b"[1, 2]"), ("fields.json", b'{"m": {"a": 1}}')):
        with pytest.raises(ExitplanError, match=f"PHT .*{name}"):
            PerformanceHistoryTable(_write(tmp_path / name, content))
