"""Stage partial_checkpoints and the deployment of partial replicas: the plans' cuts written, served, bundled."""

from __future__ import annotations

import json

import pytest
import yaml
from plan_factory import plan_of

from exitplan import REPO_ROOT
from exitplan.artifacts import PLAN_FILE
from exitplan.config import load_params
from exitplan.deploy import ReplicaLaunch, bundle_partials, replica_checkpoint
from exitplan.errors import ExitplanError
from exitplan.planner.plan_file import Plan, write_plan
from exitplan.stages import partial_checkpoints
from exitplan.vllm.truncate import partial_name, plan_cuts

SMALL, LARGE, LLAMA = "Qwen/Qwen2.5-Coder-0.5B-Instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct", "meta-llama/Llama-2-7b-hf"


def _plan(small_layers: int | None) -> Plan:
    def group(layers):
        return {"gpu": "vllm-cpu", "dp": 1, **({"layers": layers} if layers else {})}

    return plan_of([{"model": SMALL, "fraction": 0.6, "groups": [group(small_layers)]},
                    {"model": LARGE, "fraction": 0.4, "groups": [group(28)]}])


@pytest.fixture
def params(tiny_checkpoint, tmp_path):
    """Params whose checkpoints are a tiny model fetched as the 0.5B, a qwen-local plan cutting it to 3 layers, a
    llama2-boute plan cutting a model not fetched here, and one extra cut asked for by ``cuts``."""
    source, _ = tiny_checkpoint
    models = tmp_path / "models"
    (models / SMALL).parent.mkdir(parents=True)
    (models / SMALL).symlink_to(source)
    plans = tmp_path / "plans"
    for name, plan in {"qwen-local": _plan(3),
                       "llama2-boute": plan_of([{"model": LLAMA, "fraction": 1.0,
                                                 "groups": [{"gpu": "h100-sxm", "dp": 1, "layers": 16}]}])}.items():
        write_plan(plans / name / PLAN_FILE, plan)
    tree = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    tree["catalog"] = str(REPO_ROOT / tree["catalog"])
    tree["tracking"]["enabled"] = False
    tree["fetch_models"]["checkpoint_dir"] = str(models)
    tree["plan"]["output_dir"] = str(plans)
    tree["partial_checkpoints"] = {"cuts": [{"model": SMALL, "layers": 2}], "output_dir": str(tmp_path / "partial")}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tree))
    return load_params(tmp_path / "params.yaml")


def test_a_plans_partial_groups_are_its_cuts() -> None:
    layers = {SMALL: 24, LARGE: 28}.get
    assert plan_cuts(_plan(12), layers) == [(SMALL, 12)]
    assert plan_cuts(_plan(None), layers) == []


def test_the_stage_cuts_the_plans_partials_and_the_asked_cuts_and_names_what_is_not_here(params) -> None:
    metrics = partial_checkpoints.main(params)
    out = params.path(params.partial_checkpoints.output_dir)
    assert sorted(metrics["bytes"]) == [partial_name(SMALL, 2), partial_name(SMALL, 3)]
    assert metrics["not_fetched"] == [LLAMA]
    config = json.loads((out / partial_name(SMALL, 3) / "config.json").read_text())
    assert config["num_hidden_layers"] == 3 and config["torch_dtype"] == params.vllm.dtype
    assert metrics["bytes"][partial_name(SMALL, 2)] < metrics["bytes"][partial_name(SMALL, 3)]


def test_a_local_partial_replica_serves_its_cut_and_a_missing_cut_is_named(params) -> None:
    with pytest.raises(ExitplanError, match="dvc repro partial_checkpoints"):
        replica_checkpoint(params, _plan(3), SMALL)
    partial_checkpoints.main(params)
    assert replica_checkpoint(params, _plan(3), SMALL) == params.path("partial") / partial_name(SMALL, 3)
    assert replica_checkpoint(params, _plan(None), SMALL) == params.checkpoint_path(SMALL)


def test_the_bundle_carries_the_cuts_as_links_and_names_those_it_lacks(params, tmp_path) -> None:
    partial_checkpoints.main(params)
    replicas = [ReplicaLaunch(SMALL, "rtx-4090", "rtx-4090-0", [0], 9000, 1.0, 3),
                ReplicaLaunch(LARGE, "rtx-4090", "rtx-4090-0", [1], 9001, 1.0, 28),
                ReplicaLaunch(LLAMA, "h100-sxm", "h100-sxm-0", [0], 9002, 1.0, 16)]
    bundle = tmp_path / "bundle"
    missing = bundle_partials(params, replicas, bundle, {SMALL: 24, LARGE: 28, LLAMA: 32})
    assert missing == [partial_name(LLAMA, 16)]
    linked = bundle / "models" / partial_name(SMALL, 3)
    source = params.path("partial") / partial_name(SMALL, 3)
    assert sorted(p.name for p in linked.iterdir()) == sorted(p.name for p in source.iterdir())
    weights = next(linked.glob("*.safetensors"))
    assert weights.stat().st_ino == (source / weights.name).stat().st_ino  # a hard link, not a copy
    assert not (bundle / "models" / partial_name(LARGE, 28)).exists()


def test_the_stage_run_twice_writes_the_same_bytes(params) -> None:
    """What DVC hashes, the metrics file included, must not change between runs of the same inputs (wall times go
    to MLflow only)."""
    import hashlib

    def snapshot() -> dict[str, str]:
        out = params.path(params.partial_checkpoints.output_dir)
        files = [*sorted(out.rglob("*")), params.path("reports") / "partial_checkpoints" / "metrics.json"]
        return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files if p.is_file()}

    partial_checkpoints.main(params)
    first = snapshot()
    partial_checkpoints.main(params)
    assert snapshot() == first and any(name.endswith(".safetensors") for name in first)
    assert any(name.endswith("metrics.json") for name in first)
