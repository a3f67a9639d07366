"""Runs of one checkout's DVC pipeline are serialised: a second run waits on the lock, naming who holds it; the
pipeline's stages are dvc.yaml's."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from exitplan import REPO_ROOT
from exitplan.errors import PipelineError
from exitplan.pipeline import checkout_lock, stage_names


def test_a_second_run_gives_up_after_its_wait_naming_the_holder(tmp_path: Path) -> None:
    with checkout_lock(tmp_path):
        started = time.monotonic()
        with pytest.raises(PipelineError, match=f"pid {os.getpid()}"), checkout_lock(tmp_path, wait_s=0.5):
            pass
        assert time.monotonic() - started >= 0.5


def test_a_second_run_waits_for_the_first_and_then_runs(tmp_path: Path) -> None:
    order: list[str] = []

    def second() -> None:
        with checkout_lock(tmp_path, wait_s=30):
            order.append("second")

    with checkout_lock(tmp_path):
        thread = threading.Thread(target=second)
        thread.start()
        time.sleep(1.5)
        order.append("first done")
    thread.join(10)
    assert order == ["first done", "second"]


def test_the_stages_are_dvc_yamls_in_its_order(tmp_path: Path) -> None:
    names = stage_names(REPO_ROOT)
    assert names[0] == "fetch_models" and names[-1] == "gate" and len(set(names)) == len(names)
    assert names.index("profile_vllm") < names.index("build_perf_db") < names.index("plan")
    (tmp_path / "dvc.yaml").write_text("stages:\n  b:\n    cmd: x\n  a:\n    cmd: y\n")
    assert stage_names(tmp_path) == ["b", "a"]
    (tmp_path / "dvc.yaml").write_text("vars: []\n")
    with pytest.raises(PipelineError, match="defines no stages"):
        stage_names(tmp_path)
    with pytest.raises(PipelineError, match="no dvc.yaml"):
        stage_names(tmp_path / "elsewhere")
