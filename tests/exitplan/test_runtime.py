"""The threads and allocator of model stages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from exitplan import REPO_ROOT
from exitplan.config import load_params
from exitplan.errors import ConfigError
from exitplan.runtime import MODEL_STAGES, THREADS_ENV, use_model_threads


@pytest.fixture
def params_file(tmp_path: Path) -> Path:
    tree = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    tree["runtime"]["model_threads"] = 2
    tree["catalog"] = str(REPO_ROOT / "model_repository" / "catalog.yaml")
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_model_stage_takes_its_threads_and_others_keep_theirs(params_file: Path, restore_threads: None) -> None:
    torch.set_num_threads(1)
    params = load_params(params_file)
    assert use_model_threads(params, "plan") == 1  # BoTorch's stage stays on one thread
    assert use_model_threads(params, "label_quality") == 2
    assert use_model_threads(params, "gate") == 2
    assert {"train_exits", "exit_profile", "label_quality", "online_profile", "gate"} == MODEL_STAGES


def test_a_model_stage_re_executes_itself_once_with_tcmalloc(params_file: Path, monkeypatch, tmp_path: Path) -> None:
    """preload_tcmalloc re-runs the same command line with the library first in LD_PRELOAD, for model stages only,
    and not when it is already there or the knob is off."""
    from exitplan import runtime

    library = tmp_path / "libtcmalloc_minimal.so.4"
    library.write_bytes(b"")
    monkeypatch.setattr(runtime, "TCMALLOC", library)
    calls = []
    monkeypatch.setattr(runtime.os, "execve", lambda exe, argv, env: calls.append((exe, argv, env)))
    monkeypatch.setenv("LD_PRELOAD", "/opt/other.so")
    params = load_params(params_file)
    runtime.preload_tcmalloc(params, "plan")
    assert calls == []
    runtime.preload_tcmalloc(params, "exit_profile")
    (exe, argv, env), = calls
    assert exe == runtime.sys.executable and argv[1:] == runtime.sys.orig_argv[1:]
    assert env["LD_PRELOAD"] == f"{library}:/opt/other.so"
    monkeypatch.setenv("LD_PRELOAD", env["LD_PRELOAD"])
    runtime.preload_tcmalloc(params, "exit_profile")
    monkeypatch.setenv("LD_PRELOAD", "")
    runtime.preload_tcmalloc(params.model_copy(update={"runtime": params.runtime.model_copy(
        update={"preload_tcmalloc": False})}), "gate")
    assert len(calls) == 1
    runtime.preload_tcmalloc(params, "serve")  # the engine server too (serving.server)
    assert len(calls) == 2 and calls[1][2]["LD_PRELOAD"] == str(library)


def test_the_flow_can_give_a_stage_fewer_threads_and_a_bad_count_is_named(
        params_file: Path, restore_threads: None, monkeypatch: pytest.MonkeyPatch) -> None:
    params = load_params(params_file)
    monkeypatch.setenv(THREADS_ENV, "1")  # a stage the flow runs beside another
    assert use_model_threads(params, "train_exits") == 1
    monkeypatch.setenv(THREADS_ENV, "")
    assert use_model_threads(params, "train_exits") == 2
    for bad in ("0", "two", "-1", "1.5"):
        monkeypatch.setenv(THREADS_ENV, bad)
        with pytest.raises(ConfigError, match=f"{THREADS_ENV}: must be a positive whole number, got '{bad}'"):
            use_model_threads(params, "train_exits")
