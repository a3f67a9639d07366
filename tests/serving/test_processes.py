"""The server processes' command lines: bad input is one line and exit 2, never a traceback; no key in argv."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from exitplan import REPO_ROOT


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})})


def _params_without_checkpoints(tmp_path: Path) -> Path:
    tree = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    tree["catalog"] = str(REPO_ROOT / "model_repository" / "catalog.yaml")
    tree["fetch_models"]["checkpoint_dir"] = str(tmp_path / "empty")
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


@pytest.mark.parametrize(("args", "words"), [
    (["--port", "0"], "--port: must be >= 1"),
    (["--request-timeout", "nan"], "--request-timeout: must be finite"),
    (["--memory-gib", "-1"], "--memory-gib: must be > 0"),
    (["--max-queue", "1.5"], "--max-queue: expected an integer"),
    (["--api-key", "s3cret"], "--api-key is not accepted"),
])
def test_bad_engine_server_flags_are_usage_errors(args: list[str], words: str) -> None:
    result = _run("serving.server", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct", *args)
    assert result.returncode == 2 and words in result.stderr and "Traceback" not in result.stderr


def test_an_unfetched_model_says_run_fetch_models(tmp_path: Path) -> None:
    result = _run("serving.server", "--model", "Qwen/Qwen2.5-Coder-0.5B-Instruct", "--params",
                  str(_params_without_checkpoints(tmp_path)))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "is not fetched" in result.stderr and "exitplan stage fetch-models --model" in result.stderr


def test_a_missing_key_file_or_bad_params_is_one_line(tmp_path: Path) -> None:
    missing = _run("serving.server", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct", "--api-key-file",
                   str(tmp_path / "nope"))
    assert missing.returncode == 2 and "API key file" in missing.stderr and "Traceback" not in missing.stderr
    (tmp_path / "bad.yaml").write_bytes(b"catalog: \xff\xfe\n")
    bad = _run("serving.server", "--model", "x", "--params", str(tmp_path / "bad.yaml"))
    assert bad.returncode == 2 and "bad.yaml" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("content", [None, b"", b"{not json", b'{"models": []}', b"\xff\xfe"])
def test_a_bad_fleet_file_is_one_line_and_exit_2(tmp_path: Path, content: bytes | None) -> None:
    fleet = tmp_path / "fleet.json"
    if content is not None:
        fleet.write_bytes(content)
    result = _run("serving.coordinator_server", "--fleet", str(fleet))
    assert result.returncode == 2 and str(fleet) in result.stderr and "Traceback" not in result.stderr
    assert "exitplan deploy" in result.stderr


def test_full_mode_serves_a_helios_candidate_without_its_exit_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--mode full`` reads no exit heads, so it serves before train_exits has run (the engine benchmark does)."""
    from exitplan.config import Params, load_params
    from serving import server

    params = load_params(REPO_ROOT / "params.yaml")
    model = params.helios.candidates[0]
    monkeypatch.setattr(Params, "fetched", lambda self, name: None)
    built: dict = {}
    monkeypatch.setattr(server, "make_app", lambda candidate, config, *rest: built.update(c=candidate, m=config.mode))
    server.build(params, model, 512, 8, 60.0, None, None, mode="full")
    assert built["m"] == "full" and built["c"].exits_dir is None
    server.build(params, model, 512, 8, 60.0, None, None)  # by default a candidate serves HELIOS, with its heads
    assert built["m"] == "helios" and built["c"].exits_dir is not None
