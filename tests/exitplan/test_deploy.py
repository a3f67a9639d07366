"""Rendering a plan into vLLM replicas and launch files."""

from __future__ import annotations

import json

import pytest
from plan_factory import plan_of

from exitplan.config import EngineParams
from exitplan.deploy import fleet_config, local_fleet, render, write_launch_files
from exitplan.errors import ExitplanError
from exitplan.planner.plan_file import Plan

QWEN_S, QWEN_L = "Qwen/Qwen2.5-Coder-0.5B-Instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct"


def plan(groups_small, groups_large, weights_small=None) -> Plan:
    return plan_of([{"model": QWEN_S, "fraction": 0.65, "deployed": True, "groups": groups_small,
                     "replica_weights": weights_small or []},
                    {"model": QWEN_L, "fraction": 0.35, "deployed": True, "groups": groups_large}], [0.1])


def group(gpu, dp, tp=1, pp=1, layers=None):
    return {"gpu": gpu, "dp": dp, "tp": tp, "pp": pp, "gpus": dp * tp * pp, **({"layers": layers} if layers else {})}


def test_every_dp_rank_becomes_a_replica_with_the_simulated_knobs(catalog) -> None:
    engine = EngineParams(max_num_seqs=128, max_model_len=4096)
    replicas = render(plan([group("rtx-4090", 2)], [group("h100-sxm", 3, tp=2)], [0.7, 0.3]), catalog, engine, 9000)
    assert [r.model for r in replicas] == [QWEN_S] * 2 + [QWEN_L] * 3
    assert [r.weight for r in replicas[:2]] == [0.7, 0.3] and replicas[2].weight == pytest.approx(1 / 3)
    assert [r.port for r in replicas] == list(range(9000, 9005))
    args = replicas[2].args
    assert args[:3] == ["vllm", "serve", QWEN_L]
    assert args[args.index("--tensor-parallel-size") + 1] == "2" and args[args.index("--max-num-seqs") + 1] == "128"
    assert args[args.index("--max-model-len") + 1] == "4096"
    # h100 hosts hold 8 GPUs: three TP=2 replicas share one host on devices 0-1, 2-3, 4-5
    assert {r.host for r in replicas[2:]} == {"h100-sxm-0"} and [r.devices for r in replicas[2:]] == [[0, 1], [2, 3],
                                                                                                      [4, 5]]


def test_a_partial_replica_loads_only_its_layers(catalog) -> None:
    (replica, _) = render(plan([group("rtx-4090", 1, layers=12)], [group("rtx-4090", 1)]), catalog, EngineParams(),
                          9000)
    # vLLM cannot drop layers by --hf-overrides: the replica serves its truncated checkpoint under the model's name
    assert replica.args[:3] == ["vllm", "serve", f"models/{QWEN_S}-L12"] and "--hf-overrides" not in replica.args
    assert replica.args[replica.args.index("--served-model-name") + 1] == QWEN_S and replica.layers == 12


def test_a_replica_larger_than_a_host_or_an_unknown_gpu_is_refused(catalog) -> None:
    with pytest.raises(ExitplanError, match="does not fit"):
        render(plan([group("rtx-4090", 1, tp=16)], [group("rtx-4090", 1)]), catalog, EngineParams(), 9000)
    with pytest.raises(ExitplanError, match="no-such-gpu"):
        render(plan([group("no-such-gpu", 1)], [group("rtx-4090", 1)]), catalog, EngineParams(), 9000)


def test_launch_files_hold_one_script_per_host(catalog, tmp_path) -> None:
    from exitplan import REPO_ROOT
    from exitplan.config import load_params

    params = load_params(REPO_ROOT / "params.yaml")
    the_plan = plan([group("rtx-4090", 2)], [group("rtx-5090", 3)])
    replicas = render(the_plan, catalog, EngineParams(), 9000)
    files = write_launch_files(tmp_path, replicas, fleet_config(the_plan, replicas, params, None), "7")
    scripts = sorted(p.name for p in files if p.suffix == ".sh")
    assert scripts == ["launch-rtx-4090-0.sh", "launch-rtx-5090-0.sh"]
    text = (tmp_path / "launch-rtx-5090-0.sh").read_text()
    assert text.count("vllm serve") == 3 and "CUDA_VISIBLE_DEVICES=2" in text
    fleet = json.loads((tmp_path / "fleet.json").read_text())
    assert fleet["models"] == [QWEN_S, QWEN_L] and len(fleet["replicas"]) == 5
    assert "--host 127.0.0.1" in text and "0.0.0.0" not in text and "--api-key" not in text
    assert "vllm==0.32.0" in (tmp_path / "requirements-vllm-cuda.lock").read_text()  # the bundle's CUDA vLLM


def test_a_launch_script_refuses_to_start_without_the_key_and_passes_it_by_environment(catalog, tmp_path) -> None:
    import subprocess

    the_plan = plan([group("rtx-4090", 1)], [group("rtx-4090", 1)])
    replicas = render(the_plan, catalog, EngineParams(), 9000, bind="0.0.0.0")
    (script,) = [p for p in write_launch_files(tmp_path, replicas, {}, "1", "MY_KEY") if p.suffix == ".sh"]
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "vllm").write_text('#!/usr/bin/env bash\necho "key=$VLLM_API_KEY args=$*" >> "$OUT"\n')
    (fake / "vllm").chmod(0o755)
    env = {"PATH": f"{fake}:/usr/bin:/bin", "OUT": str(tmp_path / "calls.txt")}
    refused = subprocess.run(["bash", str(script)], cwd="/", env=env, capture_output=True, text=True)
    assert refused.returncode != 0 and "set MY_KEY" in refused.stderr and not (tmp_path / "calls.txt").exists()
    ran = subprocess.run(["bash", str(script)], cwd="/", env={**env, "MY_KEY": "k3y"}, capture_output=True,
                         text=True)
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert ran.returncode == 0 and len(calls) == 2
    assert all(c.startswith("key=k3y args=serve") and "--host 0.0.0.0" in c and "k3y" not in c.split("args=")[1]
               for c in calls)


def test_a_local_fleet_renormalises_the_fractions_of_the_models_here() -> None:
    the_plan = plan_of([{"model": "a", "fraction": 0.2}, {"model": "b", "fraction": 0.3},
                        {"model": "c", "fraction": 0.5}])
    assert local_fleet(the_plan, ["a", "c"])["fractions"] == pytest.approx([2 / 7, 5 / 7])


def test_an_unknown_backend_on_the_command_line_is_a_named_error() -> None:
    """`exitplan deploy --backend <wrong>`: a ConfigError naming the flag and the choices, before anything renders."""
    from typer.testing import CliRunner

    from exitplan import REPO_ROOT
    from exitplan.cli import app
    from exitplan.errors import ConfigError

    result = CliRunner().invoke(app, ["deploy", "--backend", "tgi", "--params", str(REPO_ROOT / "params.yaml")])
    assert isinstance(result.exception, ConfigError)
    assert "--backend: 'tgi': must be 'exitplan' or 'vllm'" in str(result.exception)


def test_an_embedder_where_a_language_model_is_needed_is_a_catalog_error(catalog) -> None:
    from exitplan.errors import CatalogError

    assert catalog.llm("Qwen/Qwen2.5-Coder-0.5B-Instruct").num_layers == 24
    with pytest.raises(CatalogError, match="is an embedder, not a language model"):
        catalog.llm("sentence-transformers/all-MiniLM-L6-v2")
