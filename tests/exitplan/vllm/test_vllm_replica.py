"""CPU vLLM replicas: their command, environment, cores, and how many this machine holds."""

from __future__ import annotations

import os

import pytest
from plan_factory import plan_of

from exitplan import REPO_ROOT
from exitplan.config import load_params
from exitplan.deploy import plan_replica_counts, replica_order
from exitplan.vllm import replica as vllm_replica
from exitplan.vllm.environment import API_SERVER, process_env
from exitplan.vllm.flags import Replica


@pytest.fixture(scope="module")
def params():
    return load_params(REPO_ROOT / "params.yaml")


def test_the_command_runs_the_api_server_of_vllms_environment(params) -> None:
    argv = vllm_replica.command(params, REPO_ROOT / "ckpt", Replica("org/m", "127.0.0.1", 8123, max_model_len=512))
    assert argv[:4] == [str(params.path(params.vllm.venv) / "bin" / "python"), "-m", API_SERVER, "--model"]
    assert argv[argv.index("--max-num-seqs") + 1] == str(params.vllm.max_num_seqs)
    assert argv[argv.index("--block-size") + 1] == "32" and argv[argv.index("--port") + 1] == "8123"


def test_the_environment_is_quiet_offline_pinned_and_drops_our_preloads(params, tmp_path) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    env = process_env(params.vllm, tmp_path, [1], base={"LD_PRELOAD": "/x.so", "PYTHONPATH": "/repo", "HOME": "/h"})
    assert env["VLLM_NO_USAGE_STATS"] == "1" and env["HF_HUB_OFFLINE"] == "1" and env["HOME"] == "/h"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and env["OMP_NUM_THREADS"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == str(params.vllm.kv_cache_gib) and "PYTHONPATH" not in env
    assert "/x.so" not in env["LD_PRELOAD"] and env["LD_PRELOAD"].endswith("libiomp5.so")
    off = process_env(params.vllm.model_copy(update={"preload_allocators": False}), tmp_path, [0], base={})
    assert "LD_PRELOAD" not in off


def test_cores_are_disjoint_and_capacity_counts_cores_and_memory(params) -> None:
    usable = sorted(os.sched_getaffinity(0))
    assert vllm_replica.cores(len(usable), 1) == [[c] for c in usable]
    assert vllm_replica.capacity(params, [1.0] * 10) == len(usable)  # one core each
    assert vllm_replica.capacity(params, [1e6, 1.0]) == 0  # the first does not fit: none is started


def test_replicas_follow_the_plan_and_every_model_comes_first() -> None:
    plan = plan_of([{"model": "a", "fraction": 0.5, "groups": [{"dp": 2}, {"dp": 1}]},
                      {"model": "b", "fraction": 0.5, "groups": [{"dp": 1}]}, {"model": "c", "fraction": 0.0}])
    counts = plan_replica_counts(plan, ["a", "b"])
    assert counts == {"a": 3, "b": 1}
    assert replica_order(counts) == ["a", "b", "a", "a"]  # a machine holding two keeps both models
    # a model the plan routes nothing to gets no replica, even with groups: two of "a" start on two cores
    only_a = plan_of([{"model": "a", "fraction": 1.0, "groups": [{"dp": 2}]},
                      {"model": "b", "fraction": 0.0, "groups": [{"dp": 1}]}])
    assert replica_order(plan_replica_counts(only_a, ["a", "b"]))[:2] == ["a", "a"]


def test_stop_kills_a_replica_whose_shutdown_hangs_and_what_it_started(tmp_path) -> None:
    import subprocess
    import time

    import psutil

    hung = "trap '' TERM; sleep 300 & echo $! > child; wait"  # ignores SIGTERM, as does its child
    proc = subprocess.Popen(["bash", "-c", hung], cwd=tmp_path, start_new_session=True)
    deadline = time.monotonic() + 10
    pid_file = tmp_path / "child"
    while not (pid_file.is_file() and pid_file.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)  # the file appears before bash has written the pid into it
    child = int(pid_file.read_text())
    began = time.monotonic()
    vllm_replica.stop(proc, grace_s=1.0)
    assert proc.returncode is not None and time.monotonic() - began < 10
    time.sleep(0.2)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
