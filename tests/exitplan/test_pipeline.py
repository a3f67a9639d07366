"""Runs of one checkout's DVC pipeline are serialised: a second run waits on the lock, naming who holds it; the
pipeline's stages are dvc.yaml's."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from exitplan import REPO_ROOT
from exitplan.errors import PipelineError
from exitplan.pipeline import checkout_lock, dvc_executable, stage_graph, stage_names


def _hold_elsewhere(root: Path, seconds: float) -> subprocess.Popen[str]:
    """Another process holding ``root``'s checkout lock for ``seconds`` (returns once it holds it)."""
    code = ("import sys, time; from pathlib import Path; from exitplan.pipeline import checkout_lock\n"
            f"with checkout_lock(Path({str(root)!r})):\n    print('held', flush=True); time.sleep({seconds})\n")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_run_gives_up_after_its_wait_naming_the_holder(tmp_path: Path) -> None:
    holder = _hold_elsewhere(tmp_path, 30)
    try:
        started = time.monotonic()
        with pytest.raises(PipelineError, match=f"pid {holder.pid}"), checkout_lock(tmp_path, wait_s=0.5):
            pass
        assert time.monotonic() - started >= 0.5
    finally:
        holder.kill()
        holder.wait()


def test_a_second_run_waits_for_the_first_and_then_runs(tmp_path: Path) -> None:
    holder = _hold_elsewhere(tmp_path, 1.5)
    with checkout_lock(tmp_path, wait_s=30):
        assert holder.poll() is not None  # entered only after the other process let go
    holder.wait()


def test_threads_of_one_run_share_the_lock_and_the_last_lets_go(tmp_path: Path) -> None:
    inside = threading.Barrier(2, timeout=10)

    def stage() -> None:
        with checkout_lock(tmp_path, wait_s=5):
            inside.wait()  # both threads inside at once: each stage of a run holds it side by side

    threads = [threading.Thread(target=stage) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(15)
    assert not inside.broken
    holder = _hold_elsewhere(tmp_path, 0)  # released: another process takes it at once
    holder.wait()


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


def test_the_stage_graph_is_dvcs_with_one_stage_per_item(tmp_path: Path) -> None:
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([dvc_executable(), "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "dvc.yaml").write_text(
        "stages:\n"
        "  make:\n    foreach: [a, b]\n    do:\n      cmd: echo ${item} > ${item}.txt\n      outs: ['${item}.txt']\n"
        "  join:\n    cmd: cat a.txt b.txt > ab.txt\n    deps: [a.txt, b.txt]\n    outs: [ab.txt]\n"
        "  alone:\n    cmd: echo > c.txt\n    outs: [c.txt]\n")
    graph = stage_graph(tmp_path)
    assert list(graph) == ["make@a", "make@b", "join", "alone"]
    assert graph == {"make@a": [], "make@b": [], "join": ["make@a", "make@b"], "alone": []}
    (tmp_path / "dvc.yaml").write_text("stages: [unclosed\n")
    with pytest.raises(PipelineError, match="dvc.yaml"):
        stage_graph(tmp_path)
    real = stage_graph(REPO_ROOT)
    assert "train_exits@Qwen/Qwen2.5-Coder-1.5B-Instruct" in real["exit_profile"] and "plan" in real["gate"]
